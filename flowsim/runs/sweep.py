"""Sweeps: a grid of configurations × seeds, each run labelled by the stage detectors,
collected into one table and a phase diagram.

    OUT/rows/NAME.json    one finished run: its parameters, stage onsets, end of condensation,
                          cycles, final loss, and its full resolved configuration; for a
                          two-layer model instead of stages: the premature-specialisation
                          probes (flowsim.observe.specialisation), the Bayes loss of a sequence task
                          and its circuit masses at the end, and the curves of loss, upper
                          entropy and basis angles
    OUT/sweep.csv         every finished row, in grid order
    OUT/sweep.json        the grid, the base configuration, versions, and the backend used
    OUT/phase_diagram.png end of condensation and onsets of focus, dilution and restart over
                          the first two grid keys (mean over seeds)

A row is written atomically the moment its run finishes, so an interrupted sweep, run
again with the same arguments, recomputes only the rows that are missing. A row made
with other settings (its stored configuration differs from the one the arguments give
now) is never taken over: the sweep refuses to run, naming the keys that differ, unless
``force_new`` recomputes such rows.

Runs are grouped into chunks of flows of one structure; with ``solver.method =
"JaxRadau"`` a chunk is integrated as one compiled batch (``solve_flow_batch``), with
any other method run by run. Chunks run in this process, in a pool of processes
(``backend="local"``, ``workers`` > 1), or on a Dask distributed cluster
(``backend="dask"``: a LocalCluster, or the scheduler at ``scheduler``). Every worker
process gets the same thread settings, so both backends compute identical rows (``flowsim.runs.sweep_backends``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


from flowsim.config import ConfigError, flat_settings, load_config
from flowsim.assemble import sequence_law, prepare
from flowsim.runs.labelling import stage_detectors_apply, stages_of
from flowsim.common.io import DamagedFileError, file_digest, read_json, write_atomic_bytes, write_atomic_json
from flowsim.methods import METHOD, method_for
from flowsim.observe.families import FAMILIES, compute_observables
from flowsim.common.progress import TICK_SECONDS, ticking
from flowsim.runs.rundir import check_output_dir, discard_unused_folder, folder_lock, library_versions
from flowsim.solve.status import Status
from flowsim.solve.solvers import solve_flow, solve_flow_batch
from flowsim.observe.stages import EVENT_STAGES
from flowsim.observe.specialisation import summarise
from flowsim.runs.sweep_backends import run_dask, run_local

BACKENDS = ("local", "dask")
# sweep.csv's columns: every row's, then those of the model families present (``ModelFamily.table_columns``)
COMMON_COLUMNS = ("seed", "status", "final_loss")


COST_COLUMNS = ("n_steps", "solve_seconds")


@dataclass(frozen=True)
class RunSpec:
    """One run of the sweep: its name, its grid values and the overrides that make it."""

    name: str
    values: dict
    seed: int
    overrides: tuple[str, ...]


def parse_grid(entries: Sequence[str]) -> dict[str, list]:
    """``section.key=[v1, v2, ...]`` (a TOML array) for each entry -> {key: values}."""
    grid: dict[str, list] = {}
    for entry in entries:
        key, sep, literal = entry.partition("=")
        key = key.strip()
        if not sep or "." not in key:
            raise ConfigError(f"--grid {entry!r}: expected section.key=[v1, v2, ...]")
        try:
            values = tomllib.loads(f"values = {literal.strip()}")["values"]
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--grid {entry!r}: the values are not a TOML array: {error}") from None
        if not isinstance(values, list) or not values:
            raise ConfigError(f"--grid {entry!r}: expected a non-empty list of values, got {values!r}")
        if len(set(map(repr, values))) != len(values):
            raise ConfigError(f"--grid {entry!r}: the values repeat")
        if key in grid:
            raise ConfigError(f"--grid names {key!r} twice")
        if key == "init.seed":
            raise ConfigError("--grid init.seed: use --seeds N for seeds")
        grid[key] = values
    return grid


MAX_SWEEP_ROWS = 100_000  # each row is a run directory's worth of files: a larger grid is a typo more often than a plan


def expand_grid(grid: dict[str, list], seeds: int) -> list[RunSpec]:
    """Every combination of the grid's values, for seeds 0 .. seeds-1, in grid order."""
    if not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"--seeds must be a positive integer, got {seeds!r}")
    size = seeds * math.prod(len(values) for values in grid.values())
    if size > MAX_SWEEP_ROWS:
        raise ConfigError(f"the sweep has {size} rows ({' × '.join(str(len(v)) for v in grid.values())} grid points × "
                          f"{seeds} seeds); at most {MAX_SWEEP_ROWS} are allowed: split it into several sweeps")
    specs = []
    for combination in itertools.product(*grid.values()):
        values = dict(zip(grid, combination))
        for seed in range(seeds):
            overrides = tuple(f"{key}={json.dumps(value)}" for key, value in values.items()) + (f"init.seed={seed}",)
            specs.append(RunSpec(row_name(values, seed), values, seed, overrides))
    return specs


