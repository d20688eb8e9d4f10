"""Which part of the ODE-vs-SGD gap on text is the bigram surrogate's, and which is SGD's.

    python benchmarks/surrogate_gap.py [--corpus wikitext2] [--size d64|onelayer] [--windows 4096] [--set key=value ...]
                                       [--work runs/surrogate-gap] [--out benchmarks/RESULTS.md]

Four routes from one initial point (the SGD run's own), on the t = lr × steps clock, measured with the
run's probe set and labelled by the same detectors:

1. the surrogate: the mean-field flow of the training split's bigram chain (`flowsim bridge compare`'s ODE);
2. the text: the exact full-batch gradient flow of the training loss on N fixed windows of the training
   split (``flowsim.model.losses.make_window_loss``, integrated by ``compare.method``, auto by default: JaxBDF at
   d = 1001), the flow SGD follows as lr -> 0 on that sample;
3. SGD on the text: the run of ``configs/bridge/CORPUS-d64.toml`` (its steps set by ``--set optim.steps=...``),
   or with ``--size onelayer`` of the d = 1001 example ``CORPUS-onelayer.toml``;
4. SGD on the surrogate: the same run with ``data.train_on = "surrogate"``, its training sequences drawn from
   the bigram chain of route 1 (same lr, batch, steps, seed and start; validation and probe windows the text's).

Surrogate against text is the surrogate's error (the text is not a bigram chain, and the mean-field loss
is not the loss at context length s); text against SGD is SGD's (a finite lr, and fresh batches instead
of N fixed windows). SGD on the surrogate against SGD on the text isolates the first part under SGD's own
noise and finite s: what the text has beyond its bigram chain. Besides the detectors' events, each route's
σ1(W0) is read where it first exceeds 2, 3 and 5 times its start (the detectors' restart is 10 times), and
at the end. The run directories are kept in ``--work`` and reused (training resumes).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from report import write_section

MARKER = "surrogate-gap"
DEPARTURE_FACTORS = (2.0, 3.0, 5.0)  # σ1(W0) over its start; the detectors' restart is 10


def four_routes(corpus: str, overrides: list[str], n_windows: int, work: Path, size: str = "d64") -> tuple[list[dict], dict]:
    from flowsim.bridge.compare import compare_bridge_run, measured_like_the_run, ode_beside
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.train import build_data, train, type_names
    from flowsim.model.flow import GradientFlow
    from flowsim.model.losses import make_window_loss
    from flowsim.model.models import model_from_config
    from flowsim.observe.observables import Observables
    from flowsim.runs.rundir import TRAJECTORY_FILE
    from flowsim.solve.solvers import solve_flow
    from flowsim.observe.stages import StageThresholds, detect_stages
    from flowsim.solve.trajectory import Trajectory

    config_path = f"configs/bridge/{corpus}-{size}.toml"
    config = load_bridge_config(config_path, overrides)
    run_dir = work / corpus
    started = time.perf_counter()
    train(config, run_dir, progress=True)
    train_s = time.perf_counter() - started
    surrogate_run_dir = work / f"{corpus}-surrogate-sgd"
    started = time.perf_counter()
    train(load_bridge_config(config_path, [*overrides, "data.train_on='surrogate'"]), surrogate_run_dir, progress=True)
    surrogate_train_s = time.perf_counter() - started
    compare_bridge_run(run_dir)  # the surrogate's ODE, cached in RUN/ode
    surrogate, _ = ode_beside(run_dir)
    run = Observables.load(run_dir)

    data = build_data(config)
    model = model_from_config(config.model, data.vocab_size)
    windows = data.corpus.batch(n_windows, config.data.s + 1, config.data.seed + 7919, 0, "train").numpy()
    params0 = Trajectory.load(run_dir / TRAJECTORY_FILE).at(0)
    flow = GradientFlow(make_window_loss(model, windows), params0)
    started = time.perf_counter()
    method = config.compare.method or "auto"  # the surrogate's own: by the flow's size on text
    result = solve_flow(flow, params0, run.t, method=method, rtol=config.compare.rtol, atol=config.compare.atol,
                        progress=True)
    text_s = time.perf_counter() - started
    if not result.success:
        raise RuntimeError(f"the window flow stopped: {result.message}")
    text = measured_like_the_run(model, result.trajectory, data)

    routes = {"surrogate": surrogate, "text": text, "sgd": run, "surrogate_sgd": Observables.load(surrogate_run_dir)}
    events = {side: {**detect_stages(observables).events(), **sigma1_departures(observables)}
              for side, observables in routes.items()}
    names = type_names(data)
    keys = sorted(set().union(*events.values()), key=lambda key: (min(e.get(key, np.inf) for e in events.values()), str(key)))
    rows = []
    for key in keys:
        stage, query, direction, occurrence = key
        subject = names[query] if query is not None else f"σ{direction}" if direction is not None else "-"
        rows.append({"event": f"{stage} {subject}" + (f" #{occurrence}" if occurrence > 1 else ""),
                     **{side: events[side].get(key) for side in events}})
    # σ1(W0) at the end on each side, against the detectors' restart level ℓ1 (restart_factor × σ1(W0(0)))
    sigma1 = {side: float(np.asarray(observables["sv_W0"])[-1, 1]) for side, observables in routes.items()}
    level = StageThresholds().restart_factor * float(np.asarray(run["sv_W0"])[0, 1])
    final = {"σ1 at t_end": sigma1, "restart level": level, "surrogate loss": float(surrogate["loss"][-1]),
             "window loss": float(text["loss"][-1]), "SGD validation loss": float(run["loss"][-1]),
             "surrogate SGD validation loss": float(routes["surrogate_sgd"]["loss"][-1]),
             "t_end": float(run.t[-1]), "windows": n_windows, "train_s": train_s, "surrogate_train_s": surrogate_train_s,
             "text_flow_s": text_s, "stats": result.stats}
    return rows, final


def first_crossings(t: np.ndarray, sigma1: np.ndarray, factors: tuple[float, ...] = DEPARTURE_FACTORS) -> dict[float, float]:
    """The first time at which ``sigma1`` exceeds each factor times its start (a factor never reached is left out)."""
    above = {factor: np.flatnonzero(sigma1 > factor * sigma1[0]) for factor in factors}
    return {factor: float(t[hits[0]]) for factor, hits in above.items() if len(hits)}


def sigma1_departures(observables, factors: tuple[float, ...] = DEPARTURE_FACTORS) -> dict[tuple, float]:
    """The first save time at which σ1(W0) exceeds each factor times its start, keyed like the detectors' events
    (stage ``"σ1 > 2 × start"``, no query or direction). Read off the raw series: the detectors' restart (10 times,
    smoothed) comes late at d = 1001, where SGD's σ1 grows slowly."""
    crossings = first_crossings(np.asarray(observables.t), np.asarray(observables["sv_W0"])[:, 1], factors)
    return {(f"σ1 > {factor:g} × start", None, None, 1): t for factor, t in crossings.items()}


