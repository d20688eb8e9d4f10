"""flowsim sweep: rows equal independent runs, the local and Dask backends agree, an
interrupted sweep resumes without recomputing finished rows, bad grids fail clearly."""

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from flowsim.runs import sweep
from flowsim.cli import app
from flowsim.config import ConfigError, load_config
from flowsim.assemble import prepare
from flowsim.common.io import write_atomic_json
from flowsim.solve.solvers import solve_flow
from flowsim.observe.stages import EVENT_STAGES

SHORT = ["time.t_end=150", "time.n_linear=31", "time.n_log=30", "time.t_log_min=0.5"]


@pytest.mark.slow
def test_rows_equal_independent_runs_and_resume_recomputes_only_missing_rows(tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    arguments = ["sweep", "--grid", "chain.lam=[0.3, 0.7]", "--seeds", "2", "--out", str(out), "--batch", "4",
                 *[item for override in [*SHORT, 'solver.method="JaxRadau"'] for item in ("--set", override)]]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    table = (out / "sweep.csv").read_text()
    assert len(table.splitlines()) == 5
    rows = {row["name"]: row for row in (json.loads(path.read_text()) for path in (out / "rows").glob("*.json"))}
    assert len(rows) == 4 and (out / "phase_diagram.png").stat().st_size > 10_000
    # a row is what an independent run of its configuration gives
    row = rows["chain.lam=0.7_seed=1"]
    prepared = prepare(load_config(None, [*SHORT, "chain.lam=0.7", "init.seed=1"]))
    alone = solve_flow(prepared.flow, prepared.params0, prepared.times, method="JaxRadau")
    assert row["final_loss"] == pytest.approx(alone.trajectory.loss[-1], rel=1e-12)
    assert row["status"] == "finished" and 1 < row["onset_condensation"] < row["end_condensation"] < row["onset_focus"] < 150
    # the printed summary: a line per row with its status, loss and onsets, "not reached" where the row has none
    lines = [line for line in result.output.splitlines() if not line.startswith("flowsim: ")]  # not the progress
    assert lines[0].split() == ["name", "status", "final_loss", "end_condensation", "onset_focus", "onset_dilution", "onset_restart"]
    for name, stored in rows.items():
        printed = next(line for line in lines if line.startswith(name + " ")).split("  ")
        cells = [cell.strip() for cell in printed if cell.strip()]
        expected = [f"{stored[stage.column]:.6g}" if stored[stage.column] is not None else "not reached"
                    for stage in EVENT_STAGES]
        assert cells == [name, "finished", f"{stored['final_loss']:.6g}", *expected], (cells, expected)

    # interrupt: one row lost; the rerun computes that row alone and the table comes back the same
    (out / "rows" / "chain.lam=0.3_seed=1.json").unlink()
    stamps = {path.name: path.stat().st_mtime_ns for path in (out / "rows").glob("*.json")}
    computed = []
    original = sweep.run_chunk
    monkeypatch.setattr(sweep, "run_chunk", lambda *task, **options: computed.extend(spec.name for spec in task[2])
                        or original(*task, **options))
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    assert computed == ["chain.lam=0.3_seed=1"]
    assert {name: (out / "rows" / name).stat().st_mtime_ns for name in stamps} == stamps
    # the recomputed row, now integrated in a batch of one, agrees to rounding; the others are untouched
    new_table = (out / "sweep.csv").read_text()
    for old_line, new_line in zip(table.splitlines(), new_table.splitlines(), strict=True):
        if not old_line.startswith("chain.lam=0.3_seed=1,"):
            assert old_line == new_line
            continue
        old_values, new_values = old_line.split(",")[3:-1], new_line.split(",")[3:-1]  # status .. n_steps
        assert old_values[0] == new_values[0] == "finished"
        as_numbers = lambda values: np.array([value if value not in ("", "not reached") else "nan" for value in values],  # noqa: E731
                                             float)  # no onset
        np.testing.assert_allclose(as_numbers(new_values[1:]), as_numbers(old_values[1:]), rtol=1e-9)


@pytest.mark.slow
def test_local_pool_and_dask_cluster_give_identical_tables(tmp_path):
    grid = sweep.parse_grid(["chain.lam=[0.4, 0.8]"])
    overrides = [*SHORT, 'solver.method="LSODA"']
    tables = {}
    for backend in ("local", "dask"):
        out = tmp_path / backend
        rows = sweep.run_sweep(None, grid, 1, out, base_overrides=overrides, backend=backend, workers=2, batch=1)
        assert [row["status"] for row in rows] == ["finished", "finished"]
        tables[backend] = [{key: value for key, value in row.items() if key != "solve_seconds"} for row in rows]
    assert tables["local"] == tables["dask"]
    assert tables["local"][0]["final_loss"] != tables["local"][1]["final_loss"]


@pytest.mark.parametrize("entries, message", [
    (["chain.lam"], "expected section.key="),
    (["lam=[0.1]"], "expected section.key="),
    (["chain.lam=[0.1, 0.1]"], "repeat"),
    (["chain.lam=[]"], "non-empty list"),
    (["chain.lam=0.5"], "non-empty list"),
    (["chain.lam=[0.1", ], "not a TOML array"),
    (["init.seed=[1, 2]"], "--seeds"),
])
def test_bad_grids_are_refused(entries, message):
    with pytest.raises(ConfigError, match=message):
        sweep.parse_grid(entries)


def test_bad_sweep_settings_fail_before_any_run(tmp_path):
    grid = sweep.parse_grid(["chain.lamda=[0.1, 0.2]"])
    with pytest.raises(ConfigError, match="lamda"):
        sweep.run_sweep(None, grid, 1, tmp_path / "a")
    with pytest.raises(ConfigError, match="--backend"):
        sweep.run_sweep(None, sweep.parse_grid(["chain.lam=[0.1]"]), 1, tmp_path / "b", backend="spark")
    with pytest.raises(ConfigError, match="--seeds"):
        sweep.run_sweep(None, sweep.parse_grid(["chain.lam=[0.1]"]), 0, tmp_path / "c")
    assert not any((tmp_path / name / "rows").exists() for name in "abc")


def test_expand_grid_orders_runs_and_names_them():
    specs = sweep.expand_grid({"chain.lam": [0.2, 0.5], "init.eps": [0.001]}, 2)
    assert [spec.name for spec in specs] == [
        "chain.lam=0.2_init.eps=0.001_seed=0", "chain.lam=0.2_init.eps=0.001_seed=1",
        "chain.lam=0.5_init.eps=0.001_seed=0", "chain.lam=0.5_init.eps=0.001_seed=1"]
    assert specs[3].overrides == ("chain.lam=0.5", "init.eps=0.001", "init.seed=1")
    assert np.isclose(load_config(None, specs[3].overrides).chain.lam, 0.5)


def test_runs_with_other_solver_settings_or_save_times_are_not_batched_together():
    """A batch shares one rtol and one save grid, so a grid over either splits the chunks."""
    specs = sweep.expand_grid({"solver.rtol": [1e-8, 1e-6], "time.t_end": [100.0, 200.0]}, 1)
    chunks = sweep.chunk_specs(None, ('solver.method="JaxRadau"',), specs, batch=8)
    assert [len(chunk) for chunk in chunks] == [1, 1, 1, 1]
    same = sweep.expand_grid({"chain.lam": [0.3, 0.5, 0.7]}, 2)
    assert [len(chunk) for chunk in sweep.chunk_specs(None, (), same, batch=4)] == [4, 2]


def test_phase_diagram_takes_text_grid_values_and_leaves_unreached_cells_grey(tmp_path):
    from flowsim.runs.plots import _grid_values, plot_sweep_phase_diagram

    rows = [{"model.ffn": ffn, "flow.qk_rho": rho, "seed": seed, "t_basis_mature": None if ffn == "glu" else 10.0 * (seed + 1)}
            for ffn in ("mlp", "glu") for rho in (1.0, 0.25) for seed in range(2)]
    assert _grid_values(rows, "model.ffn") == ["glu", "mlp"] and _grid_values(rows, "flow.qk_rho") == [0.25, 1.0]
    path = plot_sweep_phase_diagram(rows, ["model.ffn", "flow.qk_rho"], tmp_path / "phase.png", columns=("t_basis_mature",))
    assert path.stat().st_size > 5_000


def test_phase_diagram_panels_share_one_colour_scale_and_say_why_a_cell_is_empty():
    import matplotlib.pyplot as plt

    from flowsim.runs.plots import NO_FINISHED_RUN, NOT_REACHED, phase_diagram_figure

    rows = [{"chain.lam": lam, "seed": seed, "status": "step_limit" if lam == 0.7 else "finished",
             "onset_focus": 50.0 * (seed + 1) if lam == 0.3 else None, "onset_restart": 4000.0 if lam < 0.7 else None}
            for lam in (0.3, 0.5, 0.7) for seed in range(2)]
    figure = phase_diagram_figure(rows, ["chain.lam"], ("onset_focus", "onset_restart"))
    focus, restart = figure.axes[:2]
    assert focus.images[0].get_clim() == restart.images[0].get_clim() == pytest.approx((np.log10(75.0), np.log10(4000.0)))
    assert focus.images[0].get_array()[0, 0] == pytest.approx(np.log10(75.0))  # the mean over seeds
    assert [text.get_text() for text in focus.texts] == [NOT_REACHED, NO_FINISHED_RUN]  # λ = 0.5 finished, 0.7 did not
    assert [text.get_text() for text in restart.texts] == [NO_FINISHED_RUN]
    plt.close(figure)


def test_rows_with_long_grid_values_get_short_distinct_names(tmp_path):
    """A π of 30 entries makes a readable name far over a file name's 255 bytes: such rows are named by a hash."""
    rng = np.random.default_rng(0)
    pis = [np.round(rng.dirichlet(np.ones(30)), 6).tolist() for _ in range(2)]
    specs = sweep.expand_grid({"chain.pi": pis, "chain.lam": [0.5]}, 2)
    names = [spec.name for spec in specs]
    assert len(set(names)) == 4 and all(len(name.encode()) <= sweep.ROW_NAME_LIMIT for name in names)
    assert names[0].startswith("grid-") and names[0].endswith("_seed=0")
    assert names == [spec.name for spec in sweep.expand_grid({"chain.pi": pis, "chain.lam": [0.5]}, 2)]  # stable
    for name in names:
        write_atomic_json(tmp_path / "rows" / f"{name}.json", {"name": name})
    assert sorted(path.stem for path in (tmp_path / "rows").iterdir()) == sorted(names)


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid:
            found.add(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_workers_exit_when_the_sweep_process_is_killed(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    sets = ["time.t_end=100000.0", "solver.method='Tsit5'", "solver.max_steps=50000000"]  # hours of work per row
    parent = subprocess.Popen([sys.executable, "-m", "flowsim.cli", "sweep", "--grid", "chain.lam=[0.3, 0.4]", "--workers", "2",
                               "--batch", "1", "--out", str(tmp_path / "sweep"), *[i for s in sets for i in ("--set", s)]],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while len(workers := _children(parent.pid)) < 2 and time.time() < deadline:  # the pool (and its resource tracker)
            time.sleep(0.5)
        assert len(workers) >= 2, "the sweep's workers did not start"
        time.sleep(3.0)  # the workers have run their initializer
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.time() + 30
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.5)
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived the killed sweep"


def _state(pid: int) -> str:
    try:
        return {"Z": "zombie"}.get(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0], "running")
    except (OSError, IndexError):
        return "zombie"


def test_sigint_stops_a_sweep_saying_what_is_kept(tmp_path, monkeypatch):
    """Ctrl-C reaches the command as KeyboardInterrupt (a solve in progress is not waited for): one line with the
    rows kept, exit 130."""
    def one_row_then_interrupted(config, grid, seeds, out, **options):
        write_atomic_json(out / "rows" / "chain.lam=0.3_seed=0.json", {"name": "chain.lam=0.3_seed=0"})
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "run_sweep", one_row_then_interrupted)
    result = CliRunner().invoke(app, ["sweep", "--grid", "chain.lam=[0.3, 0.4]", "--out", str(tmp_path / "sweep")])
    assert result.exit_code == 130
    assert f"interrupted: 1 row is written in {tmp_path / 'sweep' / 'rows'}" in result.output and "Traceback" not in result.output


def test_a_sweep_labels_its_rows_as_flowsim_run_labels_its_runs(tmp_path):
    """One labelling path: a diverged run gets no stage labels from `flowsim run`, nor from the sweep."""
    sets = ["time.t_end=2000", "solver.method=gradient_descent", "solver.lr=20"]
    result = CliRunner().invoke(app, ["sweep", "--grid", "chain.lam=[0.5]", "--out", str(tmp_path / "sweep"),
                                      *[i for s in sets for i in ("--set", s)]])
    assert result.exit_code == 1 and "did not finish" in result.output
    row = json.loads(next((tmp_path / "sweep" / "rows").iterdir()).read_text())
    assert row["status"] == "diverged"
    assert row["cycles"] is None and all(row[f"onset_{stage.name}"] is None for stage in EVENT_STAGES)


def test_the_table_has_the_columns_of_the_models_it_holds(tmp_path):
    """A one-layer sweep's sweep.csv has the stage onsets and no two-layer probes; a two-layer one the reverse."""
    import csv

    for kind, present, absent in (("one_layer", "onset_focus", "t_basis_mature"), ("two_layer", "t_basis_mature", "onset_focus")):
        specs = sweep.expand_grid({"chain.lam": [0.3]}, 1)
        row = {"name": specs[0].name, "chain.lam": 0.3, "seed": 0, "status": "finished", "final_loss": 0.5,
               present: 1.0, "config": {"model": {"kind": kind}}}
        write_atomic_json(tmp_path / kind / "rows" / f"{specs[0].name}.json", row)
        sweep.write_table(tmp_path / kind, specs, ["chain.lam"])
        with open(tmp_path / kind / "sweep.csv") as file:
            header = next(csv.reader(file))
        assert present in header and absent not in header, header


def test_row_names_never_collide_and_a_list_valued_axis_is_swept(tmp_path):
    """Two init files whose paths differ only by '/' and '-' get two rows; a grid over π (a list per value) runs,
    writes its table and draws its phase diagram."""
    specs = sweep.expand_grid({"init.file": ["/p/x-y.npz", "/p/x/y.npz"]}, 1)
    assert len({spec.name for spec in specs}) == 2 and all("/" not in spec.name for spec in specs)
    out = tmp_path / "pi"
    result = CliRunner().invoke(app, ["sweep", "--grid", "chain.pi=[[0.5, 0.5], [0.6, 0.4]]", "--set", "time.t_end=20",
                                      "--set", "time.n_linear=21", "--set", "time.n_log=5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(path.read_text()) for path in sorted((out / "rows").iterdir())]
    assert [row["chain.pi"] for row in rows] == [[0.5, 0.5], [0.6, 0.4]] and (out / "phase_diagram.png").stat().st_size > 0


def test_a_refused_sweep_leaves_no_folder_behind_but_keeps_an_existing_one(tmp_path):
    """A bad run configuration or --batch 0 is one line, and the --out it would have made does not exist
    afterwards; a folder that existed before (with its rows) is left as it was."""
    for extra in (["--set", "init.eps=-1"], ["--batch", "0"]):
        out = tmp_path / f"refused{len(extra[1])}"
        result = CliRunner().invoke(app, ["sweep", "--grid", "time.t_end=[5, 6]", *extra, "--out", str(out)])
        assert result.exit_code == 2 and not out.exists(), (extra, result.output)
    kept = tmp_path / "kept"
    small = ["--set", "time.n_linear=6", "--set", "time.n_log=3"]
    assert CliRunner().invoke(app, ["sweep", "--grid", "time.t_end=[5, 6]", *small, "--out", str(kept)]).exit_code == 0
    before = sorted(path.name for path in (kept / "rows").iterdir())
    assert CliRunner().invoke(app, ["sweep", "--grid", "time.t_end=[5, 6]", *small, "--batch", "0", "--out", str(kept)]).exit_code == 2
    assert sorted(path.name for path in (kept / "rows").iterdir()) == before


@pytest.mark.slow
def test_sigint_stops_a_sweep_inside_a_long_solve_keeping_its_finished_rows(tmp_path):
    """SIGINT while the second row's long Tsit5 solve runs (in the sweep's own process): the sweep stops within
    seconds, exit 130, the first row kept and no row for the interrupted run; the same command would continue."""
    import signal
    import sys

    from conftest import interrupt_once

    command = [sys.executable, "-m", "flowsim.cli", "sweep", "--grid", "time.t_end=[20, 100000]", "--set",
               "loss.kind='monte_carlo'", "--set", "loss.mc_samples=2000", "--set", "solver.method='Tsit5'", "--batch", "1",
               "--out", str(tmp_path / "sweep")]
    returncode, stderr = interrupt_once(command, lambda progress: b"1/2 runs done" in progress, signal.SIGINT)
    assert returncode == 130, stderr.decode()
    assert b"interrupted: 1 row is written" in stderr
    assert [path.name for path in (tmp_path / "sweep" / "rows").iterdir()] == ["time.t_end=20_seed=0.json"]


def sigint_blocked(pid: int) -> bool | None:
    """Whether SIGINT is in process ``pid``'s blocked mask (Linux's /proc), None where that cannot be read."""
    import signal

    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return bool(blocked >> (signal.SIGINT - 1) & 1)


@pytest.mark.slow
def test_sigterm_to_a_sweep_with_worker_processes_stops_them_and_no_row_comes_after(tmp_path):
    """SIGTERM to a sweep with two worker processes, once its first row is written: exit 130, the workers are gone,
    no row file appears afterwards, and nothing but the sweep's own line is said. The workers hold SIGINT blocked
    (a terminal's Ctrl-C reaches the whole process group, and the sweep process stops them itself)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "flowsim.cli", "sweep", "--grid", "time.t_end=[20, 30, 40, 50, 60, 70, 80, 90]",
               "--set", "loss.kind='monte_carlo'", "--set", "loss.mc_samples=4000", "--set", "solver.method='Tsit5'",
               "--batch", "1", "--workers", "2", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    while not (out / "rows").is_dir() or not any((out / "rows").iterdir()):
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    workers = psutil.Process(process.pid).children(recursive=True)
    spawned = [worker for worker in workers if "spawn_main" in " ".join(worker.cmdline())]
    assert len(spawned) == 2, [worker.cmdline() for worker in workers]
    assert {sigint_blocked(worker.pid) for worker in spawned} <= {True, None}
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr.decode()
    # no word from the workers (a worker stopped while tqdm's semaphore was alive left the resource tracker to warn)
    assert stderr.decode().strip().splitlines()[-1].startswith("interrupted: ") and "Warning" not in stderr.decode()
    written = sorted(path.name for path in (out / "rows").iterdir())
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive
    time.sleep(2)
    assert sorted(path.name for path in (out / "rows").iterdir()) == written and len(written) < 8


class KILLED:
    """What a row needs of Dask's KilledWorker."""

    allowed_failures = 3
    last_worker = type("Worker", (), {"address": "tcp://10.0.0.1:4000"})


def test_a_chunk_run_again_computes_only_its_runs_without_a_finished_row(tmp_path, monkeypatch):
    """A chunk retried after its worker died skips the runs whose finished row for the same configuration is written,
    and computes again a run whose row says its workers died, or was made with other settings."""
    small = ("time.n_linear=6", "time.n_log=3")
    specs = sweep.expand_grid({"time.t_end": [5, 6, 7]}, 1)
    out = tmp_path / "sweep"
    first = sweep.run_chunk(None, small, specs[:1], str(out))[0]
    stamp = (out / "rows" / f"{specs[0].name}.json").stat().st_mtime_ns
    sweep.worker_died_row(None, small, specs[1], str(out), KILLED)
    sweep.run_chunk(None, (*small, "chain.lam=0.4"), specs[2:], str(out))  # the same run under another setting
    computed = []
    original = sweep._compute_rows
    monkeypatch.setattr(sweep, "_compute_rows", lambda runs, *rest: computed.extend(spec.name for spec, _ in runs)
                        or original(runs, *rest))
    rows = sweep.run_chunk(None, small, specs, str(out))
    assert computed == [specs[1].name, specs[2].name]
    assert rows[0] == first and (out / "rows" / f"{specs[0].name}.json").stat().st_mtime_ns == stamp
    assert [row["status"] for row in rows] == ["finished"] * 3
    # the sweep run again runs the chunk of a row whose workers died, and no other
    sweep.worker_died_row(None, small, specs[1], str(out), KILLED)
    chunks = []
    original_chunk = sweep.run_chunk
    monkeypatch.setattr(sweep, "run_chunk", lambda *task, **options: chunks.append([s.name for s in task[2]])
                        or original_chunk(*task, **options))
    rows = sweep.run_sweep(None, {"time.t_end": [5, 6, 7]}, 1, out, base_overrides=small)
    assert chunks == [[specs[1].name]] and [row["status"] for row in rows] == ["finished"] * 3


def test_a_cell_where_only_some_seeds_reached_the_event_says_how_many_and_the_csv_says_not_reached(tmp_path):
    """Three seeds per cell, one of which reaches the focus where λ = 0.8: that cell's colour is the mean of the one,
    it is hatched and says 1/3; the cells every seed reached say nothing. sweep.csv writes "not reached" where the
    printed table does, for a finished run's missing event."""
    import matplotlib.pyplot as plt

    from flowsim.runs.plots import phase_diagram_figure

    rows = [{"chain.lam": lam, "seed": seed, "status": "finished",
             "onset_focus": None if lam == 0.8 and seed > 0 else 100.0 * (seed + 1)} for lam in (0.2, 0.8) for seed in range(3)]
    figure = phase_diagram_figure(rows, ["chain.lam"], ("onset_focus",))
    axis = figure.axes[0]
    assert [text.get_text() for text in axis.texts] == ["1/3"]
    assert axis.images[0].get_array()[0, 1] == pytest.approx(np.log10(100.0))  # the one seed that reached it
    assert axis.images[0].get_array()[0, 0] == pytest.approx(np.log10(200.0))  # the mean of all three
    assert len(axis.patches) == 1 and axis.patches[0].get_hatch() == "//"
    assert any("k/N" in text.get_text() for legend in figure.legends for text in legend.get_texts())
    plt.close(figure)
    specs = sweep.expand_grid({"chain.lam": [0.2, 0.8]}, 3)
    for spec, row in zip(specs, sorted(rows, key=lambda r: (r["chain.lam"], r["seed"]))):
        write_atomic_json(tmp_path / "rows" / f"{spec.name}.json", {**row, "name": spec.name, "config": {}})
    sweep.write_table(tmp_path, specs, ["chain.lam"])
    table = (tmp_path / "sweep.csv").read_text()
    assert table.count("not reached") == 2 and "not reached" in sweep.summary_table(sweep.write_table(tmp_path, specs, ["chain.lam"]))


def test_a_row_made_from_an_init_file_whose_bytes_changed_is_not_reused(tmp_path):
    """A sweep from init.file, run again after the file was overwritten with other weights: refused, exit 2, naming
    the file's digest (its path is the same); the same bytes touched are reused; --force-new recomputes."""
    import os

    from flowsim import OneLayerTransformer

    model = OneLayerTransformer(d=4, m=8, k=8)
    init = tmp_path / "sub" / "a.npz"
    init.parent.mkdir()
    np.savez(init, **model.init(1e-3, 0))
    arguments = ["sweep", "--grid", "chain.lam=[0.5]", "--out", str(tmp_path / "sweep"),
                 *[item for override in [*SHORT, f"init.file='{init}'"] for item in ("--set", override)]]
    first = CliRunner().invoke(app, arguments)
    assert first.exit_code == 0, first.output
    row_file = next((tmp_path / "sweep" / "rows").glob("*.json"))
    row, stamp = json.loads(row_file.read_text()), row_file.stat().st_mtime_ns
    os.utime(init, (1e9, 1e9))  # touched, the same bytes: the row is reused
    again = CliRunner().invoke(app, arguments)
    assert again.exit_code == 0 and row_file.stat().st_mtime_ns == stamp, again.output
    np.savez(init, **model.init(1e-3, 1))  # other weights at the same path
    refused = CliRunner().invoke(app, arguments)
    assert refused.exit_code == 2 and "files.init.file sha256" in refused.output, refused.output
    forced = CliRunner().invoke(app, [*arguments, "--force-new"])
    assert forced.exit_code == 0, forced.output
    recomputed = json.loads(next((tmp_path / "sweep" / "rows").glob("*.json")).read_text())
    assert recomputed["final_loss"] != row["final_loss"]
