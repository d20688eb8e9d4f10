"""Predicted (the flowsim ODE) beside measured (a bridge run): stage times in t = lr × steps.

* Markov data: the ODE of the same chain, model and initial parameters, with the exact
  finite-s loss for the run's context length s; its observables are measured with the
  run's own probe set (the ODE parameters loaded into the torch model), so both sides
  are read by identical code.
* Text: a Markov surrogate, the bigram chain of the training split over the run's whole
  vocabulary (``surrogate.text_surrogate``: d = vocab_size + 1, by default interpolated with the
  unigram law so that its π is the corpus's token frequencies), with the mean-field loss (or, by
  ``compare.surrogate_loss``, its loss at the run's s: to second order, with a sampled remainder, or sampled),
  from the run's own initial parameters and measured with the run's probe set as well;
  folding into tracked types and "other" is only how both sides are displayed.

Both sides are labelled by flowsim's detectors. Each stage event (stage, query or
direction, occurrence) is a row with the ODE's onset, the run's and the relative error
(condensation: its end, as in ``flowsim compare``); the order agreement is the fraction
of pairs of events seen on both sides that happen in the same order.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from flowsim.bridge.config import BridgeConfig, CompareConfig, load_bridge_config
from flowsim.bridge.models import torch_model_for
from flowsim.bridge.observables import checkpoint_observables, stack_observables
from flowsim.bridge.surrogate import text_surrogate
from flowsim.bridge.train import CHECKPOINT_FILE, DataSource, build_data, run_title, type_names
from flowsim.config import ConfigError
from flowsim.observe.families import family_of
from flowsim.model.flow import GradientFlow
from flowsim.common.interrupts import stop_requests
from flowsim.common.io import DamagedFileError, file_digest, read_json, write_atomic_json
from flowsim.model.losses import make_loss_function
from flowsim.model.models import model_from_config
from flowsim.runs.labelling import MIN_SAMPLES_FOR_STAGES
from flowsim.observe.observables import MEASURED_BY, OBSERVABLES_NPZ, Observables, stage_observables
from flowsim.runs.plots import plot_overlay
from flowsim.runs.rundir import CONFIG_FILE, TRAJECTORY_FILE, read_meta, status_of
from flowsim.methods import AUTO
from flowsim.solve.solvers import JaxBDF, solve_flow
from flowsim.observe import stages
from flowsim.observe.stages import detect_stages, subject_label
from flowsim.solve.status import Status
from flowsim.solve.trajectory import Trajectory

BRIDGE_COMPARE_JSON = "compare.json"
OVERLAY_FIGURE = "overlay.png"  # the run beside the ODE: loss, σ(W0), attention entropies
ODE_DIR = "ode"  # the ODE's observables beside a run (RUN/ode/observables.npz)
ODE_JSON = "ode.json"


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


def relative_error(value: float | None, reference: float | None) -> float | None:
    """|value - reference| / reference (None when either is missing or the reference is 0)."""
    return None if value is None or reference is None or reference == 0 else abs(value - reference) / reference


def order_agreement(predicted: dict[tuple, float], measured: dict[tuple, float]) -> float | None:
    """The fraction of pairs of common events ordered alike (None with fewer than two)."""
    common = sorted(set(predicted) & set(measured), key=str)
    pairs = [(a, b) for i, a in enumerate(common) for b in common[i + 1:]]
    if not pairs:
        return None
    same = sum(np.sign(predicted[a] - predicted[b]) == np.sign(measured[a] - measured[b]) for a, b in pairs)
    return float(same / len(pairs))


def ode_observables(config: BridgeConfig, run_dir: Path, t: np.ndarray, progress: bool = False) -> tuple[Observables, dict]:
    """Integrate the ODE beside the run, from the run's own initial parameters, and measure
    it with the run's probe set (the ODE's parameters loaded into the torch twin), so both
    sides are read by identical code. Returns its observables and a description."""
    data = build_data(config)
    method = config.compare.method or ("Tsit5" if data.chain is not None else AUTO)
    model = model_from_config(config.model, data.vocab_size)
    if data.chain is not None:
        chain, loss_kind = data.chain, "finite"
        ode = f"finite-s exact loss, s = {config.data.s}, from the run's initial parameters"
        extra = {}
    else:
        chain, extra = text_surrogate(data.corpus, config.compare)
        loss_kind = {"sampled": "monte_carlo"}.get(config.compare.surrogate_loss, config.compare.surrogate_loss)
        law = {"monte_carlo": f"loss at s = {config.data.s} on {config.compare.samples} sampled sequences of",
               "finite_second_order": (f"loss at s = {config.data.s} to second order in the window's composition"
                                       + (f" (Markov correlations among the {config.compare.kept_types} most frequent "
                                          "types)" if config.compare.kept_types else "") + " on"),
               "finite_control_variate": (f"loss at s = {config.data.s} to second order in the window's composition, "
                                          f"plus its remainder on {config.compare.samples} sampled windows, on"),
               "mean_field": "mean-field loss on"}[loss_kind]
        ode = (f"{law} the bigram chain of the training split over all {chain.d} tokens "
               f"({extra['estimator']}), from the run's initial parameters")
    params0 = Trajectory.load(run_dir / TRAJECTORY_FILE).at(0)  # the run's own start
    folded = loss_kind == "finite_second_order" and (config.compare.kept_types or chain.d) < chain.d
    if method == AUTO and folded:  # its Hessian is the mean composition's (O(d² m) a product): exact products
        method = JaxBDF(jacobian_products="exact")
    try:
        loss = make_loss_function(model, chain, loss_kind, config.data.s, mc_samples=config.compare.samples,
                                  settings={"s": "data.s", "mc_samples": "compare.samples"},
                                  kept_types=config.compare.kept_types)
        flow = GradientFlow(loss, params0)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    with stop_requests() as stop:  # a Ctrl-C stops the solve at its next chunk, not after it
        result = solve_flow(flow, params0, t, method=method, rtol=config.compare.rtol, atol=config.compare.atol,
                            progress=progress, should_stop=stop)
    if stop():
        raise KeyboardInterrupt  # nothing of the ODE is cached: the same command solves it again
    observables = measured_like_the_run(model, result.trajectory, data)
    description = {"ode": ode, "method": result.method, "status": result.status_name,
                   "solve_seconds": result.stats.solve_seconds, **extra}
    if data.chain is None:  # text: also the theory's own reading, attention over the whole vocabulary
        description["full_vocabulary_events"] = full_vocabulary_events(result.trajectory, chain.pi)
    return observables, description


def full_vocabulary_events(trajectory: Trajectory, pi: np.ndarray) -> list[dict]:
    """The first occurrence of every event the detectors see on a one-layer trajectory read as the theory reads its
    own: the mean-field attention over the whole vocabulary (``stage_observables``), not the run's probe set, whose
    folded types average a query's attention over windows. O(T d² k)."""
    events = detect_stages(stage_observables(trajectory, pi)).events()
    return [{"stage": stage, "query": query, "direction": direction, "t": time}
            for (stage, query, direction, occurrence), time in events.items() if occurrence == 1]


