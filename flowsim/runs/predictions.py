"""The theory applied to run configurations and run directories: the one place its results are read or written.

``theory`` is a library of pure functions (a configuration in, predictions out). Here they meet the file
system: ``cached_prediction`` keeps a configuration's predicted rows in a cache folder so that ``flowsim
compare`` does not predict twice; ``compare_run`` puts them beside a run directory's detected stages and
writes compare.json there; ``pathwise_of_run`` computes a two-layer run's pathwise factors once and keeps
them in its pathwise.npz.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import flowsim
import theory
from flowsim.common.caches import cache_dir
from flowsim.config import ConfigError, RunConfig, load_config
from flowsim.assemble import sequence_law, prepare
from flowsim.runs.labelling import label_run
from flowsim.common.io import REMEDY, DamagedFileError, file_digest, read_json, read_npz, write_atomic_json, write_atomic_npz
from flowsim.model.models import PositionalTwoLayerTransformer
from flowsim.runs.rundir import CONFIG_FILE, load_run
from theory.pathwise import PathwiseFactors, check_pathwise_supported, pathwise_along, positional_pathwise_along
from theory.predict import PredictionSummary, Row, compared_rows, predict_run

COMPARE_JSON = "compare.json"
PATHWISE_NPZ = "pathwise.npz"


def _source_digest() -> str:
    """The theory's own source and the detectors': a cached prediction is reused only by the code that made it."""
    digest = hashlib.sha256()
    for path in sorted(Path(theory.__file__).parent.glob("*.py")) + [Path(flowsim.__file__).parent / "observe" / "stages.py"]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def prediction_cache_dir() -> Path | None:
    """FLOWSIM_PREDICTION_CACHE: a directory, or "off"; by default the user's cache directory (``flowsim.common.caches``)."""
    chosen = cache_dir("FLOWSIM_PREDICTION_CACHE", "predictions")
    return None if chosen is None else Path(chosen)


def prediction_key(config: RunConfig) -> str:
    """A digest of everything the prediction depends on: chain, model, init (its file by its bytes, not its path:
    the same start copied elsewhere is the same prediction), loss, flow, the horizon, and the code
    (``_source_digest``)."""
    sections = config.to_dict()
    relevant = {name: sections.get(name) for name in ("chain", "model", "init", "loss", "flow")}
    relevant["init"] = {key: value for key, value in (relevant["init"] or {}).items() if key != "file"}
    relevant["t_end"] = float(config.time.t_end)
    relevant["code"] = _source_digest()
    if config.init.file is not None:
        relevant["init_file"] = file_digest(Path(config.init.file))
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_prediction(config: RunConfig, progress: Callable[[str], None] = lambda message: None) -> PredictionSummary:
    """``predict_run``'s rows and constants, from the cache when the same prediction was made before."""
    folder = prediction_cache_dir()
    path = None if folder is None else folder / f"{prediction_key(config)}.json"
    if path is not None and path.is_file():  # an entry that is a folder is not a cached prediction
        try:
            summary = PredictionSummary.from_json(read_json(path))
            progress(f"prediction read from the cache ({path})")
            return summary
        except (DamagedFileError, KeyError, TypeError, ValueError):
            pass  # a damaged cache entry is recomputed
    prediction = predict_run(config, progress)
    summary = PredictionSummary(prediction.rows, prediction.constants(), prediction.t_end)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic_json(path, summary.to_json())
        except OSError as error:
            progress(f"prediction not cached ({error})")
    return summary


def compare_run(run_dir: Path, progress: Callable[[str], None] = lambda message: None) -> tuple[list[Row], PredictionSummary]:
    """Predicted beside measured for a run directory (the prediction cached); writes compare.json there. A config.toml
    edited after the run started is refused, naming the keys: its predictions would be another flow's."""
    from flowsim.runs.experiment import check_unedited

    run_dir = Path(run_dir)
    config = load_config(run_dir / CONFIG_FILE)
    run = load_run(run_dir)
    check_unedited(run_dir, config, run.meta, f"compare {str(run_dir)!r}",
                   "its predictions would be another flow's than the one measured. Restore it to compare")
    summary = cached_prediction(config, progress)
    rows = compared_rows(summary.rows, label_run(run_dir), run.trajectory.t)
    write_atomic_json(run_dir / COMPARE_JSON, {"rows": [asdict(row) for row in rows]})
    return rows, summary


def pathwise_of_run(run_dir: Path) -> PathwiseFactors:
    """The factors of a two-layer run directory: read pathwise.npz, or compute and save it."""
    run_dir = Path(run_dir)
    if (run_dir / PATHWISE_NPZ).is_file():
        arrays = read_npz(run_dir / PATHWISE_NPZ)
        fields = {field.name for field in dataclasses.fields(PathwiseFactors)}
        if set(arrays) == fields:
            return PathwiseFactors(**arrays)
        if not set(arrays) < fields:  # an older version's cache has fewer arrays: computed again below
            raise DamagedFileError(run_dir / PATHWISE_NPZ, f"unexpected arrays {sorted(set(arrays) - fields)}", REMEDY)
    config = load_config(run_dir / CONFIG_FILE)
    prepared = prepare(config)
    try:
        check_pathwise_supported(prepared.model, config.loss.kind)
    except ValueError as error:
        raise ConfigError(f"{run_dir}: {error}") from None
    trajectory = load_run(run_dir).trajectory
    if isinstance(prepared.model, PositionalTwoLayerTransformer):
        factors = positional_pathwise_along(trajectory, prepared.model, sequence_law(prepared.chain), prepared.flow)
    else:
        factors = pathwise_along(trajectory, prepared.model, prepared.chain, prepared.flow)
    write_atomic_npz(run_dir / PATHWISE_NPZ, dataclasses.asdict(factors))
    return factors