def gap(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None else f"{abs(a - b) / b:.1%}"


def table(corpus: str, rows: list[dict], final: dict) -> str:
    show = lambda value: "–" if value is None else f"{value:.4g}"  # noqa: E731
    lines = [f"### {corpus} (t = {final['t_end']:g}; {final['windows']} windows; SGD on the text {final['train_s']:.0f} s, "
             f"on the surrogate {final['surrogate_train_s']:.0f} s; window flow {final['text_flow_s']:.0f} s: "
             f"{final['stats'].n_steps} steps, {final['stats'].nfev} fields)", "",
             "| event | surrogate's flow | text (window flow) | SGD on the surrogate | SGD | surrogate's flow vs text | "
             "text vs SGD | SGD on the surrogate vs SGD | surrogate's flow vs SGD |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['event']} | {show(row['surrogate'])} | {show(row['text'])} | {show(row['surrogate_sgd'])} | "
                     f"{show(row['sgd'])} | {gap(row['surrogate'], row['text'])} | {gap(row['text'], row['sgd'])} | "
                     f"{gap(row['surrogate_sgd'], row['sgd'])} | {gap(row['surrogate'], row['sgd'])} |")
    sigma1 = final["σ1 at t_end"]
    lines += ["", f"Loss at t = {final['t_end']:g}: surrogate (mean-field) {final['surrogate loss']:.4f}, window flow "
                  f"{final['window loss']:.4f}, SGD (validation) {final['SGD validation loss']:.4f}, SGD on the surrogate (validation, "
                  f"on the text) {final['surrogate SGD validation loss']:.4f}. σ1(W0) there: "
                  f"surrogate's flow {sigma1['surrogate']:.3g}, window flow {sigma1['text']:.3g}, SGD on the surrogate "
                  f"{sigma1['surrogate_sgd']:.3g}, SGD {sigma1['sgd']:.3g} (restart level {final['restart level']:.3g})."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="wikitext2", choices=("wikitext2", "tinystories"))
    parser.add_argument("--size", default="d64", choices=("d64", "onelayer"), help="the d = 64 or the d = 1001 example")
    parser.add_argument("--windows", type=int, default=4096, help="training windows of the full-batch text flow")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="bridge config override (repeatable)")
    parser.add_argument("--work", type=Path, default=Path("runs/surrogate-gap"), help="where the SGD run is kept")
    parser.add_argument("--out", type=Path, default=None, help="write the table into this markdown file (its own section)")
    args = parser.parse_args()
    rows, final = four_routes(args.corpus, args.overrides, args.windows, args.work, args.size)
    text = table(args.corpus, rows, final)
    print(text)
    if args.out is not None:
        command = "python benchmarks/surrogate_gap.py " + " ".join(sys.argv[1:])
        marker = f"{MARKER}-{args.corpus}" + ("" if args.size == "d64" else f"-{args.size}")
        write_section(args.out, marker, f"## Surrogate against text against SGD\n\nProduced by `{command}`.\n\n{text}")


if __name__ == "__main__":
    main()
