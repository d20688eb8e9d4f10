"""The premature-specialisation experiments on the induction task (configs/induction), with seeds.

    python benchmarks/induction_study.py [--seeds 5] [--regime-seeds 2] [--out runs/induction-study] [--eps 0.1 1.0]

Three sweeps (flowsim's sweep machinery: each row written when its run ends, an interrupted
study resumes), every run the exact flow of the two-layer model over positions:

* variants: model.ffn in (mlp, glu) × flow.qk_rho in (1, 0.25), and flow.smoothing_a in
  (0.1, 0.2) with the MLP: baseline, slowed, glu, glu_slowed, smoothing_0.1, smoothing_0.2;
* regime: init.eps × flow.qk_rho with the MLP (ε = 0.3 is the variants' own), to find where
  the baseline specialises prematurely (its upper entropy falls before the residual basis
  has matured).

Seed n starts every variant from the same initial parameters, so each variant is also
compared with the baseline seed by seed (paired differences, mean ± standard deviation).
Per variant: final loss, its gap to the Bayes loss, the time to reach the Bayes loss + 0.05,
the basis-maturity time and the premature-specialisation index (flowsim.specialisation),
mean ± standard deviation over seeds. The tables go to benchmarks/RESULTS.md (section
induction-study) and OUT/study.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flowsim.config import load_config, shipped_config
from flowsim.io import write_atomic_json
from flowsim.specialisation import first_time_below
from flowsim.sweep import run_sweep

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


def table(groups: dict[str, list[dict]], baseline: str = "baseline") -> str:
    lines = ["| variant | seeds | final loss | gap to Bayes | paired Δ loss vs baseline | t to Bayes + 0.05 | "
             "t basis mature | premature index |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {row["seed"]: row for row in groups.get(baseline, [])}
    for name, rows in groups.items():
        paired = [row["final_loss"] - base[row["seed"]]["final_loss"] for row in rows if row["seed"] in base]
        reached = sum(row["t_target"] is not None for row in rows)
        lines.append(f"| {name} | {len(rows)} | {spread([r['final_loss'] for r in rows])} | {spread([r['gap'] for r in rows])} | "
                     f"{spread(paired) if name != baseline else '-'} | {spread([r['t_target'] for r in rows])} ({reached}/{len(rows)}) | "
                     f"{spread([r['t_basis_mature'] for r in rows])} | {spread([r['premature_index'] for r in rows])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/induction-study"))
    parser.add_argument("--eps", type=float, nargs="+", default=[0.1, 1.0], help="besides the configs' 0.3")
    parser.add_argument("--regime-seeds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    sweeps = {
        "ffn_qk": {"model.ffn": ["mlp", "glu"], "flow.qk_rho": [1.0, 0.25]},
        "smoothing": {"flow.smoothing_a": [0.1, 0.2]},
        "regime": {"init.eps": args.eps, "flow.qk_rho": [1.0, 0.25]},
    }
    seeds = {"ffn_qk": args.seeds, "smoothing": args.seeds, "regime": args.regime_seeds}
    rows = {name: [with_target_time(row) for row in run_sweep(BASE, grid, seeds[name], args.out / name, workers=args.workers)]
            for name, grid in sweeps.items()}
    groups: dict[str, list[dict]] = {}
    for row in rows["ffn_qk"] + rows["smoothing"]:
        groups.setdefault(variant_name(row), []).append(row)
    order = ["baseline", "slowed", "glu", "glu_slowed", "smoothing_0.1", "smoothing_0.2"]
    groups = {name: groups[name] for name in order if name in groups}
    regime: dict[float, dict[str, list[dict]]] = {}
    base_eps = load_config(BASE).init.eps  # the variants' MLP runs are the regime sweep's ε = 0.3 rows
    mlp = [{**row, "init.eps": base_eps} for row in rows["ffn_qk"] if row["model.ffn"] == "mlp"]
    for row in sorted(rows["regime"] + mlp, key=lambda row: row["init.eps"]):
        kind = "slowed" if row["flow.qk_rho"] != 1.0 else "baseline"
        regime.setdefault(row["init.eps"], {}).setdefault(f"ε = {row['init.eps']:g}, {kind}", []).append(row)
    regime_lines = []
    for eps, eps_groups in regime.items():
        lines = table(eps_groups, baseline=f"ε = {eps:g}, baseline").splitlines()
        regime_lines += lines if not regime_lines else lines[2:]
    bayes = rows["ffn_qk"][0]["bayes_loss"]
    text = "\n".join([
        "## Induction task: premature specialisation with seeds (`python benchmarks/induction_study.py`)", "",
        f"Exact flows (configs/induction: d = 3, s = 5, noise 0.1, m = k = 8, FFN width 8, ε = 0.3, t = 300, Tsit5), "
        f"{args.seeds} seeds per variant; Bayes loss {bayes:.5f}, chance log 3 = {np.log(3):.5f}. Mean ± standard "
        "deviation over seeds; the paired difference is taken seed by seed (same start).", "",
        table(groups), "",
        "Regime sweep (MLP; seeds as above, baseline Q/K against slowed):", "",
        *regime_lines,
    ])
    print(text)
    write_atomic_json(args.out / "study.json", {"variants": groups, "regime": {str(k): v for k, v in regime.items()}, "bayes_loss": bayes})
    write_section(RESULTS, "induction-study", text)


if __name__ == "__main__":
    main()