ROW_NAME_LIMIT = 100  # longer readable names (a π of many entries) become a hash: file names stop at 255 bytes


def row_name(values: dict, seed: int) -> str:
    """``key=value_..._seed=N`` when short enough for a file name, else ``grid-<12 hex of the values>_seed=N``. A file
    name holds no "/": it is written %2F (and "%" as %25), so that two paths never share a name."""
    readable = ("_".join(f"{key}={value}" for key, value in values.items()) + f"_seed={seed}").replace("%", "%25")
    readable = readable.replace("/", "%2F")
    if len(readable.encode()) <= ROW_NAME_LIMIT:
        return readable
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]
    return f"grid-{digest}_seed={seed}"


def run_chunk(config_path: str | None, base_overrides: tuple[str, ...], specs: list[RunSpec], out: str,
              should_stop: Callable[[], bool] | None = None) -> list[dict]:
    """Integrate, observe and label ``specs``; write and return one row each.

    A chunk (``chunk_specs``) shares its flow structure, solver settings and save times,
    so with the JaxRadau method it is integrated as one batch. ``should_stop`` is polled by the solves (each
    chunk of their work under a second or so); once it says stop, the rows of the runs that finished are
    written and KeyboardInterrupt is raised: an interrupted run has no row, and the sweep computes it again.
    A run whose finished row for its configuration is already written (a chunk retried after its worker died
    wrote it on the first attempt) is not computed again: its row is returned as it is.
    """
    configs = [load_config(config_path, (*base_overrides, *spec.overrides)) for spec in specs]
    written = {spec.name: row for spec, config in zip(specs, configs)
               if (row := finished_row(Path(out) / "rows" / f"{spec.name}.json", config)) is not None}
    to_run = [(spec, config) for spec, config in zip(specs, configs) if spec.name not in written]
    computed = {row["name"]: row for row in _compute_rows(to_run, out, should_stop)} if to_run else {}
    return [written.get(spec.name) or computed[spec.name] for spec in specs]


def _compute_rows(runs: list[tuple[RunSpec, object]], out: str, should_stop: Callable[[], bool] | None) -> list[dict]:
    """``run_chunk``'s work on the (spec, config) pairs it has to compute."""
    specs, configs = [spec for spec, _ in runs], [config for _, config in runs]
    prepared = [prepare(config) for config in configs]
    solver = configs[0].solver
    if METHOD[method_for(solver.method)].batches:
        results = solve_flow_batch([p.flow for p in prepared], [p.params0 for p in prepared], prepared[0].times,
                                   rtol=solver.rtol, atol=solver.atol, max_steps=solver.max_steps, should_stop=should_stop)
    else:
        results = []
        for p, c in zip(prepared, configs):
            results.append(solve_flow(p.flow, p.params0, p.times, method=c.solver.method, rtol=c.solver.rtol,
                                      atol=c.solver.atol, max_steps=c.solver.max_steps, lr=c.solver.lr,
                                      should_stop=should_stop))
            if results[-1].status == Status.INTERRUPTED:
                break
    rows = []
    for spec, config, run, result in zip(specs, configs, prepared, results):
        if result.status == Status.INTERRUPTED:
            continue
        row = {**empty_row(spec, config, result.status_name), "final_loss": float(result.trajectory.loss[-1]),
               "n_steps": result.stats.n_steps, "solve_seconds": result.stats.solve_seconds}
        if not stage_detectors_apply(run.model) and len(result.trajectory) >= 4:
            # the two-layer probes, and the loss curve (times to any loss target are read from it)
            observables = compute_observables(result.trajectory, run.model, run.chain.pi, law=sequence_law(run.chain))
            summary = summarise(observables)
            row.update({"t_basis_mature": summary.t_basis_mature, "premature_index": summary.premature_index,
                        "upper_entropy_fall_at_maturity": summary.upper_entropy_fall_at_maturity,
                        "t_basis_final": summary.t_basis_final, "premature_index_final": summary.premature_index_final,
                        "t_upper_specialised": summary.t_upper_specialised,
                        "basis_turn_at_specialisation": summary.basis_turn_at_specialisation,
                        "bayes_loss": getattr(run.chain, "bayes_loss", None),
                        **{f"final_{name}": float(observables[name][-1]) for name in ("prev_token_mass", "induction_mass")
                           if name in observables.columns},
                        "curve": {"t": observables.t.tolist(), "loss": observables["loss"].tolist(),
                                  "upper_entropy": (observables["attention_entropy_2"] @ observables.constants["pi"]).tolist(),
                                  "basis_angle": observables["basis_angle"].tolist(),
                                  "basis_doubling_angle": observables["basis_doubling_angle"].tolist()}})
        # Without the flow: the detectors need no gradient norms.
        report = stages_of(result, run.model, compute_observables(result.trajectory, run.model, run.chain.pi,
                                                                   fold_d=config.observables.fold_d)) \
            if stage_detectors_apply(run.model) else None
        if report is not None:
            row.update({f"onset_{stage.name}": report.onset(stage.name) for stage in EVENT_STAGES})
            row["end_condensation"], row["cycles"] = report.end_of_condensation(), report.cycles
        write_atomic_json(Path(out) / "rows" / f"{spec.name}.json", row, indent=1)
        rows.append(row)
    if any(result.status == Status.INTERRUPTED for result in results):
        raise KeyboardInterrupt
    return rows


