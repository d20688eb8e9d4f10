"""From a corpus to the theory beside real pretraining in one call: ``flowsim bridge validate CORPUS``.

Three routes to the same stage events, all from the SGD run's own initial parameters:

* **SGD**: the bridge run of the corpus's shipped one-layer example (``bridge/CORPUS-onelayer.toml``:
  d = 1001, lr and steps in the flow regime), labelled by flowsim's detectors;
* **ODE**: the exact mean-field gradient flow of the corpus's bigram surrogate, and, where its d³ covariance fits
  the memory budget (or folded, ``compare.kept_types``), the flow of the same chain's loss at the run's s to second
  order in the window's composition ("ODE at s", ``loss.kind = "finite_second_order"``). Whichever
  ``compare.surrogate_loss`` names is the run's own ODE (``flowsim bridge compare``'s); the other is put beside it;
* **theory**: ``predict_run`` on the same surrogate, model and start (Stages I-IV), cut at the run's
  horizon t = lr × steps, with no integration of the full flow.

The theory reads the mean-field attention over the whole vocabulary; the bridge reads the run's probe set (each
query's windows, types folded), so the ODE is read both ways: beside the theory as the theory reads, beside SGD as
SGD is read.

Events are keyed as the bridge labels them (stage, the folded type of the query or the direction,
occurrence); the theory's rows are first occurrences, so they meet occurrence 1. Written to OUT:

    OUT/sgd/            the bridge run directory (resumable), its ODE beside it (compare.json, overlay.png)
    OUT/theory/         init.npz: the run's start, from which the theory predicts
    OUT/validate.json   every event on each side, the relative errors against SGD, the settings
    OUT/validate.md     the same as a markdown table

Cost: the SGD run (O(steps × batch × s × d m)), the ODE (JaxBDF at d = 1001, matrix-free) and the theory's
rank-r flows; each part is cached, so a second call only reassembles the table.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from flowsim.bridge.compare import compare_bridge_run, ode_beside, relative_error
from flowsim.bridge.config import BridgeConfig, load_bridge_config
from flowsim.bridge.surrogate import text_surrogate
from flowsim.bridge.train import DataSource, build_data, train
from flowsim.config import ConfigError, RunConfig, find_config
from flowsim.common.budget import BudgetError
from flowsim.common.io import write_atomic_json, write_atomic_npz, write_atomic_text
from flowsim.common.progress import TICK_SECONDS, ticking
from flowsim.model.losses import check_loss_size
from flowsim.model.models import model_from_config
from flowsim.observe.observables import Observables
from flowsim.runs.rundir import TRAJECTORY_FILE
from flowsim.observe.stages import detect_stages, event_label
from flowsim.solve.trajectory import Trajectory

VALIDATE_JSON = "validate.json"
VALIDATE_MD = "validate.md"
HEARTBEAT_SECONDS = 2 * TICK_SECONDS  # as `flowsim predict`'s
SIDES = ("theory", "ode_full_vocabulary", "ode", "ode_finite_s", "sgd")
FINITE_S_LOSS = "finite_second_order"  # the finite-context flow put beside the mean-field one
FINITE_S_KEPT = 64  # where its d³ does not fit, the Markov correlations of this many types (benchmarks/finite_context_fold.py)
LOSS_MOVES = 0.05  # a row whose event the finite-s flow moves more than this is marked a mean-field prediction


def example_config(corpus: str, short: bool = False) -> Path:
    """The shipped d = 1001 example of a corpus (its whole cycle; with ``short`` its first stages only,
    ``bridge/CORPUS-onelayer-short.toml``), or ``corpus`` itself when it names a bridge config file."""
    if Path(corpus).suffix == ".toml":
        if short:
            raise ConfigError(f"--short picks a shipped example's first stages; {corpus!r} is a config of your own: "
                              "set its optim.steps instead")
        return find_config(corpus)
    if corpus not in ("wikitext2", "tinystories"):
        raise ConfigError(f"CORPUS must be wikitext2, tinystories or a bridge config .toml, got {corpus!r}")
    return find_config(f"bridge/{corpus}-onelayer{'-short' if short else ''}.toml")


def theory_config(config: BridgeConfig, data: DataSource, run_dir: Path, folder: Path) -> RunConfig:
    """The surrogate as a flowsim run config (kept in memory: its P is d² numbers): its transition matrix,
    the bridge model's m and k, the run's initial parameters (written to ``folder``/init.npz) and the
    run's horizon."""
    chain, _ = text_surrogate(data.corpus, config.compare)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic_npz(folder / "init.npz", Trajectory.load(run_dir / TRAJECTORY_FILE).at(0))
    t_end = config.optim.lr * config.optim.steps
    sections = {"chain": {"P": chain.P.tolist()}, "model": {"m": config.model.m, "k": config.model.k},
                "init": {"file": str(folder / "init.npz")}, "time": {"t_end": t_end}}
    try:
        return RunConfig.model_validate(sections)
    except ValueError as error:
        raise ConfigError(f"the surrogate as a run config: {error}") from None


