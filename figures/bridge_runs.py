"""Bridge (torch) runs the figures read, trained once and cached like the flowsim runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from figures.runs import FigureInputError
from flowsim.rundir import META_FILE

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "bridge"


def bridge_run(cache: Path, name: str, config_name: str | None, overrides: Sequence[str] = ()) -> Path:
    """``cache/NAME``: a finished bridge run of configs/bridge/CONFIG_NAME.toml (the default Markov
    run when None) with ``overrides``; an unfinished one resumes, a foreign one is refused."""
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.train import train
    from flowsim.config import ConfigError

    config = load_bridge_config(None if config_name is None else CONFIGS / f"{config_name}.toml", list(overrides))
    run_dir = Path(cache) / name
    if (run_dir / META_FILE).is_file() and json.loads((run_dir / META_FILE).read_text()).get("status_name") == "finished":
        return run_dir
    try:
        train(config, run_dir, progress=False)
    except ConfigError as error:
        raise FigureInputError(f"cached bridge run {run_dir}: {error}") from None
    return run_dir