def empty_row(spec: RunSpec, config, status: str) -> dict:
    """A row's identity (name, grid values, seed), ``status`` and configuration, with every result still None."""
    return {"name": spec.name, **spec.values, "seed": spec.seed, "status": status, "final_loss": None,
            **{f"onset_{stage.name}": None for stage in EVENT_STAGES}, "end_condensation": None, "cycles": None,
            "n_steps": None, "solve_seconds": None, "config": resolved_settings(config)}


def finished_row(path: Path, config) -> dict | None:
    """The row at ``path`` if it is a finished row of exactly ``config`` (one a lost worker's attempt wrote before it
    died), else None: a missing, damaged, stale or lost row is computed again."""
    try:
        row = read_row(path) if path.is_file() else None
    except DamagedFileError:
        return None
    if row is None or row["status"] == WORKER_DIED or row.get("config") != resolved_settings(config):
        return None
    return row


def resolved_settings(config) -> dict:
    """A run's full resolved configuration as plain data, with the SHA-256 of every file it reads (``files``:
    init.file): what a row records, so a row made from other bytes at the same path is not reused."""
    settings = tomllib.loads(config.to_toml())
    if config.init.file is not None and Path(config.init.file).is_file():
        settings["files"] = {"init.file sha256": file_digest(Path(config.init.file))}
    return settings


def number_columns() -> tuple[str, ...]:
    """The columns a row holds as numbers (or null)."""
    return ("final_loss", *(column for family in FAMILIES.values() for column in family.table_columns() if column != "cycles"),
            *COST_COLUMNS)


def row_problem(row: object) -> str | None:
    """Why the content of a row file is not a sweep row (None where it is one)."""
    if not isinstance(row, dict):
        return f"it holds a JSON {type(row).__name__}, not an object"
    for key in ("name", "status"):
        if not isinstance(row.get(key), str):
            return f"its {key} is {row.get(key)!r}, expected a string"
    for key in number_columns():
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"its {key} is {value!r}, expected a number or null"
    return None


def read_row(path: Path) -> dict:
    """A row file, checked (``row_problem``); DamagedFileError names the file and what is wrong with it."""
    remedy = "run the sweep again with --force-new to recompute it"
    row = read_json(path, remedy)
    problem = row_problem(row)
    if problem is not None:
        raise DamagedFileError(path, f"not a sweep row: {problem}", remedy)
    return row


def stale_rows(config_path: str | None, base_overrides: tuple[str, ...], specs: list[RunSpec], out: Path) -> dict[str, str]:
    """The rows already in ``out`` that were made with other settings than ``specs`` give now:
    {row name: the keys that differ, old -> new}."""
    stale = {}
    for spec in specs:
        path = out / "rows" / f"{spec.name}.json"
        if not path.is_file():
            continue
        try:
            recorded = read_row(path).get("config")
        except DamagedFileError as error:
            stale[spec.name] = f"the row is damaged ({error.reason})"
            continue
        if not isinstance(recorded, dict):
            stale[spec.name] = "the row records no configuration (from an older flowsim)"
            continue
        old, new = flat_settings(recorded), flat_settings(resolved_settings(load_config(config_path, (*base_overrides, *spec.overrides))))
        value = lambda settings, key: settings.get(key, "(unset)")  # noqa: E731
        differing = sorted(key for key in old.keys() | new.keys() if value(old, key) != value(new, key))
        if differing:
            stale[spec.name] = ", ".join(f"{key}: {value(old, key)!r} -> {value(new, key)!r}" for key in differing)
    return stale