def theory_events(run_config: RunConfig, data: DataSource,
                  progress: Callable[[str], None]) -> tuple[dict[tuple, float], dict[tuple, str], str]:
    """The theory's prediction for a bridge run (its ``theory_config``, cached by ``cached_prediction``): its events
    keyed as the bridge's (queries folded; types folded into "other" dropped), the notes of events it rules
    out or puts past the horizon, and its constants. A line every HEARTBEAT_SECONDS says it is still at work (minutes
    at d = 1001, with no step it could count down)."""
    from flowsim.runs.predictions import cached_prediction

    with ticking(lambda seconds: progress(f"theory: {seconds:.0f} s so far"), every=HEARTBEAT_SECONDS):
        summary = cached_prediction(run_config, progress)
    events, notes = {}, {}
    for row in summary.rows:
        key = folded_key(data, row.stage, row.query, row.direction)
        if key is None:
            continue
        if row.predicted is not None:
            events[key] = float(row.predicted)
        elif row.note:
            notes[key] = row.note
    return events, notes, summary.constants


def formula_events(run_config: RunConfig, data: DataSource) -> dict[tuple, float]:
    """The formula tier's events for a bridge run (its ``theory_config``; ``theory.formulas``: seconds at d = 1001, no
    flow integrated), keyed as the bridge's."""
    from theory.predict import predict_formulas_only

    rows, _ = predict_formulas_only(run_config)
    return {key: float(row.formula) for row in rows
            if row.formula is not None and (key := folded_key(data, row.stage, row.query, row.direction)) is not None}


def folded_key(data: DataSource, stage: str, query: int | None, direction: int | None) -> tuple | None:
    """A first occurrence over the whole vocabulary keyed as the bridge's events (its query folded); None for a
    query folded into "other"."""
    fold = data.fold()
    folded = None if query is None else int(fold[query])
    return None if folded == int(fold.max()) else (stage, folded, direction, 1)  # fold.max(): the type "other"


def flow_at_s_fold(config: BridgeConfig, folded: bool) -> tuple[int | None, str]:
    """(kept types, note) of the flow at s beside a run: every type's correlations where the d³ covariance fits (or
    ``compare.kept_types``'s); where it does not, FINITE_S_KEPT's with ``folded``, else none (the note says why,
    starting "no finite-s flow")."""
    model = model_from_config(config.model, config.data.vocab_size)
    d, kept = config.data.vocab_size + 1, config.compare.kept_types
    try:
        try:
            check_loss_size(FINITE_S_LOSS, d, config.data.s, model, kept_types=kept)
        except BudgetError as error:
            if kept is not None:
                raise
            if not folded:
                raise BudgetError(f"{error}; --flow-at-s folds it to the {FINITE_S_KEPT} most frequent types") from None
            kept = FINITE_S_KEPT  # the d³ covariance does not fit: the fold its benchmark chose
            check_loss_size(FINITE_S_LOSS, d, config.data.s, model, kept_types=kept)
    except BudgetError as error:
        return None, f"no finite-s flow: {error}"
    folded_note = f"the flow at s keeps the Markov correlations among the {kept} most frequent types only"
    return kept, folded_note if kept is not None and kept < d else ""


