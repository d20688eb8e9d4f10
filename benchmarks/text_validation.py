"""The text validation: each shipped text config trained at its lr and at lr/2 (the flow-regime
check), the exact flow of its full-vocabulary bigram surrogate beside it, and the stage times
side by side.

    python benchmarks/text_validation.py [--out DIR] [--corpus wikitext2 --corpus tinystories]
                                         [--theory] [--also-lr FACTOR ...] [--results FILE]
                                         [--set section.key=value ...]

With no --set it runs the shipped d = 1001 examples (what `flowsim bridge validate` runs, and the lr/2
twin beside each); the d = 64 tables of RESULTS.md set data.vocab_size=63 and the lr.

For each event (condensation's end; the first focus and dilution onsets of the tracked tokens;
each restart) the table gives the ODE's time, the run's at lr and at lr/2, and the first-order
extrapolation of the run to lr -> 0, 2 t(lr/2) - t(lr): where SGD's times move linearly with lr,
that is the flow's time, so the ODE is compared both with the run as trained and with its
lr -> 0 limit. ``--also-lr 2`` trains one more run at 2 lr (steps / 2, the same horizon) and adds its
column. ``--theory`` adds the theory's prediction (``predict_run`` on the same surrogate
and start, as ``flowsim bridge validate`` makes it) and its error against the run. The loss columns put the surrogate's population loss beside the run's
validation loss (how far the bigram chain is from the text). The tables go into
benchmarks/RESULTS.md (section text-validation; ``--results`` names another file); every run stays under --out and is resumed
when the script is run again.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from flowsim.bridge.compare import ODE_DIR, compare_bridge_run, relative_error
from flowsim.bridge.config import load_bridge_config
from flowsim.bridge.regime import check_flow_regime, scaled_learning_rate
from flowsim.bridge.train import build_data, train
from flowsim.bridge.validate import theory_config, theory_events
from flowsim.config import shipped_config
from flowsim.observe.observables import Observables
from flowsim.observe.stages import detect_stages, event_label

from report import write_section

RESULTS = Path(__file__).with_name("RESULTS.md")
TOP = 5  # the focus onsets of the most frequent tokens the targets name


def _relative(a: float | None, b: float | None) -> str:
    error = relative_error(a, b)
    return "-" if error is None else f"{100 * error:.1f}%"


def _show(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def corpus_tables(corpus: str, out: Path, overrides: list[str], theory: bool = False, also_lr: Sequence[float] = ()) -> str:
    config = load_bridge_config(shipped_config("bridge") / f"{corpus}-onelayer.toml", overrides)
    started = time.perf_counter()
    regime = check_flow_regime(config, out / corpus, progress=True)
    measured_also = {}
    for factor in also_lr:
        folder = out / corpus / f"lr_times_{factor:g}"
        train(scaled_learning_rate(config, factor), folder, progress=True)
        measured_also[factor] = detect_stages(Observables.load(folder)).events()
    train_seconds = time.perf_counter() - started
    run, half = out / corpus / "lr", out / corpus / "lr_half"
    started = time.perf_counter()
    rows, agreement, description = compare_bridge_run(run, progress=True)
    compare_seconds = time.perf_counter() - started
    measured_half = detect_stages(Observables.load(half)).events()
    predicted_by_theory, theory_notes, theory_seconds = {}, {}, 0.0
    names = [str(name) for name in Observables.load(run).constants["type_names"]]
    if theory:
        started = time.perf_counter()
        data = build_data(config)
        run_config = theory_config(config, data, run, out / corpus / "theory")
        predicted_by_theory, theory_notes, _ = theory_events(run_config, data, print)
        theory_seconds = time.perf_counter() - started
    lines = [f"### {corpus}", "",
             f"d = {description['surrogate_d']} (vocab_size {config.data.vocab_size} + <unk>), m = k = {config.model.m}, "
             f"s = {config.data.s}, batch {config.data.batch_size}, SGD lr = {config.optim.lr:g} for {config.optim.steps} steps "
             f"(t = {config.optim.lr * config.optim.steps:g}); ODE: {description['ode']}, {description['method']}, "
             f"{description['status']}, solve {description['solve_seconds']:.0f} s; training both runs {train_seconds:.0f} s, "
             f"compare {compare_seconds:.0f} s" + (f", theory {theory_seconds:.0f} s" if theory else "") +
             " (wall, this machine).", "",
             "Flow regime: " + " ".join(line for line in regime.table().splitlines() if line.startswith(("lr = ", "stage events"))),
             "",
             "| event | token | theory | ODE | run lr | run lr/2 | " + "".join(f"run {f:g} lr | " for f in also_lr)
             + "lr -> 0 | theory vs run | ODE vs run | ODE vs lr -> 0 |",
             "|---|---|---:|---:|---:|---:|" + "---:|" * len(also_lr) + "---:|---:|---:|---:|"]
    keyed = {(row.stage, row.query, row.direction, row.occurrence): row for row in rows}

    def first_time(key: tuple) -> float:
        row = keyed.get(key)
        times = [row.predicted, row.measured] if row is not None else []
        return min([value for value in [*times, predicted_by_theory.get(key)] if value is not None], default=np.inf)

    for key in sorted(set(keyed) | set(predicted_by_theory) | set(theory_notes), key=lambda k: (first_time(k), str(k))):
        row = keyed.get(key)
        ode, measured = (row.predicted, row.measured) if row is not None else (None, None)
        half_time, by_theory = measured_half.get(key), predicted_by_theory.get(key)
        limit = None if measured is None or half_time is None else 2 * half_time - measured
        query = key[1]
        name = row.name if row is not None else (names[query] if query is not None else "-")
        shown_theory = _show(by_theory) if by_theory is not None or key not in theory_notes else theory_notes[key]
        lines.append(f"| {event_label(key)} | {name} | {shown_theory} | {_show(ode)} | {_show(measured)} | {_show(half_time)} | "
                     + "".join(f"{_show(measured_also[f].get(key))} | " for f in also_lr) + f"{_show(limit)} | {_relative(by_theory, measured)} | {_relative(ode, measured)} | {_relative(ode, limit)} |")
    order = description["focus_order"]
    lines += ["", f"Order agreement of all events: {agreement if agreement is None else round(agreement, 2)}; of the first "
              f"focus onsets: {order['agreement'] if order['agreement'] is None else round(order['agreement'], 2)}. First "
              f"focus in frequency order (most frequent first): ODE {order['predicted_follows_frequency']}, run "
              f"{order['measured_follows_frequency']}. The {TOP} most frequent tokens: "
              + ", ".join(f"{row['token']} (π {row['pi']:.3f}: ODE {_show(row['predicted'])}, run {_show(row['measured'])})"
                          for row in order["tokens"][:TOP]) + ".", ""]
    text, ode = Observables.load(run), Observables.load(run / ODE_DIR)
    lines += ["| t | run's validation loss | surrogate's population loss |", "|---:|---:|---:|"]
    for target in np.geomspace(1, text.t[-1], 7):
        i = int(np.argmin(np.abs(np.log(text.t[1:]) - np.log(target)))) + 1
        lines.append(f"| {text.t[i]:.4g} | {float(text['loss'][i]):.4f} | {float(ode['loss'][i]):.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("text-validation"))
    parser.add_argument("--corpus", action="append", choices=["wikitext2", "tinystories"])
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--theory", action="store_true", help="add the theory's predictions (predict_run on the surrogate)")
    parser.add_argument("--also-lr", type=float, action="append", default=[], metavar="FACTOR",
                        help="one more run at FACTOR × lr (steps / FACTOR), as a column (repeatable)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the markdown file whose text-validation section is written")
    args = parser.parse_args()
    tables = [corpus_tables(corpus, args.out, args.overrides, args.theory, args.also_lr)
              for corpus in args.corpus or ["wikitext2", "tinystories"]]
    text = "\n\n".join(["## Text validation (`python benchmarks/text_validation.py`)", *tables])
    print(text)
    write_section(args.results, "text-validation", text)


if __name__ == "__main__":
    main()