def chunk_specs(config_path: str | None, base_overrides: tuple[str, ...], specs: list[RunSpec], batch: int) -> list[list[RunSpec]]:
    """Consecutive runs of one flow structure, solver settings and save grid, at most
    ``batch`` to a chunk. Preparing every run here also validates its configuration."""
    if not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"--batch must be a positive integer, got {batch!r}")
    chunks: list[list[RunSpec]] = []
    last_key = None
    for spec in specs:
        config = load_config(config_path, (*base_overrides, *spec.overrides))
        prepared = prepare(config)
        key = (prepared.flow.structure_key, repr(config.solver), prepared.times.tobytes())
        if chunks and key == last_key and len(chunks[-1]) < batch:
            chunks[-1].append(spec)
        else:
            chunks.append([spec])
        last_key = key
    return chunks


WORKER_DIED = "worker_died"  # a row's status where every worker that ran it died (out of memory, killed)


def worker_died_row(config_path: str | None, base_overrides: tuple[str, ...], spec: RunSpec, out: str,
                    error) -> dict:
    """The row, written, of a run whose workers all died running it (``error``: Dask's KilledWorker): no results,
    the reason, and its configuration (the sweep run again computes it again)."""
    config = load_config(config_path, (*base_overrides, *spec.overrides))
    row = {**empty_row(spec, config, WORKER_DIED),
           "reason": f"each of the {error.allowed_failures + 1} workers that ran it died, the last at "
                     f"{error.last_worker.address} (out of memory, or killed: see the workers' logs)"}
    write_atomic_json(Path(out) / "rows" / f"{spec.name}.json", row, indent=1)
    return row


def _runs_of_chunk(task: tuple) -> list[tuple]:
    """A chunk's task as one task per run (to find which run kills its workers); [] for a single run."""
    config_path, base, specs, out = task
    return [(config_path, base, [spec], out) for spec in specs] if len(specs) > 1 else []


def _worker_died_rows(task: tuple, error) -> list[dict]:
    config_path, base, specs, out = task
    return [worker_died_row(config_path, base, specs[0], out, error)]


def model_kind(row: dict) -> str:
    """The model kind of a row file (rows written before it was recorded are one-layer)."""
    return row.get("config", {}).get("model", {}).get("kind", "one_layer")


def write_table(out: Path, specs: list[RunSpec], grid_keys: Sequence[str]) -> list[dict]:
    """sweep.csv from the row files present, in grid order; returns the rows."""
    rows = []
    for spec in specs:
        path = out / "rows" / f"{spec.name}.json"
        if path.is_file():
            try:
                rows.append(read_row(path))
            except DamagedFileError as error:
                raise ConfigError(str(error)) from None
    kinds = {model_kind(row) for row in rows}
    columns = ["name", *grid_keys, *COMMON_COLUMNS,
               *[column for kind, family in FAMILIES.items() if kind in kinds for column in family.table_columns()], *COST_COLUMNS]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: (missing_cell(row, key) if value is None else repr(value) if isinstance(value, float) else value)
                      for key, value in row.items()} for row in rows)
    write_atomic_bytes(out / "sweep.csv", buffer.getvalue().encode())
    return rows


NOT_REACHED_CELL = "not reached"


def missing_cell(row: dict, column: str) -> str:
    """What a table writes for a row's missing value: "not reached" for a time (an event) a finished run did not
    reach by its horizon, "-" (printed table) or "" (sweep.csv) otherwise, as the caller formats it."""
    return NOT_REACHED_CELL if column.startswith(("onset_", "end_", "t_")) and row.get("status") == Status.FINISHED.label else ""


