"""The premature-specialisation experiments on the induction task (configs/induction), with seeds.

    python benchmarks/induction_study.py [--seeds 5] [--regime-seeds 2] [--horizon-seeds 2] [--workers 2]
                                         [--out runs/induction-study]
                                         [--set section.key=value ...]

Four sweeps (flowsim's sweep machinery: each row written when its run ends, an interrupted
study resumes), every run the exact flow of the two-layer model over positions, one run per
solve (a batched JaxRadau solve steps at the pace of its stiffest seed):

* variants: model.ffn in (mlp, glu) × flow.qk_rho in (1, 0.25), and flow.smoothing_a in
  (0.1, 0.2) with the MLP: baseline, slowed, glu, glu_slowed, smoothing_0.1, smoothing_0.2;
* scale: init.eps in --eps × flow.qk_rho in (1, 0.25) with the MLP (ε = 0.3 is the
  variants' own);
* horizon: t_end = --long-horizon (the slow window stretched with it: hold 4%, ramp 1%)
  × flow.qk_rho in (1, 0.25) with the MLP, to see whether the residual basis matures later.

Seed n starts every variant from the same initial parameters, so each variant is also
compared with the baseline seed by seed (paired differences, mean ± standard deviation).
Per variant: the outcome (final loss, its gap to the Bayes loss, the time to reach the Bayes
loss + 0.05, the seeds left more than 0.05 above it, the final previous-token and induction
masses) and the specialisation probes of flowsim.observe.specialisation (when the upper entropy had
done 90% of its fall, how far the residual basis turned over the next doubling of time, the
basis maturity per doubling and against the end, and the premature index under each).
Tables to benchmarks/RESULTS.md (section induction-study) and OUT/study.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flowsim.config import load_config, shipped_config
from flowsim.common.io import write_atomic_json
from flowsim.observe.specialisation import first_time_below
from flowsim.runs.sweep import run_sweep

from report import spread, write_section

RESULTS = Path(__file__).with_name("RESULTS.md")
BASE = shipped_config("induction") / "baseline.toml"
TARGET_ABOVE_BAYES = 0.05


def variant_name(row: dict) -> str:
    if row.get("flow.smoothing_a"):
        return f"smoothing_{row['flow.smoothing_a']:g}"
    ffn, slowed = row.get("model.ffn", "mlp"), row.get("flow.qk_rho", 1.0) != 1.0
    return {("mlp", False): "baseline", ("mlp", True): "slowed", ("glu", False): "glu", ("glu", True): "glu_slowed"}[(ffn, slowed)]


def with_target_time(row: dict) -> dict:
    curve = row["curve"]
    target = row["bayes_loss"] + TARGET_ABOVE_BAYES
    return {**row, "t_target": first_time_below(np.asarray(curve["t"]), np.asarray(curve["loss"]), target),
            "gap": row["final_loss"] - row["bayes_loss"]}


def outcome_table(groups: dict[str, list[dict]], baseline: str) -> list[str]:
    lines = ["| variant | seeds | final loss | gap to Bayes | paired Δ loss vs baseline | t to Bayes + 0.05 | "
             "seeds > Bayes + 0.05 at the end | previous-token mass | induction mass |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {row["seed"]: row for row in groups.get(baseline, [])}
    for name, rows in groups.items():
        column = lambda key: spread([r.get(key) for r in rows])  # noqa: E731
        paired = [row["final_loss"] - base[row["seed"]]["final_loss"] for row in rows if row["seed"] in base]
        stuck = [row["seed"] for row in rows if row["gap"] > TARGET_ABOVE_BAYES]
        lines.append(f"| {name} | {len(rows)} | {column('final_loss')} | {column('gap')} | "
                     f"{spread(paired) if name != baseline else '-'} | {column('t_target')} | "
                     f"{len(stuck)} {stuck if stuck else ''} | {column('final_prev_token_mass')} | {column('final_induction_mass')} |")
    return lines


def specialisation_table(groups: dict[str, list[dict]]) -> list[str]:
    lines = ["| variant | t upper specialised (90% of its entropy fall) | basis turn over [t, 2t] there (rad) | "
             "basis mature per doubling | premature index | basis mature vs end | index vs end |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in groups.items():
        column = lambda key: spread([r.get(key) for r in rows])  # noqa: E731
        lines.append(f"| {name} | {column('t_upper_specialised')} | {column('basis_turn_at_specialisation')} | "
                     f"{column('t_basis_mature')} | {column('premature_index')} | {column('t_basis_final')} | "
                     f"{column('premature_index_final')} |")
    return lines


def grouped(rows: list[dict], label) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(label(row), []).append(row)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/induction-study"))
    parser.add_argument("--eps", type=float, nargs="+", default=[0.1, 1.0], help="besides the configs' 0.3")
    parser.add_argument("--long-horizon", type=float, default=1000.0)
    parser.add_argument("--regime-seeds", type=int, default=2)
    parser.add_argument("--horizon-seeds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value for every run")
    args = parser.parse_args()
    base = load_config(BASE, args.overrides)
    stretch = args.long_horizon / base.time.t_end
    sweeps = {
        "ffn_qk": ({"model.ffn": ["mlp", "glu"], "flow.qk_rho": [1.0, 0.25]}, args.seeds),
        "smoothing": ({"flow.smoothing_a": [0.1, 0.2]}, args.seeds),
        "regime": ({"init.eps": args.eps, "flow.qk_rho": [1.0, 0.25]}, args.regime_seeds),
        "horizon": ({"time.t_end": [args.long_horizon], "flow.qk_t0": [base.flow.qk_t0 * stretch],
                     "flow.qk_tr": [base.flow.qk_tr * stretch], "flow.qk_rho": [1.0, 0.25]}, args.horizon_seeds),
    }
    rows = {name: [with_target_time(row) for row in run_sweep(BASE, grid, seeds, args.out / name, base_overrides=args.overrides,
                                                                 workers=args.workers, batch=1)]
            for name, (grid, seeds) in sweeps.items()}
    order = ["baseline", "slowed", "glu", "glu_slowed", "smoothing_0.1", "smoothing_0.2"]
    variants = grouped(rows["ffn_qk"] + rows["smoothing"], variant_name)
    variants = {name: variants[name] for name in order if name in variants}
    mlp = [{**row, "init.eps": base.init.eps, "time.t_end": base.time.t_end} for row in rows["ffn_qk"] if row["model.ffn"] == "mlp"]
    kind = lambda row: "slowed" if row["flow.qk_rho"] != 1.0 else "baseline"  # noqa: E731
    regime = grouped(sorted([{**row, "time.t_end": base.time.t_end} for row in rows["regime"]] + mlp
                            + [{**row, "init.eps": base.init.eps} for row in rows["horizon"]],
                            key=lambda row: (row["time.t_end"], row["init.eps"], kind(row) == "slowed")),
                     lambda row: f"ε = {row['init.eps']:g}, t = {row['time.t_end']:g}, {kind(row)}")
    regime_lines = []
    for label in dict.fromkeys(name.rsplit(",", 1)[0] for name in regime):
        part = {name: group for name, group in regime.items() if name.startswith(label + ",")}
        lines = outcome_table(part, baseline=f"{label}, baseline")
        regime_lines += lines if not regime_lines else lines[2:]
    regime_specialisation = specialisation_table(regime)
    bayes = rows["ffn_qk"][0]["bayes_loss"]
    text = "\n".join([
        "## Induction task: premature specialisation with seeds (`python benchmarks/induction_study.py`)", "",
        f"Exact flows (configs/induction: d = 3, s = 5, noise 0.1, m = k = 8, FFN width 8, ε = {base.init.eps:g}, "
        f"t = {base.time.t_end:g}, {base.solver.method}), {args.seeds} seeds per variant; Bayes loss {bayes:.5f}, chance "
        f"log 3 = {np.log(3):.5f}. Mean ± standard deviation over seeds ('(k/n)': defined for k of n seeds); the paired "
        "difference is taken seed by seed (seed n starts every variant from the same parameters).", "",
        "Outcome:", "", *outcome_table(variants, "baseline"), "",
        "Specialisation probes (flowsim.observe.specialisation):", "", *specialisation_table(variants), "",
        f"Scale and horizon (MLP; {args.regime_seeds} seeds at ε = {', '.join(f'{e:g}' for e in args.eps)}, "
        f"{args.horizon_seeds} at t = {args.long_horizon:g} with the slow window stretched with it):", "",
        *regime_lines, "", *regime_specialisation,
    ])
    print(text)
    write_atomic_json(args.out / "study.json", {"variants": variants, "regime": regime, "bayes_loss": bayes})
    write_section(RESULTS, "induction-study", text)


if __name__ == "__main__":
    main()
