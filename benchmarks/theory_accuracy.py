"""The theory's predicted onsets against the exact flow on a seeded random family of chains.

    python benchmarks/theory_accuracy.py [--chains 24] [--seed 0] [--eps 1e-3 --eps 1e-6]

Each chain of ``prediction_accuracy.random_family`` (d = 3, 4, 5 in turn, π from a Dirichlet,
λ in [0.2, 0.8]) is integrated at each ε (seed 0 initial point) to twice its predicted
first focus, and again to 1.3 × its predicted σ1 restart (``prediction_accuracy.restart_accuracy``);
the table gives, per ε, the predicted and measured end of condensation, onset of the first
query's focus and σ1 restart (with the rule that predicted it: the settled-point formula, or
the transverse equation's crossing when the restart comes before the rank-one flow settles),
their relative errors, and a summary of the median and worst error per stage. A chain whose
measured flow registers no focus of that query is one whose σ1 restart interrupts the focus.
A third pass integrates each chain to 5 × its predicted σ1 restart and compares every event of
the chained rank-r prediction (``prediction_accuracy.cycle_accuracy``): the later restarts, the
focus of the other queries and the dilutions, with the events one side has and the other
lacks counted. The tables go into benchmarks/RESULTS.md (section theory-accuracy).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from prediction_accuracy import (HORIZON_CAP, ChainAccuracy, CycleAccuracy, RestartAccuracy, chain_accuracy, cycle_accuracy,
                                 random_family, restart_accuracy, transition_accuracy, transition_restart_accuracy)
from flowsim.methods import AUTO, method_for
from theory.predict import NOT_MEASURED, NOT_PREDICTED

from report import write_section

RESULTS = Path(__file__).with_name("RESULTS.md")


def _time(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def chain_table(rows: list[ChainAccuracy], restarts: list[RestartAccuracy]) -> str:
    lines = ["| # | π | λ | condensation: theory / flow | error | first focus: theory / flow | error "
             "| σ1 restart: row / flow | error | rank-one transverse equation (rule) | error |",
             "|---:|---|---:|---|---:|---|---:|---|---:|---|---:|"]
    for index, (row, restart) in enumerate(zip(rows, restarts)):
        lines.append(
            f"| {index} | {', '.join(f'{p:.3f}' for p in row.pi)} | {row.lam:.2f} "
            f"| {_time(row.condensation[0])} / {_time(row.condensation[1])} | {_percent(ChainAccuracy.error(row.condensation))} "
            f"| {_time(row.focus[0])} / {_time(row.focus[1])} | {_percent(ChainAccuracy.error(row.focus))} "
            f"| {_time(restart.row)} / {_time(restart.measured)} | {_percent(restart.row_error)} "
            f"| {_time(restart.prediction.t_onset)} ({restart.prediction.rule}) | {_percent(restart.error)} |")
    return "\n".join(lines)


def _summary_line(eps: float, stage: str, errors: list[float], n: int) -> str:
    median = _percent(float(np.median(errors))) if errors else "-"
    worst = _percent(max(errors)) if errors else "-"
    return f"| {eps:g} | {stage} | {len(errors)} of {n} | {median} | {worst} |"


def summary_table(by_eps: dict[float, list[ChainAccuracy]], restarts_by_eps: dict[float, list[RestartAccuracy]]) -> str:
    lines = ["| ε | stage | chains measured | median error | worst error |", "|---|---|---:|---:|---:|"]
    for eps, rows in by_eps.items():
        for stage in ("condensation", "focus"):
            errors = [e for e in (ChainAccuracy.error(getattr(row, stage)) for row in rows) if e is not None]
            lines.append(_summary_line(eps, stage, errors, len(rows)))
        restarts = restarts_by_eps[eps]
        errors = [r.row_error for r in restarts if r.row_error is not None]
        lines.append(_summary_line(eps, "σ1 restart (the row: direction 1 open from θ(0))", errors, len(restarts)))
        for rule in ("formula", "before settling"):
            errors = [r.error for r in restarts if r.prediction.rule == rule and r.error is not None]
            lines.append(_summary_line(eps, f"σ1 restart, rank-one transverse equation ({rule})", errors, len(restarts)))
    return "\n".join(lines)


LATER_EVENTS = {
    "restart σ2, σ3, ...": lambda row: row.stage == "restart" and row.direction >= 2,
    "focus of the other queries": lambda row: row.stage == "focus" and row.query != 0,
    "dilution": lambda row: row.stage == "dilution",
}


def cycles_table(cycles_by_eps: dict[float, list[CycleAccuracy]]) -> str:
    lines = ["| ε | event | compared | median error | worst error | predicted, not measured | measured, not predicted |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for eps, cycles in cycles_by_eps.items():
        for label, wanted in LATER_EVENTS.items():
            rows = [row for cycle in cycles for row in cycle.rows if wanted(row)]
            errors = [row.rel_error for row in rows if row.rel_error is not None]
            median = _percent(float(np.median(errors))) if errors else "-"
            worst = _percent(max(errors)) if errors else "-"
            lines.append(f"| {eps:g} | {label} | {len(errors)} | {median} | {worst} "
                         f"| {sum(row.note == NOT_MEASURED for row in rows)} | {sum(row.note == NOT_PREDICTED for row in rows)} |")
    return "\n".join(lines)


def random_transition_matrix(d: int, seed: int) -> np.ndarray:
    """Rows from a flat Dirichlet, floored at 0.1/d so that π > 0 everywhere: a general P, not of the λ family."""
    rows = np.random.default_rng(seed).dirichlet(np.ones(d), size=d)
    rows = np.maximum(rows, 0.1 / d)
    return rows / rows.sum(axis=1, keepdims=True)


def text_chain(corpus: str, d: int, data_dir: Path) -> np.ndarray:
    """The bigram chain of a corpus's training split over its top d - 1 words and <unk> (the bridge's default
    surrogate: interpolated with the unigram law at the weight of least validation cross-entropy)."""
    from flowsim.bridge.surrogate import text_surrogate
    from flowsim.bridge.config import CompareConfig
    from flowsim.bridge.data import load_corpus

    return text_surrogate(load_corpus(corpus, d - 1, data_dir), CompareConfig())[0].P


def large_vocabularies(args) -> None:
    """Condensation, first focus and σ1 restart at d = 8, 16, 64 (paper family and general P) and on the text
    surrogates; section theory-accuracy-any-d of RESULTS.md."""
    started = time.perf_counter()
    cases: list[tuple[str, dict]] = []
    for d in args.dims:
        for index, (pi, lam) in enumerate(random_family(args.per_size, seed=args.seed + d, dims=(d,), min_pi=0.2 / d)):
            cases.append((f"paper family d = {d} #{index}", {"pi": pi, "lam": lam}))
        for index in range(args.per_size):
            cases.append((f"general P d = {d} #{index}", {"P": random_transition_matrix(d, args.seed + 100 * d + index)}))
    for corpus in args.corpus:
        for d in args.text_d:
            cases.append((f"{corpus} bigram d = {d}", {"P": text_chain(corpus, d, args.data)}))
    lines = ["| chain | ε | condensation: theory / flow | error | first focus: theory / flow | error "
             "| Stage I / II orbits' errors | σ1 restart: row / flow | error | rank-one transverse equation (rule) | error "
             "| seconds |",
             "|---|---:|---|---:|---|---:|---|---|---:|---|---:|---:|"]
    for eps in args.eps or [1e-3]:
        for name, chain in cases:
            began = time.perf_counter()
            try:
                if "P" in chain:
                    row = transition_accuracy(chain["P"], eps)
                    restart = transition_restart_accuracy(chain["P"], eps, t_cap=args.t_cap)
                else:
                    row = chain_accuracy(chain["pi"], chain["lam"], eps)
                    restart = restart_accuracy(chain["pi"], chain["lam"], eps, t_cap=args.t_cap)
            except RuntimeError as error:  # an exact flow that does not finish is a row, not the end of the table
                lines.append(f"| {name} | {eps:g} | {error} | | | | | | | | | {time.perf_counter() - began:.0f} |")
                print(lines[-1], flush=True)
                continue
            line = (f"| {name} | {eps:g} | {_time(row.condensation[0])} / {_time(row.condensation[1])} "
                    f"| {_percent(ChainAccuracy.error(row.condensation))} | {_time(row.focus[0])} / {_time(row.focus[1])} "
                    f"| {_percent(ChainAccuracy.error(row.focus))} | {' / '.join(map(_percent, row.orbit_errors()))} "
                    f"| {_time(restart.row)} / {_time(restart.measured)} | {_percent(restart.row_error)} "
                    f"| {_time(restart.prediction.t_onset)} ({restart.prediction.rule.value}) | {_percent(restart.error)} "
                    f"| {time.perf_counter() - began:.0f} |")
            lines.append(line)
            print(line, flush=True)
    command = (f"--large --dims {' '.join(map(str, args.dims))} --text-d {' '.join(map(str, args.text_d))}"
               + "".join(f" --eps {eps:g}" for eps in args.eps or []))
    text = [f"## Theory accuracy at larger vocabularies (`python benchmarks/theory_accuracy.py {command}`)", "",
            f"Seeded chains at d = {', '.join(map(str, args.dims))} ({args.per_size} of the paper family with π ~ Dirichlet(1) "
            f"floored at 0.2/d, {args.per_size} general P with Dirichlet rows floored at 0.1/d) and the bigram surrogates of "
            f"{', '.join(args.corpus)} at d = {', '.join(map(str, args.text_d))} (the bridge's default surrogate, interpolated with the unigram law); m = k = 8, mean-field loss, "
            f"seed-0 initial point. The theory's condensation, first focus and σ1 restart are `predict_run`'s rows (read on "
            f"the flow from θ(0) with direction 1 open); the rank-one transverse equation's σ1 is beside them; Stage I / II "
            f"are the errors of the asymptotic orbits' times. The exact flow ({method_for(AUTO)}, "
            f"rtol 1e-8) runs to twice Stage II's focus (where its orbit shows none, twice the end of its linear phase, "
            f"at most t = {HORIZON_CAP:g}) and, for σ1, to 1.3 × the predicted restart (at most t = {args.t_cap:g}). "
            f"{time.perf_counter() - started:.0f} s on a 2-core CPU.", "",
            *lines]
    epsilons = args.eps or [1e-3]
    marker = "theory-accuracy-any-d" + ("" if epsilons == [1e-3] else "-eps-" + "-".join(f"{eps:g}" for eps in epsilons))
    write_section(args.out, marker, "\n".join(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", action="store_true", help="the larger vocabularies and the text surrogates instead")
    parser.add_argument("--dims", type=int, nargs="*", default=[8, 16, 64])
    parser.add_argument("--per-size", type=int, default=2)
    parser.add_argument("--corpus", nargs="*", default=["wikitext2", "tinystories"])
    parser.add_argument("--text-d", type=int, nargs="+", default=[64])
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--t-cap", type=float, default=20000.0)
    parser.add_argument("--chains", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eps", type=float, action="append", help="initial scale (repeatable; default 1e-3 and 1e-6)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.large:
        large_vocabularies(args)
        return
    epsilons = args.eps or [1e-3, 1e-6]
    family = random_family(args.chains, args.seed)
    started = time.perf_counter()
    by_eps: dict[float, list[ChainAccuracy]] = {}
    restarts_by_eps: dict[float, list[RestartAccuracy]] = {}
    failures: list[str] = []  # a prediction that fails is named, and its chain left out of that ε's tables
    for eps in epsilons:
        by_eps[eps], restarts_by_eps[eps] = [], []
        for index, (pi, lam) in enumerate(family):
            try:
                row = chain_accuracy(pi, lam, eps)
                restart = restart_accuracy(pi, lam, eps, t_cap=2e5)
            except (RuntimeError, ValueError) as error:
                failures.append(f"ε = {eps:g}, chain {index} (π = {pi}, λ = {lam:.4g}): {type(error).__name__}: {error}")
                print(failures[-1], flush=True)
                continue
            by_eps[eps].append(row)
            restarts_by_eps[eps].append(restart)
            print(f"ε = {eps:g} chain {index}: condensation {_percent(ChainAccuracy.error(row.condensation))}, "
                  f"focus {_time(row.focus[0])} / {_time(row.focus[1])} {_percent(ChainAccuracy.error(row.focus))}, "
                  f"σ1 restart row {_time(restart.row)} / {_time(restart.measured)} {_percent(restart.row_error)}, "
                  f"transverse equation {_time(restart.prediction.t_onset)} ({restart.prediction.rule}) {_percent(restart.error)}",
                  flush=True)
    text = [f"## Theory accuracy on a random family (`python benchmarks/theory_accuracy.py --chains {args.chains} "
            f"--seed {args.seed}`)", "",
            f"{args.chains} chains P = λI + (1 - λ)1π^T (d = 3, 4, 5 in turn, π ~ Dirichlet(1) floored at 0.02, "
            f"λ ~ U[0.2, 0.8]), m = k = 8, mean-field loss, seed-0 initial point; {time.perf_counter() - started:.0f} s "
            "on a 2-core CPU.", "", summary_table(by_eps, restarts_by_eps)]
    for eps, rows in by_eps.items():
        text += ["", f"### ε = {eps:g}", "", chain_table(rows, restarts_by_eps[eps])]
    cycles_by_eps: dict[float, list[CycleAccuracy]] = {}
    for eps in epsilons:
        cycles_by_eps[eps] = []
        for index, (pi, lam) in enumerate(family):
            try:
                cycles_by_eps[eps].append(cycle_accuracy(pi, lam, eps, restarts=5.0))
            except (RuntimeError, ValueError) as error:
                failures.append(f"ε = {eps:g}, chain {index}, later events: {type(error).__name__}: {error}")
                print(failures[-1], flush=True)
                continue
            print(f"ε = {eps:g} chain {index}: " + ", ".join(
                f"{row.stage} {row.query if row.direction is None else 'σ%d' % row.direction} {_percent(row.rel_error)}"
                for row in cycles_by_eps[eps][-1].rows if row.rel_error is not None), flush=True)
    text += ["", "### Later events: the chained rank-r prediction to 5 × the predicted σ1 restart (at most t = 20000)", "",
             cycles_table(cycles_by_eps), "",
             f"{time.perf_counter() - started:.0f} s in all."]
    if failures:
        text += ["", "Predictions that failed (left out of the tables):", "", *(f"- {failure}" for failure in failures)]
    write_section(args.out, "theory-accuracy", "\n".join(text))
    print(summary_table(by_eps, restarts_by_eps))
    print(cycles_table(cycles_by_eps))


if __name__ == "__main__":
    main()
