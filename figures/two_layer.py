"""The shipped two-layer experiments (configs/two_layer) as cached runs, for figures 10-12."""

from __future__ import annotations

from pathlib import Path

from figures.runs import flowsim_run
from flowsim.config import shipped_config

SHIPPED = shipped_config("two_layer")
TINY_TWO_LAYER = ("time.t_end=20.0", "time.n_linear=21", "time.n_log=15")


def two_layer_run(cache: Path, name: str, tiny: bool) -> Path:
    """The cached run of configs/two_layer/NAME.toml (its first t = 20 when ``tiny``)."""
    return flowsim_run(cache, TINY_TWO_LAYER if tiny else (), config_path=SHIPPED / f"{name}.toml")
