"""The heartbeat of blocking computations: ``ticking`` and where the commands use it."""

import time

import pytest

from flowsim.common import progress
from flowsim.runs import sweep


def test_ticking_says_the_seconds_so_far_until_the_block_ends():
    said = []
    with progress.ticking(said.append, every=0.05):
        time.sleep(0.32)
    count = len(said)
    time.sleep(0.15)
    assert 4 <= count <= 7 and len(said) == count, said  # none after the block
    assert all(0.04 < later - earlier < 0.2 for earlier, later in zip(said, said[1:])) and said[0] >= 0.05


def test_a_sweep_says_it_is_alive_while_its_first_batch_compiles(tmp_path, monkeypatch):
    """Before its first row a sweep prints the seconds so far (it compiles its solver there), not nothing."""
    monkeypatch.setattr(sweep, "TICK_SECONDS", 0.05)
    lines = []
    sweep.run_sweep(None, {"time.t_end": [5, 6]}, 1, tmp_path / "sweep", progress=lines.append,
                    base_overrides=("time.n_linear=6", "time.n_log=3"))
    waiting = [line for line in lines if line.endswith("s (compiling and solving)")]
    assert waiting and waiting[0].startswith("0/2 runs done, "), lines


def test_a_solve_without_progress_makes_no_progress_bar_and_one_with_it_makes_one(monkeypatch):
    """The flow's progress bar exists only when shown: even a disabled tqdm makes tqdm's multiprocessing lock, a named
    semaphore that a sweep worker stopped by SIGTERM left behind for Python's resource tracker to warn of."""
    from flowsim.solve import integration
    from flowsim.assemble import prepare
    from flowsim.config import resolve_config
    from flowsim.solve.solvers import solve_flow

    made = []
    real = integration.progress_bar

    def counted_bar(**options):
        made.append(options)
        return real(**options)

    monkeypatch.setattr(integration, "progress_bar", counted_bar)
    prepared = prepare(resolve_config({"time": {"t_end": 5.0, "n_linear": 6, "n_log": 3}}))
    for shown in (False, True):
        result = solve_flow(prepared.flow, prepared.params0, prepared.times, method="JaxRadau", progress=shown)
        assert result.status_name == "finished"
    assert len(made) == 1 and not made[0].get("disable", False)


def test_progress_in_a_log_file_is_a_plain_line_every_five_percent(capsys):
    """stderr is not a terminal under capture: 1000 updates make 20 lines (not 1000 redraws), each naming what runs,
    how far (percent and count), and the postfix; a disabled one says nothing."""
    bar = progress.progress_bar(total=1000, desc="sgd on wikitext2", unit="step")
    assert isinstance(bar, progress.LineProgress)
    with bar:
        for step in range(1000):
            bar.update(1)
            if step == 500:
                bar.set_postfix_str("validation loss 3.1")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 21 and "\r" not in "".join(lines), lines
    assert lines[0].startswith("sgd on wikitext2:   0% (0/1000 step) ") and lines[1].startswith("sgd on wikitext2:   5% (50/1000 step) ") and lines[-1].startswith("sgd on wikitext2: 100% (1000/1000 step, validation loss 3.1) ")
    with progress.progress_bar(total=10, desc="quiet", disable=True) as silent:
        silent.update(10)
        silent.set_description_str("still quiet", refresh=True)
    assert capsys.readouterr().err == ""
    heartbeat = progress.progress_bar(total=10, desc="flow")
    capsys.readouterr()  # its first line
    heartbeat.set_description_str("flow compiling 5 s", refresh=True)  # the compile heartbeat: a line of its own
    heartbeat.set_description_str("flow t=3", refresh=False)  # a step's new label waits for the next 5%
    assert capsys.readouterr().err == "flow compiling 5 s\n"


@pytest.mark.slow
def test_a_run_logged_to_a_file_writes_plain_lines(tmp_path):
    """`flowsim run` with stderr redirected: the flow's progress is a few plain lines naming the solver and t, no bar."""
    import subprocess
    import sys

    with open(tmp_path / "log", "w") as log:
        subprocess.run([sys.executable, "-m", "flowsim", "run", "--out", str(tmp_path / "run"), "--set", "time.t_end=30.0",
                        "--set", "time.n_linear=31", "--set", "time.n_log=10", "--set", "model.m=4", "--set", "model.k=4"],
                       stderr=log, stdout=subprocess.DEVNULL, check=True, timeout=300)
    text = (tmp_path / "log").read_text()
    flow_lines = [line for line in text.splitlines() if line.startswith("flow (JaxBDF) t=")]
    assert "\r" not in text and 1 <= len(flow_lines) <= 21, text
    assert flow_lines[-1].startswith("flow (JaxBDF) t=30/30: 100% (of log(1 + t)) "), flow_lines