def validate(corpus: str, out: Path, overrides: list[str] = (), *, theory: bool = True, short: bool = False,
             finite_s: bool = True, folded_finite_s: bool = False, progress: Callable[[str], None] = lambda message: None,
             bars: bool = False) -> dict:
    """Train, integrate the surrogate's ODE, run the theory, and write validate.json and validate.md in ``out``
    (``short``: the shipped example's first stages only, ``example_config``; ``finite_s``: also the flow of the
    loss at the run's s where its d³ covariance fits, or with ``compare.kept_types``; ``folded_finite_s``: also
    where it does not, folded to FINITE_S_KEPT types: tens of minutes at d = 1001 on a CPU)."""
    out = Path(out)
    config = load_bridge_config(example_config(corpus, short), list(overrides) + (
        [] if finite_s else ["compare.surrogate_loss=mean_field"]))  # no flow at s: the run's ODE is the mean field's
    if config.data.kind == "markov" or config.model.kind != "one_layer":
        raise ConfigError("bridge validate needs a text corpus (data.kind wikitext2, tinystories or text) and the "
                          f"one-layer model, got data.kind = {config.data.kind!r}, model.kind = {config.model.kind!r}")
    seconds = {}
    started = time.perf_counter()
    progress(f"SGD: {config.data.kind}, d = {config.data.vocab_size + 1}, lr = {config.optim.lr:g}, {config.optim.steps} steps")
    result = train(config, out / "sgd", progress=bars)
    if result.interrupted:
        raise KeyboardInterrupt
    seconds["sgd"] = time.perf_counter() - started
    started = time.perf_counter()
    own_loss = config.compare.surrogate_loss
    progress(f"ODE: the surrogate's flow of its {'mean-field' if own_loss == 'mean_field' else own_loss} loss from the "
             "run's start (the run's own ODE, compare.surrogate_loss)")
    compared, _, own_description = compare_bridge_run(out / "sgd", progress=bars)
    keyed = {(row.stage, row.query, row.direction, row.occurrence): row for row in compared}
    own_events = {key: row.predicted for key, row in keyed.items() if row.predicted is not None}
    sgd_events = {key: row.measured for key, row in keyed.items() if row.measured is not None}
    seconds["ode" if own_loss == "mean_field" else "ode_finite_s"] = time.perf_counter() - started
    data = build_data(config)
    at_s, finite_s_note, finite_s_description = {}, "", {}  # the events of the flow at s
    if own_loss == "mean_field":
        mean_field, description = own_events, own_description
        if finite_s:  # the loss at the run's s beside it, where it fits
            d = config.data.vocab_size + 1
            kept, finite_s_note = flow_at_s_fold(config, folded_finite_s)
            if not finite_s_note.startswith("no finite-s flow"):
                started = time.perf_counter()
                progress(f"ODE: the surrogate's flow of its loss at s = {config.data.s} ({FINITE_S_LOSS}"
                         + (f", Markov correlations among the {kept} most frequent types)" if kept is not None and kept < d else ")"))
                observables, finite_s_description = ode_beside(out / "sgd", bars, surrogate_loss=FINITE_S_LOSS, kept_types=kept)
                at_s = detect_stages(observables).events()
                seconds["ode_finite_s"] = time.perf_counter() - started
    else:  # the run's own ODE is a flow at s: the mean-field flow beside it, for the theory that derives from it
        at_s, finite_s_description = own_events, own_description
        started = time.perf_counter()
        progress("ODE: the surrogate's mean-field flow from the run's start (beside the flow at s)")
        observables, description = ode_beside(out / "sgd", bars, surrogate_loss="mean_field")
        mean_field = detect_stages(observables).events()
        seconds["ode"] = time.perf_counter() - started
    full_vocabulary = {key: event["t"] for event in description.get("full_vocabulary_events", [])
                       if (key := folded_key(data, event["stage"], event["query"], event["direction"])) is not None}
    names = [str(name) for name in Observables.load(out / "sgd").constants["type_names"]]
    run_config = theory_config(config, data, out / "sgd", out / "theory")  # the surrogate as a run, for both tiers
    started = time.perf_counter()
    formula_failure = ""
    try:
        by_formula = formula_events(run_config, data)
    except (ValueError, RuntimeError) as error:  # a chain outside the formulas: the rest of the validation stands
        by_formula, formula_failure = {}, f"the formula tier failed: {error}"
    seconds["formula"] = time.perf_counter() - started
    by_theory, notes, constants = {}, {}, ""
    if theory:
        started = time.perf_counter()
        progress("theory: Stages I-IV on the surrogate (predict_run)")
        by_theory, notes, constants = theory_events(run_config, data, progress)
        seconds["theory"] = time.perf_counter() - started
    rows = []
    for key in set(sgd_events) | set(mean_field) | set(by_theory) | set(notes) | set(full_vocabulary) | set(by_formula) | set(at_s):
        stage, query, direction, occurrence = key
        ode, sgd = mean_field.get(key), sgd_events.get(key)
        times = {"formula": by_formula.get(key), "theory": by_theory.get(key),
                 "ode_full_vocabulary": full_vocabulary.get(key), "ode": ode, "ode_finite_s": at_s.get(key), "sgd": sgd}
        rows.append({"stage": stage, "query": query, "direction": direction, "occurrence": occurrence,
                     "token": names[query] if query is not None else "-", **times,
                     "formula_vs_ode": relative_error(times["formula"], times["ode_full_vocabulary"]),
                     "theory_vs_ode": relative_error(times["theory"], times["ode_full_vocabulary"]),
                     "theory_vs_sgd": relative_error(times["theory"], sgd), "ode_vs_sgd": relative_error(ode, sgd),
                     "ode_finite_s_vs_sgd": relative_error(times["ode_finite_s"], sgd),
                     "note": "; ".join(filter(None, [notes.get(key, ""), loss_moves(ode, times["ode_finite_s"])]))})
    first = lambda row: min([row[side] for side in SIDES if row[side] is not None], default=np.inf)  # noqa: E731
    rows.sort(key=lambda row: (first(row), str((row["stage"], row["query"], row["direction"], row["occurrence"]))))
    payload = {"corpus": config.data.kind, "d": config.data.vocab_size + 1, "lr": config.optim.lr,
               "steps": config.optim.steps, "t_end": config.optim.lr * config.optim.steps, "init_eps": config.model.init_eps,
               "surrogate": description.get("estimator"), "ode": description, "theory_constants": constants,
               "formula_failure": formula_failure, "finite_s_note": finite_s_note, "own_loss": own_loss,
               "ode_finite_s": finite_s_description.get("ode"),
               "seconds": seconds, "rows": rows}
    write_atomic_json(out / VALIDATE_JSON, payload)
    write_atomic_text(out / VALIDATE_MD, validation_table(payload))
    return payload


