"""The cycle on real text: every event of a shipped example's cycle, SGD at its lr and at lr/2, beside the ODE and
the theory.

    python benchmarks/text_cycle.py --corpus tinystories [--folder runs/cycle-tinystories] [--no-theory]
                                    [--quarter] [--seeds 1,2,3] [--flow-at-s] [--out benchmarks/RESULTS.md]
    python benchmarks/text_cycle.py --corpus bridge/wikitext2-d64.toml     # a bridge config: the d = 64 examples

Runs `flowsim bridge validate CORPUS` (the shipped example, to its whole cycle, or the config named) into FOLDER, and the same run at
lr/2 for twice the steps (the same t) into FOLDER-half (SGD and the ODE only: the theory and the ODE do not depend
on lr); with ``--quarter`` at lr/4 too (FOLDER-quarter). Each part is cached, so a second call only rebuilds the
table. An event is in the flow regime when halving lr moves it less than 5%; the ODE is compared with SGD at the
largest lr where it is, else at the smallest lr run (the nearer the flow; flagged * with ``--quarter``). Columns: the
theory, the ODE read on the whole vocabulary and on the run's probe set, SGD at lr and lr/2, how far halving lr
moved the event, and the ODE (probe set, as SGD is read) and the theory (against the ODE on the vocabulary, as it
reads) with their relative errors. On this 2-core CPU TinyStories takes about 4 minutes at lr, 7 at lr/2, plus the
theory.

``--seeds`` also runs the example at those seeds (``data.seed``: the initial draw and the batches; SGD and the ODE
from each seed's own start, into FOLDER-seedS) and tabulates, per event, SGD's and the ODE's mean ± SD over the
seeds with seed 0, and the distance between the two means in SGD's SDs: where SGD's noise decides a time. Where
validate reads the flow of the loss at the run's s, its mean ± SD and distance are tabulated beside them, and the
further seeds, held out from the flow's development on seed 0, say which flow predicts SGD better
(``held_out_verdict``: its rule was fixed before they were read).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from report import write_section

FLOW_REGIME = 0.05  # halving lr moves an event in the flow regime by less than this


def key(row: dict) -> tuple:
    return row["stage"], row["query"], row["direction"], row["occurrence"]


def relative(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else abs(a - b) / b


def cycle_rows(full: dict, half: dict, quarter: dict | None = None) -> list[dict]:
    """One row per event of any run: the times, the lr/2 shift (and lr/4's, from lr/2, with ``quarter``), the
    flow-regime SGD time and the errors. The flow-regime time is the largest lr's whose halving moves the event
    less than FLOW_REGIME; where none does, the smallest lr's, flagged ``regime_reached = False``."""
    halves = {key(row): row for row in half["rows"]}
    quarters = {key(row): row for row in quarter["rows"]} if quarter is not None else {}
    rows = []
    for event in list(dict.fromkeys([key(row) for row in full["rows"]] + list(halves) + list(quarters))):
        base = next((table_rows[event] for table_rows in ({key(r): r for r in full["rows"]}, halves, quarters)
                     if event in table_rows))
        full_row = next((r for r in full["rows"] if key(r) == event), None)
        sgd = full_row["sgd"] if full_row else None
        sgd_half = halves.get(event, {}).get("sgd")
        sgd_quarter = quarters.get(event, {}).get("sgd") if quarter is not None else None
        shift, shift_half = relative(sgd, sgd_half), relative(sgd_half, sgd_quarter)
        ladder = [(sgd, shift), (sgd_half, shift_half)] + ([(sgd_quarter, None)] if quarter is not None else [])
        reached = [time for time, moved in ladder if time is not None and moved is not None and moved < FLOW_REGIME]
        reference = reached[0] if reached else ladder[-1][0]  # else the smallest lr's (None where it lacks the event)
        ode = base["ode"]
        rows.append({**base, "sgd": sgd, "sgd_half": sgd_half, "sgd_quarter": sgd_quarter, "shift": shift,
                     "shift_half": shift_half, "flow_regime_sgd": reference, "regime_reached": bool(reached),
                     "ode_vs_flow_regime_sgd": relative(ode, reference),
                     "theory": full_row["theory"] if full_row else None,
                     "ode_finite_s": full_row.get("ode_finite_s") if full_row else None,
                     "formula": full_row.get("formula") if full_row else None,
                     "theory_vs_ode": relative(full_row["theory"], full_row["ode_full_vocabulary"]) if full_row else None})
    return rows


def table(rows: list[dict], full: dict) -> str:
    from flowsim.observe.stages import event_label

    show = lambda value: "–" if value is None else f"{value:.4g}"  # noqa: E731
    percent = lambda value: "–" if value is None else f"{100 * value:.1f}%"  # noqa: E731
    quarter = any(row.get("sgd_quarter") is not None for row in rows)
    rates = f"{full['lr']:g}, {full['lr'] / 2:g}" + (f" and {full['lr'] / 4:g}" if quarter else "")
    extra_head, extra_rule = (" SGD lr/4 | lr/4 moved it (from lr/2) |", "---:|---:|") if quarter else ("", "")
    finite = any(row.get("ode_finite_s") is not None for row in rows)
    finite_head, finite_rule = (" ODE at s (probe set) | ODE at s vs flow-regime SGD |", "---:|---:|") if finite else ("", "")
    lines = [f"{full['corpus']}, d = {full['d']}, SGD lr = {rates} to t = {full['t_end']:g}; "
             f"surrogate: {full['surrogate']}" + ("; * : no two successive lr within 5%, the smallest lr's time" if quarter else "")
             + ("; ODE at s: the surrogate's loss at the run's s to second order" if finite else ""), "",
             f"| event | token | formula | theory | ODE (vocabulary) | ODE (probe set) | SGD lr | SGD lr/2 | lr/2 moved it |{extra_head} "
             f"ODE vs flow-regime SGD | theory vs ODE |{finite_head}",
             f"|---|---|---:|---:|---:|---:|---:|---:|---:|{extra_rule}---:|---:|{finite_rule}"]
    for row in rows:
        extra = f" {show(row['sgd_quarter'])} | {percent(row['shift_half'])} |" if quarter else ""
        flag = "*" if quarter and not row["regime_reached"] and row["ode_vs_flow_regime_sgd"] is not None else ""
        lines.append(f"| {event_label(key(row))} | {row['token']} | {show(row.get('formula'))} | {show(row['theory'])} "
                     f"| {show(row['ode_full_vocabulary'])} | {show(row['ode'])} | {show(row['sgd'])} "
                     f"| {show(row['sgd_half'])} | {percent(row['shift'])} |{extra} {percent(row['ode_vs_flow_regime_sgd'])}{flag} "
                     f"| {percent(row['theory_vs_ode'])} |"
                     + (f" {show(row['ode_finite_s'])} | {percent(relative(row['ode_finite_s'], row['flow_regime_sgd']))} |"
                        if finite else ""))
    return "\n".join(lines)


def spread(values: list[float]) -> tuple[float, float] | None:
    """(mean, sample SD) of the values, or None when fewer than two seeds have the event."""
    import numpy as np

    return None if len(values) < 2 else (float(np.mean(values)), float(np.std(values, ddof=1)))


def seeds_table(payloads: dict[int, dict]) -> str:
    """Per event seen at any seed: SGD's, the mean-field ODE's and (where validate read it) the ODE at s's mean ± SD
    over the seeds, and each ODE's |mean - SGD mean| in SGD's SDs; events some seeds lack say how many have them."""
    from flowsim.observe.stages import event_label

    sides = ("sgd", "ode", "ode_finite_s")
    events: dict[tuple, dict[str, list[float]]] = {}
    for payload in payloads.values():
        for row in payload["rows"]:
            entry = events.setdefault(key(row), {**{side: [] for side in sides}, "token": row["token"]})
            for side in sides:
                if row.get(side) is not None:
                    entry[side].append(row[side])
    finite = any(entry["ode_finite_s"] for entry in events.values())
    shown_sides = sides if finite else sides[:2]
    n = len(payloads)
    lines = [f"seeds {sorted(payloads)}", "", "| event | token | SGD mean ± SD (seeds) | ODE mean ± SD (seeds) "
             "| ODE vs SGD, in SGD's SDs |" + (" ODE at s mean ± SD (seeds) | ODE at s vs SGD, in SGD's SDs |" if finite else ""),
             "|---|---|---:|---:|---:|" + ("---:|---:|" if finite else "")]
    seen = {event: entry for event, entry in events.items() if any(entry[side] for side in sides)}  # not the theory's alone
    for event, entry in sorted(seen.items(), key=lambda item: min(sum((item[1][side] for side in sides), []))):
        cells = []
        sgd = spread(entry["sgd"])
        for side in shown_sides:
            summary = spread(entry[side])
            cells.append("–" if summary is None else f"{summary[0]:.4g} ± {summary[1]:.2g} ({len(entry[side])}/{n})")
            if side != "sgd":
                cells.append("–" if sgd is None or summary is None or sgd[1] == 0
                             else f"{abs(summary[0] - sgd[0]) / sgd[1]:.1f}")
        lines.append(f"| {event_label(event)} | {entry['token']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SCORED_STAGES = ("restart", "focus", "dilution")  # the events the held-out verdict scores (not condensation)


def held_out_verdict(payloads: dict[int, dict], held_out: list[int]) -> str:
    """Which flow predicts SGD better on the held-out seeds, by a rule fixed before they were read: over every
    restart, first focus and dilution of a word (not the probe set's "other") that SGD shows at every held-out seed,
    a flow's error is |its mean - SGD's mean| / SGD's mean over those seeds, 100% where it lacks the event at any of
    them; the flow with the smaller median error is the better predictor."""
    import numpy as np

    from flowsim.observe.stages import event_label

    sides = ("ode", "ode_finite_s")
    rows = [{key(row): row for row in payloads[seed]["rows"]} for seed in held_out]
    scored = [event for event in rows[0] if event[0] in SCORED_STAGES and event[3] == 1
              and rows[0][event]["token"] != "other" and all(r.get(event, {}).get("sgd") is not None for r in rows)]
    if not scored or not all(any(r[event].get("ode_finite_s") is not None for event in r) for r in rows):
        return ""
    errors = {side: [] for side in sides}
    lines = [f"Held-out seeds {held_out}: |flow mean - SGD mean| / SGD mean (100% where a flow lacks the event at a "
             "held-out seed)", "", "| event | token | SGD mean | mean-field flow | flow at s |", "|---|---|---:|---:|---:|"]
    for event in sorted(scored, key=lambda event: np.mean([r[event]["sgd"] for r in rows])):
        sgd = float(np.mean([r[event]["sgd"] for r in rows]))
        cells = []
        for side in sides:
            times = [r[event].get(side) for r in rows]
            error = 1.0 if any(time is None for time in times) else abs(float(np.mean(times)) - sgd) / sgd
            errors[side].append(error)
            cells.append(f"{100 * error:.1f}%")
        lines.append(f"| {event_label(event)} | {rows[0][event]['token']} | {sgd:.4g} | " + " | ".join(cells) + " |")
    medians = {side: float(np.median(errors[side])) for side in sides}
    better = "the flow at s" if medians["ode_finite_s"] < medians["ode"] else "the mean-field flow"
    lines += ["", f"Median error over {len(scored)} events: mean-field flow {100 * medians['ode']:.1f}%, flow at s "
              f"{100 * medians['ode_finite_s']:.1f}%: {better} is the better predictor on the held-out seeds."]
    return "\n".join(lines)


def example_parser(description: str) -> argparse.ArgumentParser:
    """--corpus, --folder and --out, shared with sgd_noise.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--corpus", required=True, help="tinystories, wikitext2 (the d = 1001 examples) or a bridge config")
    parser.add_argument("--folder", type=Path, default=None, help="where the runs go (default runs/cycle-NAME)")
    parser.add_argument("--out", type=Path, default=None, help="a markdown file to write the table into (its section)")
    return parser


def example_name_and_folder(arguments: argparse.Namespace) -> tuple[str, Path]:
    name = Path(arguments.corpus).stem if arguments.corpus.endswith(".toml") else arguments.corpus
    return name, arguments.folder or Path("runs") / f"cycle-{name}"


def main() -> None:
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.validate import example_config, validate

    parser = example_parser(__doc__.split("\n")[0])
    parser.add_argument("--no-theory", action="store_true", help="SGD and the ODE only")
    parser.add_argument("--seeds", default="", help="comma-separated further seeds (data.seed), e.g. 1,2,3")
    parser.add_argument("--flow-at-s", action="store_true", help="at d = 1001 too, the flow of the loss at s (folded; "
                                                                  "tens of minutes a seed)")
    parser.add_argument("--quarter", action="store_true", help="also SGD at lr/4 (four times the steps, into FOLDER-quarter): "
                                                                "the flow regime one halving further")
    arguments = parser.parse_args()
    name, folder = example_name_and_folder(arguments)
    config = load_bridge_config(example_config(arguments.corpus))
    report = lambda message: print(f"{name}: {message}", flush=True)  # noqa: E731
    full = validate(arguments.corpus, folder, theory=not arguments.no_theory, folded_finite_s=arguments.flow_at_s,
                    progress=report)
    half = validate(arguments.corpus, Path(f"{folder}-half"), theory=False, finite_s=False, progress=report,
                    overrides=[f"optim.lr={config.optim.lr / 2}", f"optim.steps={2 * config.optim.steps}"])
    quarter = None
    if arguments.quarter:
        quarter = validate(arguments.corpus, Path(f"{folder}-quarter"), theory=False, finite_s=False, progress=report,
                           overrides=[f"optim.lr={config.optim.lr / 4}", f"optim.steps={4 * config.optim.steps}"])
    text = table(cycle_rows(full, half, quarter), full)
    try:
        seeds = [int(seed) for seed in arguments.seeds.split(",") if seed.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {arguments.seeds!r}")
    if seeds:
        payloads = {0: full, **{seed: validate(arguments.corpus, Path(f"{folder}-seed{seed}"), [f"data.seed={seed}"],
                                                theory=False, folded_finite_s=arguments.flow_at_s, progress=report)
                                       for seed in seeds}}
        text += "\n\n" + seeds_table(payloads)
        verdict = held_out_verdict(payloads, seeds)
        text += f"\n\n{verdict}" if verdict else ""
    print(text)
    print("seconds:", {"lr": full["seconds"], "lr/2": half["seconds"], **({"lr/4": quarter["seconds"]} if quarter else {})})
    if arguments.out is not None:
        command = (f"python benchmarks/text_cycle.py --corpus {arguments.corpus}" + (" --no-theory" if arguments.no_theory else "")
                   + (" --flow-at-s" if arguments.flow_at_s else "")
                   + (" --quarter" if arguments.quarter else "") + (f" --seeds {arguments.seeds}" if seeds else ""))
        write_section(arguments.out, f"cycle-{name}", f"`{command}`\n\n{text}")


if __name__ == "__main__":
    main()
