"""Run directories: the resolved config, the trajectory and the metadata of one run.

    RUN_DIR/config.toml      the full resolved configuration
    RUN_DIR/trajectory.npz   t (ascending, t[0] = 0), loss, W0, W_Q, W_K, W1 (leading axis = time)
    RUN_DIR/meta.json        status, seed, solver statistics, wall time, library versions
    RUN_DIR/observables.npz  observables over time (and observables.csv), see flowsim.observables
    RUN_DIR/summary.png      loss, singular values of W0, attention entropy per query

Every file is written atomically (temporary file, then rename), so an interrupted run
leaves the last complete version of each.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import platform
from dataclasses import dataclass
from pathlib import Path

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from flowsim.io import write_atomic_bytes, write_atomic_json
from flowsim.trajectory import Trajectory

CONFIG_FILE, TRAJECTORY_FILE, META_FILE, SUMMARY_FIGURE = "config.toml", "trajectory.npz", "meta.json", "summary.png"


def library_versions() -> dict[str, str]:
    """Versions of python and of the numerical libraries a result depends on."""
    versions = {"python": platform.python_version()}
    for package in ("flowsim", "jax", "jaxlib", "diffrax", "equinox", "scipy", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def new_run_dir(root: Path, name: str) -> Path:
    """A fresh folder root/NAME-YYYYmmdd-HHMMSS (suffixed if it exists)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate = root / f"{name}-{stamp}"
    suffix = 1
    while candidate.exists():
        candidate = root / f"{name}-{stamp}-{suffix}"
        suffix += 1
    candidate.mkdir(parents=True)
    return candidate


def write_config(run_dir: Path, toml_text: str) -> None:
    write_atomic_bytes(run_dir / CONFIG_FILE, toml_text.encode())


def write_meta(run_dir: Path, meta: dict) -> None:
    write_atomic_json(run_dir / META_FILE, meta)


@dataclass(frozen=True)
class Run:
    """A loaded run directory."""

    path: Path
    config: dict
    trajectory: Trajectory
    meta: dict


def load_run(run_dir: Path | str) -> Run:
    """Read config.toml, trajectory.npz and meta.json of a run directory."""
    run_dir = Path(run_dir)
    missing = [name for name in (CONFIG_FILE, TRAJECTORY_FILE, META_FILE) if not (run_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a complete run directory: missing {', '.join(missing)}")
    config = tomllib.loads((run_dir / CONFIG_FILE).read_text())
    meta = json.loads((run_dir / META_FILE).read_text())
    return Run(path=run_dir, config=config, trajectory=Trajectory.load(run_dir / TRAJECTORY_FILE), meta=meta)
