"""The text validation: each shipped text config trained at its lr and at lr/2 (the flow-regime
check), the exact flow of its full-vocabulary bigram surrogate beside it, and the stage times
side by side.

    python benchmarks/text_validation.py [--out DIR] [--corpus wikitext2 --corpus tinystories]
                                         [--set section.key=value ...]

For each event (condensation's end; the first focus and dilution onsets of the tracked tokens;
each restart) the table gives the ODE's time, the run's at lr and at lr/2, and the first-order
extrapolation of the run to lr -> 0, 2 t(lr/2) - t(lr): where SGD's times move linearly with lr,
that is the flow's time, so the ODE is compared both with the run as trained and with its
lr -> 0 limit. The loss columns put the surrogate's population loss beside the run's
validation loss (how far the bigram chain is from the text). The tables go into
benchmarks/RESULTS.md (section text-validation); every run stays under --out and is resumed
when the script is run again.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from flowsim.bridge.compare import ODE_DIR, compare_bridge_run
from flowsim.bridge.config import load_bridge_config
from flowsim.bridge.regime import check_flow_regime
from flowsim.config import shipped_config
from flowsim.observables import Observables
from flowsim.stages import detect_stages, stage_events, subject_label

from report import write_section

RESULTS = Path(__file__).with_name("RESULTS.md")
TOP = 5  # the focus onsets of the most frequent tokens the targets name


def _relative(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{100 * abs(a - b) / b:.1f}%"


def _show(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def corpus_tables(corpus: str, out: Path, overrides: list[str]) -> str:
    config = load_bridge_config(shipped_config("bridge") / f"{corpus}-onelayer.toml", overrides)
    started = time.perf_counter()
    regime = check_flow_regime(config, out / corpus, progress=True)
    train_seconds = time.perf_counter() - started
    run, half = out / corpus / "lr", out / corpus / "lr_half"
    started = time.perf_counter()
    rows, agreement, description = compare_bridge_run(run, progress=True)
    compare_seconds = time.perf_counter() - started
    measured_half = stage_events(detect_stages(Observables.load(half)))
    lines = [f"### {corpus}", "",
             f"d = {description['surrogate_d']} (vocab_size {config.data.vocab_size} + <unk>), m = k = {config.model.m}, "
             f"s = {config.data.s}, batch {config.data.batch_size}, SGD lr = {config.optim.lr:g} for {config.optim.steps} steps "
             f"(t = {config.optim.lr * config.optim.steps:g}); ODE: {description['ode']}, {description['method']}, "
             f"{description['status']}, solve {description['solve_seconds']:.0f} s; training both runs {train_seconds:.0f} s, "
             f"compare {compare_seconds:.0f} s (wall, this machine).", "",
             f"Flow regime: {regime.table().splitlines()[-1]}", "",
             "| event | token | ODE | run lr | run lr/2 | lr -> 0 | ODE vs run | ODE vs lr -> 0 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        key = (row.stage, row.query, row.direction, row.occurrence)
        half_time = measured_half.get(key)
        limit = None if row.measured is None or half_time is None else 2 * half_time - row.measured
        event = f"{row.stage} {subject_label(row.query, row.direction)} #{row.occurrence}"
        lines.append(f"| {event} | {row.name} | {_show(row.predicted)} | {_show(row.measured)} | {_show(half_time)} | "
                     f"{_show(limit)} | {_relative(row.predicted, row.measured)} | {_relative(row.predicted, limit)} |")
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
    args = parser.parse_args()
    tables = [corpus_tables(corpus, args.out, args.overrides) for corpus in args.corpus or ["wikitext2", "tinystories"]]
    text = "\n\n".join(["## Text validation (`python benchmarks/text_validation.py`)", *tables])
    print(text)
    write_section(RESULTS, "text-validation", text)


if __name__ == "__main__":
    main()
