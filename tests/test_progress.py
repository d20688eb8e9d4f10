"""The heartbeat of blocking computations: ``ticking`` and where the commands use it."""

import time

from flowsim import progress, sweep


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
    from flowsim import integration
    from flowsim.assemble import prepare
    from flowsim.config import resolve_config
    from flowsim.solvers import solve_flow

    made = []

    class CountedBar(integration.tqdm):
        def __init__(self, *arguments, **options):
            made.append(options)
            super().__init__(*arguments, **options)

    monkeypatch.setattr(integration, "tqdm", CountedBar)
    prepared = prepare(resolve_config({"time": {"t_end": 5.0, "n_linear": 6, "n_log": 3}}))
    for shown in (False, True):
        result = solve_flow(prepared.flow, prepared.params0, prepared.times, method="JaxRadau", progress=shown)
        assert result.status_name == "finished"
    assert len(made) == 1 and not made[0].get("disable", False)
