"""Run directories the figures read, computed once and cached.

``flowsim_run(cache, overrides, config_path)`` returns the cache folder of that
configuration, named by what it changes from its base (``default``, or the config file),
so figures that ask for the same run share it. Where the cache has no finished run of a configuration, a
finished run of exactly that configuration beside the cache (``flowsim run`` writes runs/NAME-TIMESTAMP next to
the default cache runs/figures) is read instead of computing it again. A missing or unfinished folder is
(re)computed; a folder whose files cannot be read, or whose configuration is not the one asked for, is an error
naming the folder (delete it to recompute).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Sequence

from figures import FigureInputError  # noqa: F401 (the figures import it from here too)
from flowsim.config import Sections, load_config
from flowsim.runs.experiment import execute_run, pinned_config
from flowsim.runs.labelling import observables_of_run
from flowsim.observe.observables import Observables
from flowsim.runs.rundir import CONFIG_FILE, META_FILE, load_run
from flowsim.observe.stages import StageReport, detect_stages
from flowsim.solve.status import Status

TINY = ("time.t_end=150.0", "time.n_linear=16", "time.n_log=30")  # condensation and the first focus
ONSET_TIMES = ("time.t_end=400.0", "time.n_linear=41", "time.n_log=200")  # past the first focus and σ1 for ε >= 1e-6


def run_name(config: Sections, base: Sections, base_name: str) -> str:
    """``BASE_NAME`` followed by each setting that differs from ``base``, e.g.
    ``default_chain.lam=0.8_time.t_end=150.0`` (a long name is cut and given a hash)."""
    wanted, reference = config.to_dict(), base.to_dict()
    changes = []
    for section, values in wanted.items():
        for key, value in values.items():
            if reference[section].get(key) != value:
                shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
                changes.append(f"{section}.{key}={shown}")
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "", "_".join([base_name, *changes]))
    if len(name) > 120:
        name = name[:110] + "-" + hashlib.sha1(config.to_toml().encode()).hexdigest()[:8]
    return name


def flowsim_run(cache: Path, overrides: Sequence[str] = (), config_path: Path | None = None) -> Path:
    """The cached run of ``config_path`` (the default configuration when None) with
    ``overrides``, computed if missing."""
    config = load_config(config_path, list(overrides))
    base_name = "default" if config_path is None else f"{Path(config_path).parent.name}-{Path(config_path).stem}"
    run_dir = Path(cache) / run_name(config, load_config(config_path), base_name)
    meta_path = run_dir / META_FILE
    if meta_path.is_file():
        try:
            status = json.loads(meta_path.read_text()).get("status_name")
            stored = load_config(run_dir / CONFIG_FILE)
            load_run(run_dir)
        except Exception as error:  # any unreadable file: the folder is corrupt
            raise FigureInputError(f"cached run {run_dir} is unreadable ({error}); delete the folder to recompute it") from None
        if pinned_config(stored).to_toml() != pinned_config(config).to_toml():  # "auto" and its method alike
            raise FigureInputError(f"cached run {run_dir} holds a different configuration; delete the folder to recompute it")
        if status == "finished":
            return run_dir
    finished_elsewhere = finished_run_beside(Path(cache), config)
    if finished_elsewhere is not None:
        return finished_elsewhere
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted computation: start it again
    result = execute_run(config, run_dir, progress=False)
    if result.status == Status.INTERRUPTED:  # SIGINT: no figure is drawn from a cut-short run
        raise KeyboardInterrupt
    if result.status != Status.FINISHED:
        raise FigureInputError(f"the run {run_dir} stopped with status {result.status_name!r} ({result.message}) at "
                               f"t = {result.t_reached:.6g}")
    return run_dir


def finished_run_beside(cache: Path, config: Sections) -> Path | None:
    """A finished run directory of exactly ``config`` directly under the cache's parent folder, if one is there
    (the first by name; a folder that is no readable run is passed over)."""
    folder = cache.resolve().parent
    wanted = pinned_config(config).to_toml()
    for candidate in sorted(folder.iterdir()) if folder.is_dir() else ():
        try:
            finished = json.loads((candidate / META_FILE).read_text()).get("status_name") == "finished"
            if finished and pinned_config(load_config(candidate / CONFIG_FILE)).to_toml() == wanted:
                load_run(candidate)
                return candidate
        except Exception:  # not a run directory, or not one that can be read: not a match
            continue
    return None


def default_run(cache: Path, tiny: bool, overrides: Sequence[str] = ()) -> Path:
    """The paper's default run (π = (0.75, 0.19, 0.05, 0.01), λ = 0.5, ε = 1e-3, t <= 6000) with
    ``overrides``; only its first t = 150 when ``tiny``."""
    return flowsim_run(cache, [*overrides, *(TINY if tiny else ())])


def onset_run(cache: Path, eps: float, lam: float, tiny: bool) -> Path:
    """The default run at initial scale ε and chain λ up to the first focus, with atol
    scaled to ε² (the loss moves by O(ε²) before condensation)."""
    times = TINY if tiny else ONSET_TIMES
    return flowsim_run(cache, [f"init.eps={eps}", f"chain.lam={lam}", *times, f"solver.atol={min(1e-12, 1e-4 * eps**2):g}"])


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