def measured_like_the_run(model, trajectory: Trajectory, data: DataSource) -> Observables:
    """A flowsim trajectory's observables measured as the run's are: its parameters loaded into the torch twin
    and read on the run's probe set (the loss column is the trajectory's own loss)."""
    twin = torch_model_for(model)
    probe = data.probe_set()
    rows = []
    for i in range(len(trajectory)):
        row = checkpoint_observables(twin.load_flowsim_params(trajectory.at(i)), probe, data.frequencies)
        row["loss"] = row["val_loss"] = np.asarray(trajectory.loss[i])
        rows.append(row)
    return stack_observables(trajectory.t, rows, probe.pi, family_of(model).kind)


SAMPLED_LOSSES = ("finite_control_variate", "sampled")  # the surrogate losses read on compare.samples windows


def settings_read(compare: CompareConfig) -> dict:
    """The [compare] settings as the ODE of its loss reads them: those its loss ignores (``samples`` but for a loss
    that samples windows, ``kept_types`` but for the second-order one) at their defaults, so changing them does not
    recompute a cached flow that never read them."""
    settings = compare.model_dump()
    defaults = {name: field.default for name, field in CompareConfig.model_fields.items()}
    if compare.surrogate_loss not in SAMPLED_LOSSES:
        settings["samples"] = defaults["samples"]
    if compare.surrogate_loss != "finite_second_order":
        settings["kept_types"] = defaults["kept_types"]
    return settings


def ode_beside(run_dir: Path, progress: bool = False, surrogate_loss: str | None = None,
               kept_types: int | None = None, samples: int | None = None) -> tuple[Observables, dict]:
    """``ode_observables`` on the run's checkpoint times, cached in RUN/ode/ (observables.npz
    and ode.json); recomputed when the run's start, checkpoints, [compare] settings or the stage detectors changed.
    ``surrogate_loss`` (text runs) puts the flow of another of the surrogate's losses beside the run instead of
    ``compare.surrogate_loss``'s, with ``kept_types`` and ``samples`` in place of the run's ``compare.kept_types`` and
    ``compare.samples`` where given. Each loss has its own folder, whichever is the run's: RUN/ode/ the mean field's,
    RUN/ode-LOSS/ another's (RUN/ode-LOSS-nSAMPLES/ for one that samples windows)."""
    run_dir = Path(run_dir)
    config = load_bridge_config(run_dir / CONFIG_FILE)
    update = {name: value for name, value in (("surrogate_loss", surrogate_loss), ("kept_types", kept_types),
                                              ("samples", samples)) if value is not None}
    if update:
        config = config.model_copy(update={"compare": config.compare.model_copy(update=update)})
    t = Observables.load(run_dir).t
    key = {"compare": settings_read(config.compare), "t_digest": hashlib.sha256(np.asarray(t, float).tobytes()).hexdigest(),
           "trajectory_sha256": file_digest(run_dir / TRAJECTORY_FILE),  # the start the ODE integrates from
           "readings": ["probe set", "full vocabulary"],  # what the ODE's description holds (older caches: the first)
           "detectors": file_digest(Path(stages.__file__))}  # the full-vocabulary events are the detectors' reading
    loss = config.compare.surrogate_loss
    ode_dir = run_dir / (ODE_DIR if loss == "mean_field" or config.data.kind == "markov" else f"{ODE_DIR}-{loss}"
                         + (f"-n{config.compare.samples}" if loss in SAMPLED_LOSSES else ""))
    if (ode_dir / ODE_JSON).is_file() and (ode_dir / OBSERVABLES_NPZ).is_file():
        try:
            cached = read_json(ode_dir / ODE_JSON)
            if cached.get("key") == key:
                return Observables.load(ode_dir), cached["description"]
        except DamagedFileError:
            pass  # recomputed below
    observables, description = ode_observables(config, run_dir, t, progress)
    ode_dir.mkdir(exist_ok=True)
    observables.constants[MEASURED_BY] = np.array("flowsim ODE")  # kept with no trajectory.npz beside it
    observables.save(ode_dir)
    write_atomic_json(ode_dir / ODE_JSON, {"key": key, "description": description})
    return observables, description


