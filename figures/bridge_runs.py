"""Bridge (torch) runs the figures read, trained once and cached like the flowsim runs."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Sequence

from figures.runs import FigureInputError, read_observables, run_name
from flowsim.config import shipped_config
from flowsim.runs.rundir import META_FILE

CONFIGS = shipped_config("bridge")


def bridge_run(cache: Path, config_name: str, overrides: Sequence[str] = ()) -> Path:
    """A finished bridge run of configs/bridge/CONFIG_NAME.toml with ``overrides``, cached in a
    folder named by its changes (as flowsim runs are); an unfinished one resumes, a foreign
    one is refused."""
    try:
        from flowsim.bridge.config import load_bridge_config
        from flowsim.bridge.train import train
    except ImportError as error:
        raise FigureInputError(f"this figure trains a torch model: install the bridge extra ({error})") from None
    from flowsim.config import ConfigError

    config_path = CONFIGS / f"{config_name}.toml"
    config = load_bridge_config(config_path, list(overrides))
    run_dir = Path(cache) / run_name(config, load_bridge_config(config_path), f"bridge-{config_name}")
    if (run_dir / META_FILE).is_file() and json.loads((run_dir / META_FILE).read_text()).get("status_name") == "finished":
        return run_dir
    try:
        train(config, run_dir, progress=False)
    except ConfigError as error:
        raise FigureInputError(f"cached bridge run {run_dir}: {error}") from None
    except FileNotFoundError as error:  # no corpora on this machine
        raise FigureInputError(str(error)) from None
    return run_dir


def ode_run(run_dir: Path):
    """The observables of the ODE integrated beside a bridge run (cached in RUN/ode/ by
    flowsim.bridge.compare.ode_beside), read as the figures read every run."""
    from flowsim.bridge.compare import ODE_DIR, ode_beside

    ode_beside(run_dir)
    return read_observables(run_dir / ODE_DIR)


def training_summary(run_dir: Path) -> str:
    """The run's vocabulary and SGD as a title line: d, learning rate, steps and batch, from its config.toml."""
    path = Path(run_dir) / "config.toml"
    try:
        config = tomllib.loads(path.read_text())
        data, optim = config["data"], config["optim"]
        d = data["vocab_size"] + 1  # the kept words and <unk>
        return f"d = {d}, SGD lr {optim['lr']:g}, {optim['steps']} steps, batch {data['batch_size']} × {data['s']} tokens"
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as error:
        raise FigureInputError(f"{path}: not a bridge run's config ({type(error).__name__}: {error}); expected its "
                               "[data] vocab_size, batch_size, s and [optim] lr, steps") from None
