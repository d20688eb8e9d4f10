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
