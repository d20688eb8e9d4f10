"""A text example's cycle horizon from its surrogate's flow alone, before any SGD run is looked at.

    python benchmarks/cycle_horizon.py CONFIG [--t-end 20000] [--work runs/cycle-horizon]

CONFIG is a bridge config (e.g. configs/bridge/tinystories-d64.toml). Its bigram surrogate's exact mean-field flow
is integrated by `flowsim run` from the start SGD would take (flowsim's N(0, ε²) draw seeded by data.seed: the
bridge's paper model draws the same), to ``--t-end``, and labelled on the whole vocabulary. It prints the stages
and the first whole cycle (a focus, a later dilution, a later restart), and proposes as horizon 1.3 × the last of
the three, rounded up to a multiple of lr × 100 steps: a rule fixed here, before any outcome it is used for.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

HORIZON_MARGIN = 1.3


def surrogate_run_config(bridge_config: Path, t_end: float, folder: Path) -> Path:
    """The surrogate as a `flowsim run` config file (its P in full), the bridge run's m, k, ε and seed."""
    import tomli_w

    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.surrogate import text_surrogate
    from flowsim.bridge.train import build_data

    config = load_bridge_config(bridge_config)
    chain, _ = text_surrogate(build_data(config).corpus, config.compare)
    sections = {"chain": {"P": chain.P.tolist()}, "model": {"m": config.model.m, "k": config.model.k},
                "init": {"eps": config.model.init_eps, "seed": config.data.seed},
                "time": {"t_end": t_end, "n_linear": 400, "n_log": 400}}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "surrogate.toml"
    path.write_text(tomli_w.dumps(sections))
    return path


def first_cycle(intervals: list[dict]) -> tuple[float, float, float] | None:
    """(focus, dilution, restart) onsets of the first whole cycle, in time order, or None."""
    focus = dilution = None
    for interval in sorted(intervals, key=lambda i: i["t_start"]):
        if interval["stage"] == "focus" and focus is None:
            focus = interval["t_start"]
        elif interval["stage"] == "dilution" and focus is not None and dilution is None:
            dilution = interval["t_start"]
        elif interval["stage"] == "restart" and dilution is not None:
            return focus, dilution, interval["t_start"]
    return None


def proposed_horizon(cycle: tuple[float, float, float], lr: float) -> float:
    step = lr * 100
    return math.ceil(HORIZON_MARGIN * cycle[2] / step) * step


def main() -> None:
    from flowsim.bridge.config import load_bridge_config
    from flowsim.config import find_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="a bridge config (a shipped one by name, e.g. bridge/tinystories-d64.toml)")
    parser.add_argument("--t-end", type=float, default=20000.0)
    parser.add_argument("--work", type=Path, default=Path("runs/cycle-horizon"))
    arguments = parser.parse_args()
    path = find_config(arguments.config)
    folder = arguments.work / Path(path).stem
    run_dir = folder / "run"
    if not (run_dir / "stages.json").is_file():
        config = surrogate_run_config(path, arguments.t_end, folder)
        subprocess.run([sys.executable, "-m", "flowsim", "run", str(config), "--out", str(run_dir), "--quiet"], check=True)
    print((run_dir / "stages.txt").read_text())
    cycle = first_cycle(json.loads((run_dir / "stages.json").read_text())["intervals"])
    if cycle is None:
        print(f"no whole cycle by t = {arguments.t_end:g}: integrate further (--t-end)")
        return
    lr = load_bridge_config(path).optim.lr
    print(f"first cycle: focus {cycle[0]:.4g}, dilution {cycle[1]:.4g}, restart {cycle[2]:.4g}; proposed horizon "
          f"t = {proposed_horizon(cycle, lr):g} ({proposed_horizon(cycle, lr) / lr:.0f} steps at lr = {lr:g})")


if __name__ == "__main__":
    main()
