"""Run directories the figures read, computed once and cached.

``flowsim_run(cache, name, overrides)`` returns ``cache/NAME`` after making sure it holds
a finished run of the default configuration with ``overrides``: a missing or unfinished
folder is (re)computed; a folder whose files cannot be read, or whose configuration is
not the one asked for, is an error naming the folder (delete it to recompute).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

from flowsim.config import load_config
from flowsim.experiment import execute_run, observables_of_run
from flowsim.observables import Observables
from flowsim.rundir import CONFIG_FILE, META_FILE, load_run
from flowsim.stages import StageReport, detect_stages

TINY = ("time.t_end=150.0", "time.n_linear=16", "time.n_log=30")  # condensation and the first focus


class FigureInputError(RuntimeError):
    """A cached run directory that cannot be used."""


def flowsim_run(cache: Path, name: str, overrides: Sequence[str] = (), config_path: Path | None = None) -> Path:
    """The cached run ``cache/NAME`` of the given configuration, computed if missing."""
    config = load_config(config_path, list(overrides))
    run_dir = Path(cache) / name
    meta_path = run_dir / META_FILE
    if meta_path.is_file():
        try:
            status = json.loads(meta_path.read_text()).get("status_name")
            stored = load_config(run_dir / CONFIG_FILE)
            load_run(run_dir)
        except Exception as error:  # any unreadable file: the folder is corrupt
            raise FigureInputError(f"cached run {run_dir} is unreadable ({error}); delete the folder to recompute it") from None
        if stored.to_toml() != config.to_toml():
            raise FigureInputError(f"cached run {run_dir} holds a different configuration; delete the folder to recompute it")
        if status == "finished":
            return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted computation: start it again
    execute_run(config, run_dir, progress=False)
    return run_dir


def read_observables(run_dir: Path) -> Observables:
    """The run's observables (computed from its trajectory if missing)."""
    try:
        return observables_of_run(run_dir)
    except Exception as error:
        raise FigureInputError(f"cannot read the observables of {run_dir} ({error}); delete the folder to recompute it") from None


def observables_and_stages(run_dir: Path) -> tuple[Observables, StageReport]:
    """A one-layer run's observables and its detected stages."""
    observables = read_observables(run_dir)
    return observables, detect_stages(observables)