def focus_order(predicted: dict[tuple, float], measured: dict[tuple, float], names: list[str], pi: np.ndarray) -> dict:
    """The first focus of each tracked type, most frequent first, on both sides, and whether
    each side's onsets follow the frequency order (frequent first)."""
    first = lambda events, q: events.get(("focus", q, None, 1))  # noqa: E731
    queries = [q for q in np.argsort(-np.asarray(pi), kind="stable") if names[q] != "other"]
    table = [{"token": names[q], "pi": float(pi[q]), "predicted": first(predicted, q), "measured": first(measured, q)}
             for q in queries]

    def follows_frequency(side: str) -> bool | None:
        onsets = [row[side] for row in table if row[side] is not None]
        return None if len(onsets) < 2 else bool(np.all(np.diff(onsets) >= 0))

    first_focus = lambda events: {key: value for key, value in events.items() if key[0] == "focus" and key[3] == 1}  # noqa: E731
    return {"tokens": table, "predicted_follows_frequency": follows_frequency("predicted"),
            "measured_follows_frequency": follows_frequency("measured"),
            "agreement": order_agreement(first_focus(predicted), first_focus(measured))}


def check_bridge_run(run_dir: Path) -> None:
    """A finished (or deliberately stopped) bridge run directory, or a ValueError saying what it is instead."""
    if not (run_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no {CONFIG_FILE}")
    if not (run_dir / CHECKPOINT_FILE).is_file():
        hint = "; for a `flowsim run` directory use `flowsim compare`" if (run_dir / TRAJECTORY_FILE).is_file() else ""
        raise ValueError(f"{run_dir} is not a `flowsim bridge train` run directory (no {CHECKPOINT_FILE}){hint}")
    meta = read_meta(run_dir)
    status = status_of(meta)
    if status not in (Status.FINISHED.label, Status.STEP_LIMIT.label) or not (run_dir / OBSERVABLES_NPZ).is_file():
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
    saved = int(np.count_nonzero(measured_observables.t > 0))
    if saved < MIN_SAMPLES_FOR_STAGES:  # refused before the ODE is solved, not after
        raise ValueError(f"{run_dir} has {saved} checkpoint(s) after t = 0 (optim.steps = {config.optim.steps}: its "
                         f"log-spaced steps coincide); stage detection needs at least {MIN_SAMPLES_FOR_STAGES}: train "
                         "more steps")
    ode, description = ode_beside(run_dir, progress)
    measured = detect_stages(measured_observables).events()
    predicted = detect_stages(ode).events()
    names = [str(name) for name in measured_observables.constants.get("type_names", type_names(build_data(config)))]
    rows = []
    for key in sorted(set(predicted) | set(measured), key=lambda k: (min(predicted.get(k, np.inf), measured.get(k, np.inf)), str(k))):
        stage, query, direction, occurrence = key
        p, m = predicted.get(key), measured.get(key)
        rows.append(EventRow(stage, query, direction, occurrence, names[query] if query is not None else "-", p, m,
                             relative_error(p, m)))
    agreement = order_agreement(predicted, measured)
    description["focus_order"] = focus_order(predicted, measured, names, measured_observables.constants["pi"])
    payload = {"rows": [asdict(row) for row in rows], "order_agreement": agreement, **description}
    write_atomic_json(run_dir / BRIDGE_COMPARE_JSON, payload)
    plot_overlay([("SGD run", measured_observables), ("ODE", ode)], run_dir / OVERLAY_FIGURE, names=names,
                 title=f"{run_title(config)}\nSGD (solid) beside the ODE (dashed)",
                 loss_label="loss\n(SGD run: validation, ODE: population)", time_label="t (learning rate × steps for the run)")
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