def loss_moves(mean_field: float | None, finite_s: float | None) -> str:
    """A row's note where the flow of the loss at s moves the mean-field flow's event by more than LOSS_MOVES (both
    read on the probe set): the theory and the ODE columns are then the mean-field loss's predictions only."""
    moved = relative_error(finite_s, mean_field)
    if mean_field is None or finite_s is None or moved <= LOSS_MOVES:
        return ""
    return f"mean-field prediction: the flow at s moves it {100 * moved:.0f}%"


def validation_table(payload: dict) -> str:
    """validate.json as markdown: one row per event, the three routes and their errors against SGD."""
    show = lambda value: "–" if value is None else f"{value:.4g}"  # noqa: E731
    percent = lambda value: "–" if value is None else f"{100 * value:.1f}%"  # noqa: E731
    lines = [f"{payload['corpus']}, d = {payload['d']}, SGD lr = {payload['lr']:g} × {payload['steps']} steps "
             f"(t = {payload['t_end']:g}), ε = {payload['init_eps']:g}; surrogate: {payload['surrogate']}", "",
             "The theory and the ODE's first column read the mean-field attention over the whole vocabulary; the ODE's "
             "second column and SGD read the run's probe set (its queries' windows, types folded), as `flowsim bridge "
             "compare` does.", "",
             "The theory has two tiers: the formula (closed forms, no flow integrated; condensation, the first "
             "focus and σ1's restart up to d = 64) and the reduced flows (`theory`), both derived from the mean-field "
             "(s → ∞) loss." + (f" {payload['formula_failure']}." if payload.get("formula_failure") else ""), "",
             f"The ODE columns' loss: the {payload['ode'].get('ode', 'surrogate chain')}. ODE at s: the flow of the "
             + (payload.get("ode_finite_s") or f"same chain's loss at the run's s to second order in the window's "
                f"composition (loss.kind = '{FINITE_S_LOSS}')") + ", read on the probe set."
             + (f" {payload['finite_s_note']}." if payload.get("finite_s_note") else "")
             + f" The run's own ODE (compare.surrogate_loss = '{payload.get('own_loss', 'mean_field')}', what `flowsim "
             "bridge compare` shows): " + ("the ODE columns'." if payload.get("own_loss", "mean_field") == "mean_field"
                                           else "ODE at s."), "",
             "| event | token | formula | theory | ODE (vocabulary) | ODE (probe set) | ODE at s | SGD | formula vs ODE "
             "| theory vs ODE | theory vs SGD | ODE vs SGD | ODE at s vs SGD | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in payload["rows"]:
        event = event_label((row["stage"], row["query"], row["direction"], row["occurrence"]))
        lines.append(f"| {event} | {row['token']} | {show(row.get('formula'))} | {show(row['theory'])} "
                     f"| {show(row.get('ode_full_vocabulary'))} | {show(row['ode'])} | {show(row.get('ode_finite_s'))} "
                     f"| {show(row['sgd'])} | {percent(row.get('formula_vs_ode'))} | {percent(row['theory_vs_ode'])} "
                     f"| {percent(row['theory_vs_sgd'])} | {percent(row['ode_vs_sgd'])} "
                     f"| {percent(row.get('ode_finite_s_vs_sgd'))} | {row['note']} |")
    return "\n".join(lines) + "\n"
