"""Predicted (the flowsim ODE) beside measured (a bridge run): stage times in t = lr × steps.

* Markov data: the ODE of the same chain, model and initial parameters, with the exact
  finite-s loss for the run's context length s; its observables are measured with the
  run's own probe set (the ODE parameters loaded into the torch model), so both sides
  are read by identical code.
* Text: a Markov surrogate, the bigram chain of the training tokens folded to the
  run's top-d tokens plus "other" (``flowsim.bridge.data.markov_surrogate``), integrated
  with the mean-field loss from flowsim's seeded initialisation at the run's ε.

Both sides are labelled by flowsim's detectors. Each stage event (stage, query or
direction, occurrence) is a row with the ODE's onset, the run's and the relative error
(condensation: its end, as in ``flowsim compare``); the order agreement is the fraction
of pairs of events seen on both sides that happen in the same order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from flowsim.bridge.config import BridgeConfig, load_bridge_config
from flowsim.bridge.data import markov_surrogate
from flowsim.bridge.models import torch_model_for
from flowsim.bridge.observables import checkpoint_observables, stack_observables
from flowsim.bridge.train import CHECKPOINT_FILE, build_data, type_names
from flowsim.config import ConfigError, resolve_config
from flowsim.experiment import prepare
from flowsim.io import read_json, write_atomic_json
from flowsim.observables import OBSERVABLES_NPZ, Observables, compute_observables
from flowsim.rundir import CONFIG_FILE, META_FILE, TRAJECTORY_FILE, status_of
from flowsim.solvers import solve_flow
from flowsim.stages import StageReport, detect_stages, subject_label
from flowsim.trajectory import Trajectory

BRIDGE_COMPARE_JSON = "compare.json"


@dataclass(frozen=True)
class EventRow:
    stage: str
    query: int | None
    direction: int | None
    occurrence: int
    name: str  # the query's token ("-" for directions)
    predicted: float | None
    measured: float | None
    rel_error: float | None


def _events(report: StageReport) -> dict[tuple, float]:
    """(stage, query, direction, occurrence) -> time (condensation: its end; others: onset)."""
    seen: dict[tuple, int] = {}
    events = {}
    for interval in report.intervals:
        if interval.stage == "plateau":
            continue
        base = (interval.stage, interval.query, interval.direction)
        seen[base] = seen.get(base, 0) + 1
        time = interval.t_end if interval.stage == "condensation" else interval.t_start
        if time is not None:
            events[(*base, seen[base])] = float(time)
    return events


def order_agreement(predicted: dict[tuple, float], measured: dict[tuple, float]) -> float | None:
    """The fraction of pairs of common events ordered alike (None with fewer than two)."""
    common = sorted(set(predicted) & set(measured), key=str)
    pairs = [(a, b) for i, a in enumerate(common) for b in common[i + 1:]]
    if not pairs:
        return None
    same = sum(np.sign(predicted[a] - predicted[b]) == np.sign(measured[a] - measured[b]) for a, b in pairs)
    return float(same / len(pairs))


def ode_observables(config: BridgeConfig, run_dir: Path, t: np.ndarray, progress: bool = False) -> tuple[Observables, dict]:
    """Integrate the ODE beside the run and return its observables and a description."""
    data = build_data(config)
    method = config.compare.method or ("Tsit5" if data.chain is not None else "LSODA")
    solver = {"method": method, "rtol": config.compare.rtol, "atol": config.compare.atol}
    model_keys = config.model.flowsim_keys()
    if data.chain is not None:
        chain = config.chain.model_dump(exclude_none=True)
        ode_config = resolve_config({"chain": chain, "model": model_keys, "loss": {"kind": "finite", "s": config.data.s},
                                     "init": {"eps": config.model.init_eps, "seed": config.data.seed}, "solver": solver})
        prepared = prepare(ode_config)
        params0 = Trajectory.load(run_dir / TRAJECTORY_FILE).at(0)  # the run's own start
        result = solve_flow(prepared.flow, params0, t, method=solver["method"], rtol=solver["rtol"], atol=solver["atol"], progress=progress)
        twin = torch_model_for(prepared.model)
        probe = data.probe_set()
        rows = []
        for i in range(len(result.trajectory)):
            row = checkpoint_observables(twin.load_flowsim_params(result.trajectory.at(i)), probe, data.frequencies)
            row["loss"] = row["val_loss"] = np.asarray(result.trajectory.loss[i])
            rows.append(row)
        observables = stack_observables(result.trajectory.t, rows, probe.pi)
        return observables, {"ode": f"finite-s exact loss, s = {config.data.s}, from the run's initial parameters",
                             "status": result.status_name}
    surrogate = markov_surrogate(data.corpus.train, data.fold())
    ode_config = resolve_config({"chain": {"P": surrogate.P.tolist()}, "model": model_keys, "loss": {"kind": "mean_field"},
                                 "init": {"eps": config.model.init_eps, "seed": config.data.seed}, "solver": solver})
    prepared = prepare(ode_config)
    result = solve_flow(prepared.flow, prepared.params0, t, method=solver["method"], rtol=solver["rtol"], atol=solver["atol"], progress=progress)
    observables = compute_observables(result.trajectory, prepared.model, prepared.chain.pi)
    return observables, {"ode": f"mean-field loss on the Markov surrogate over {surrogate.d} folded types",
                         "surrogate_pi": surrogate.pi.tolist(), "status": result.status_name}


def check_bridge_run(run_dir: Path) -> None:
    """A finished (or deliberately stopped) bridge run directory, or a ValueError saying what it is instead."""
    if not (run_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no {CONFIG_FILE}")
    if not (run_dir / CHECKPOINT_FILE).is_file():
        hint = "; for a `flowsim run` directory use `flowsim compare`" if (run_dir / TRAJECTORY_FILE).is_file() else ""
        raise ValueError(f"{run_dir} is not a `flowsim bridge train` run directory (no {CHECKPOINT_FILE}){hint}")
    meta = read_json(run_dir / META_FILE) if (run_dir / META_FILE).is_file() else {}
    status = status_of(meta)
    if status not in ("finished", "stopped") or not (run_dir / OBSERVABLES_NPZ).is_file():
        raise ValueError(f"the bridge run in {run_dir} has not finished (status {status!r}, step "
                         f"{meta.get('steps_done', '?')} of {meta.get('steps', '?')}): resume it with "
                         f"`flowsim bridge train {run_dir / CONFIG_FILE} --out {run_dir}`")


def compare_bridge_run(run_dir: Path, progress: bool = False) -> tuple[list[EventRow], float | None, dict]:
    """Rows of predicted (ODE) vs measured (run) stage times; writes compare.json in ``run_dir``."""
    run_dir = Path(run_dir)
    check_bridge_run(run_dir)
    config = load_bridge_config(run_dir / CONFIG_FILE)
    if config.model.kind != "one_layer":
        raise ConfigError(f"bridge compare labels stages of the one-layer model; this run has model.kind = {config.model.kind!r}")
    measured_observables = Observables.load(run_dir)
    t = measured_observables.t
    ode, description = ode_observables(config, run_dir, t, progress)
    measured = _events(detect_stages(measured_observables))
    predicted = _events(detect_stages(ode))
    names = [str(name) for name in measured_observables.constants.get("type_names", type_names(build_data(config)))]
    rows = []
    for key in sorted(set(predicted) | set(measured), key=lambda k: (min(predicted.get(k, np.inf), measured.get(k, np.inf)), str(k))):
        stage, query, direction, occurrence = key
        p, m = predicted.get(key), measured.get(key)
        error = None if p is None or m is None or m == 0 else abs(p - m) / m
        rows.append(EventRow(stage, query, direction, occurrence, names[query] if query is not None else "-", p, m, error))
    agreement = order_agreement(predicted, measured)
    payload = {"rows": [asdict(row) for row in rows], "order_agreement": agreement, **description}
    write_atomic_json(run_dir / BRIDGE_COMPARE_JSON, payload)
    return rows, agreement, description


def bridge_table(rows: list[EventRow], agreement: float | None) -> str:
    lines = [f"{'stage':13} {'q/dir':6} {'#':>2} {'token':12} {'ODE':>10} {'run':>10} {'rel.err':>8}"]
    for row in rows:
        show = lambda value: "-" if value is None else f"{value:.4g}"  # noqa: E731
        error = "-" if row.rel_error is None else f"{100 * row.rel_error:.1f}%"
        lines.append(f"{row.stage:13} {subject_label(row.query, row.direction):6} {row.occurrence:2d} {row.name[:12]:12} "
                     f"{show(row.predicted):>10} {show(row.measured):>10} {error:>8}")
    lines.append(f"order agreement: {'-' if agreement is None else f'{agreement:.2f}'} (pairs of events seen on both sides)")
    return "\n".join(lines)
