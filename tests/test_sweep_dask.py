"""flowsim sweep on a Dask cluster that fails under it: a worker killed mid-sweep, the scheduler lost, a run that
exhausts its worker's memory. The cluster is a real one (``dask scheduler`` and ``dask worker`` processes), reached
with ``--scheduler`` as on a shared machine. And a sweep on its own LocalCluster, interrupted."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")

from flowsim import sweep_backends  # noqa: E402

from flowsim.runs import sweep

# rows of a few seconds each: long enough to kill a worker in the middle of one
ROWS = ["--grid", "time.t_end=[20, 30, 40, 50]", "--set", "loss.kind='monte_carlo'", "--set", "loss.mc_samples=3000",
        "--set", "solver.method='Tsit5'", "--batch", "1"]
QUIET = {**os.environ, **sweep_backends.WORKER_THREAD_ENV, "PYTHONUNBUFFERED": "1",
         "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "5s"}  # a lost scheduler is given up after 5 s, not 30


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def cluster(port: int, workers: int = 2, memory_limit: str = "0", allowed_failures: int = 3):
    """A scheduler and ``workers`` single-threaded worker processes (each under a nanny that restarts it)."""
    env = {**QUIET, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": str(allowed_failures)}
    address = f"tcp://127.0.0.1:{port}"
    scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port",
                                  str(port), "--no-dashboard"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", str(workers),
                               "--nthreads", "1", "--memory-limit", memory_limit, "--no-dashboard"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with distributed.Client(address, timeout="30s") as client:
            client.wait_for_workers(workers, timeout=60)
            yield address, scheduler
    finally:
        for process in (worker, scheduler):
            process.terminate()
        for process in (worker, scheduler):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def sweep_command(address: str, out: Path, rows=ROWS) -> list[str]:
    return [sys.executable, "-m", "flowsim.cli", "sweep", *rows, "--backend", "dask", "--scheduler", address, "--out", str(out)]


def table_without_timings(out: Path) -> list[list[str]]:
    lines = [line.split(",") for line in (out / "sweep.csv").read_text().splitlines()]
    column = lines[0].index("solve_seconds")
    return [line[:column] + line[column + 1:] for line in lines]


def row_stamps(out: Path) -> dict[str, int]:
    rows = out / "rows"
    # the finished rows only (not a row's temporary file while it is written)
    return {path.name: path.stat().st_mtime_ns for path in rows.glob("*.json")} if rows.is_dir() else {}


@pytest.mark.slow
def test_a_worker_killed_mid_sweep_is_replaced_and_the_table_equals_a_clean_runs(tmp_path):
    """SIGKILL to the worker once the first row of its two-run chunk is written: the sweep finishes (exit 0), the
    chunk is run again on the restarted worker computing only its lost run (the row written before is not written
    again), and the table equals that of a sweep nobody disturbed."""
    rows = [*ROWS[:-1], "2"]  # chunks of two runs, one after the other
    with cluster(free_port(), workers=1) as (address, _):
        clean = subprocess.run(sweep_command(address, tmp_path / "clean", rows), env=QUIET, capture_output=True, timeout=300)
        assert clean.returncode == 0, clean.stderr.decode()

        out = tmp_path / "disturbed"
        process = subprocess.Popen(sweep_command(address, out, rows), env=QUIET, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first_seen: dict[str, int] = {}
        killed = None
        with distributed.Client(address, timeout="30s") as client:
            while process.poll() is None:
                for name, stamp in row_stamps(out).items():
                    first_seen.setdefault(name, stamp)
                if killed is None and first_seen:
                    busy = [worker for worker, keys in client.processing().items() if keys]
                    if busy:
                        killed = client.run(os.getpid, workers=busy[:1])[busy[0]]
                        os.kill(killed, signal.SIGKILL)
                time.sleep(0.1)
        stdout, stderr = process.communicate()
    assert killed is not None, "no worker was running a row once the first row was written"
    assert process.returncode == 0, stderr.decode()
    final = row_stamps(out)
    assert all(final[name] == stamp for name, stamp in first_seen.items()), "a row file was written twice"
    assert table_without_timings(out) == table_without_timings(tmp_path / "clean")


@pytest.mark.slow  # the default selection checks the lost scheduler's two signs with a client faked below
def test_a_lost_scheduler_is_one_line_and_the_same_command_resumes_keeping_every_row(tmp_path):
    """The scheduler killed once a row is written: one line naming it, exit 1, no traceback; with a scheduler back at
    the same address the same command finishes and leaves the rows written before untouched."""
    port = free_port()
    out = tmp_path / "sweep"
    with cluster(port, workers=1) as (address, scheduler):
        process = subprocess.Popen(sweep_command(address, out), env=QUIET, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while not row_stamps(out):
            assert process.poll() is None, process.communicate()
            time.sleep(0.1)
        scheduler.kill()
        _, stderr = process.communicate(timeout=120)
    text = stderr.decode()
    assert process.returncode == 1, text
    assert f"flowsim: error: lost the Dask scheduler at {address} during the sweep" in text and "Traceback" not in text, text
    kept = row_stamps(out)  # the worker may have finished the row it was running before it stopped
    assert 1 <= len(kept) < 4
    with cluster(port, workers=1) as (address, _):
        again = subprocess.run(sweep_command(address, out), env=QUIET, capture_output=True, timeout=300)
    assert again.returncode == 0, again.stderr.decode()
    assert len(row_stamps(out)) == 4 and {name: row_stamps(out)[name] for name in kept} == kept


@pytest.mark.slow
def test_a_run_that_exhausts_its_workers_memory_is_marked_and_the_others_finish(tmp_path):
    """One run of the grid needs more memory than a worker may use: the nanny kills each worker that runs it, its row
    says so (status worker_died, the reason), the other rows finish, exit 1 naming it; the sweep run again tries it
    again."""
    rows = ["--grid", "loss.mc_samples=[1000, 400000]", "--set", "loss.kind='monte_carlo'", "--set", "solver.method='Tsit5'",
            "--set", "time.t_end=20", "--batch", "2"]
    out = tmp_path / "sweep"
    with cluster(free_port(), workers=1, memory_limit="1.5GB", allowed_failures=1) as (address, _):
        result = subprocess.run(sweep_command(address, out, rows), env=QUIET, capture_output=True, timeout=300)
    assert result.returncode == 1, result.stderr.decode()
    assert "runs that did not finish: loss.mc_samples=400000_seed=0" in result.stderr.decode()
    finished, died = (sweep.read_row(out / "rows" / f"loss.mc_samples={n}_seed=0.json") for n in (1000, 400000))
    assert finished["status"] == "finished" and finished["final_loss"] > 0
    assert died["status"] == sweep.WORKER_DIED and "died" in died["reason"] and died["final_loss"] is None
    assert "worker_died" in (out / "sweep.csv").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("to_the_group", [True, False], ids=["terminal-ctrl-c", "sweep-process-alone"])
def test_an_interrupted_sweep_on_its_local_cluster_says_one_line_and_leaves_no_worker(tmp_path, to_the_group):
    """SIGINT once the first row is written, to the whole process group (a terminal's Ctrl-C, which reaches every
    worker) or to the sweep process alone: exit 130, the workers are gone, and nothing is said after the progress
    lines but the sweep's own line (each worker printed its event loop's KeyboardInterrupt traceback, then Dask
    warned of every task it cancelled)."""
    import psutil

    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "flowsim.cli", "sweep", *ROWS, "--workers", "2", "--backend", "dask", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=QUIET, start_new_session=True)
    try:
        while not row_stamps(out):
            assert process.poll() is None, process.communicate()
            time.sleep(0.2)
        workers = psutil.Process(process.pid).children(recursive=True)
        (os.killpg if to_the_group else os.kill)(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    said = [line for line in stderr.decode().splitlines() if not line.startswith("flowsim: ")]
    assert process.returncode == 130, stderr.decode()
    assert len(said) == 1 and said[0].startswith("interrupted: "), stderr.decode()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive


def lost_while_fetching():
    from distributed.comm.core import CommClosedError

    return CommClosedError("in <TCP (closed) ConnectionPool.gather>: ConnectionResetError: [Errno 104] Connection reset by peer")


@pytest.mark.parametrize("sign", [lambda: distributed.CancelledError("run-0"), lost_while_fetching],
                         ids=["future_cancelled", "connection_closed_while_fetching"])
def test_a_lost_scheduler_is_the_one_line_error_however_it_shows(monkeypatch, sign):
    """The scheduler gone shows as a cancelled future, or, when it dies while a finished run's result is being
    fetched, as Dask's CommClosedError (an OSError, which a run's own error would otherwise be): both are the lost
    scheduler, one line (the cluster test above meets the second now and then)."""

    class Future:
        key = "run-0"

        def result(self):
            raise sign()

    class ClientOfALostScheduler:
        def __init__(self, address):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            return False

        def submit(self, work, *task, pure):
            return Future()

    monkeypatch.setattr(distributed, "Client", ClientOfALostScheduler)
    monkeypatch.setattr(distributed, "as_completed", iter)
    results = []
    with pytest.raises(sweep_backends.ClusterLost, match="^lost the Dask scheduler at tcp://127.0.0.1:1 during the sweep"):
        sweep_backends.run_dask(print, [("row",)], 1, "tcp://127.0.0.1:1", results.append, split=lambda task: [],
                                on_killed=lambda task, error: None)
    assert results == []