def summary_table(rows: list[dict]) -> str:
    """The sweep at a glance, one line per row: status, final loss and the model's headline times, an event the
    run did not reach by its horizon written "not reached" (as in sweep.csv; the phase diagram counts the seeds of
    each cell that reached it)."""
    present = {model_kind(row) for row in rows}
    columns = ["name", "status", "final_loss",
               *[column for kind, family in FAMILIES.items() if kind in present for column in family.summary_columns()]]

    def cell(row: dict, column: str) -> str:
        value = row.get(column)
        if value is None:
            return missing_cell(row, column) or "-"
        return f"{value:.6g}" if isinstance(value, float) else str(value)

    table = [columns] + [[cell(row, c) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in table)


def run_sweep(
    config_path: Path | None,
    grid: dict[str, list],
    seeds: int,
    out: Path,
    *,
    base_overrides: Sequence[str] = (),
    backend: str = "local",
    workers: int = 1,
    scheduler: str | None = None,
    batch: int = 4,
    force_new: bool = False,
    progress: Callable[[str], None] = lambda message: None,
) -> list[dict]:
    """Run every missing row of the sweep and write the table and the phase diagram.

    Returns the rows in grid order. Raises ConfigError for a bad grid or configuration
    (checked on every run before anything is computed), and for rows in ``out`` made with
    other settings unless ``force_new`` (then they are computed again). The folder is locked while
    the sweep writes it (``rundir.folder_lock``): a second sweep into it gets ``FolderInUseError``.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers must be a positive integer, got {workers!r}")
    if not grid:
        raise ConfigError("a sweep needs at least one --grid section.key=[values]")
    config_text = None if config_path is None else str(config_path)
    base = tuple(base_overrides)
    specs = expand_grid(grid, seeds)
    out = Path(out)
    try:
        check_output_dir(out)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    made_here = not out.exists()
    try:
        with folder_lock(out, "sweep folder"):
            return _run_sweep_locked(grid, specs, out, config_text, base, seeds, backend, workers, scheduler, batch,
                                     force_new, progress)
    except ConfigError:
        if made_here:  # a configuration refused before any row was written leaves no folder behind
            discard_unused_folder(out)
        raise


def _run_sweep_locked(grid, specs, out, config_text, base, seeds, backend, workers, scheduler, batch, force_new,
                      progress) -> list[dict]:
    """``run_sweep`` once it holds the folder's lock."""
    from flowsim.runs.plots import plot_sweep_phase_diagram

    stale = stale_rows(config_text, base, specs, out)
    if stale and not force_new:
        first = next(iter(stale))
        raise ConfigError(f"--out {str(out)!r} holds {len(stale)} rows it cannot reuse, made with other settings or damaged (e.g. {first}: "
                          f"{stale[first]}); use a new --out, or --force-new to recompute them")
    done = {spec.name for spec in specs if (out / "rows" / f"{spec.name}.json").is_file() and spec.name not in stale
            and read_row(out / "rows" / f"{spec.name}.json")["status"] != WORKER_DIED}
    pending = [spec for spec in specs if spec.name not in done]
    chunks = chunk_specs(config_text, base, pending, batch)  # validates every run's configuration
    meta = {"config": config_text, "overrides": list(base), "grid": grid, "seeds": seeds, "backend": backend,
            "workers": workers, "scheduler": scheduler, "batch": batch, "versions": library_versions()}
    write_atomic_json(out / "sweep.json", meta)
    progress(f"{len(specs)} runs: {len(done)} already done, {len(pending)} to run in {len(chunks)} chunks")
    started, finished, last_row = time.perf_counter(), 0, time.perf_counter()

    def on_rows(rows: list[dict]) -> None:
        nonlocal finished, last_row
        finished += len(rows)
        last_row = time.perf_counter()
        progress(f"{finished}/{len(pending)} runs done, {last_row - started:.1f} s")

    def alive(seconds: float) -> None:  # a batch compiling or solving: a line when no row has come for a while
        if time.perf_counter() - last_row >= 2 * TICK_SECONDS:
            progress(f"{finished}/{len(pending)} runs done, {seconds:.0f} s (compiling and solving)")

    tasks = [(config_text, base, chunk, str(out)) for chunk in chunks]
    with ticking(alive, every=2 * TICK_SECONDS):
        if backend == "local":
            run_local(run_chunk, tasks, workers, on_rows)
        else:
            run_dask(run_chunk, tasks, workers, scheduler, on_rows, split=_runs_of_chunk, on_killed=_worker_died_rows)
    rows = write_table(out, specs, list(grid))
    two_layer = any("t_upper_specialised" in row for row in rows)  # no stages: its probes' times instead
    plot_sweep_phase_diagram(rows, list(grid), out / "phase_diagram.png",
                             columns=("t_upper_specialised", "t_basis_mature", "t_basis_final") if two_layer else
                             ("end_condensation", "onset_focus", "onset_dilution", "onset_restart"))
    return rows
