"""RKC with and without its stiffest directions taken out, on the d = 64 prediction.

    python benchmarks/rkc_deflation.py [--out benchmarks/RESULTS.md]

The chain is ``random_family(1, seed=64, dims=(64,), min_pi=0.2/64)``, m = k = 8, t_end = 6000 (the
prediction follows its flows to about 11 000). Four runs of ``predict_run``, one after the other, each in a
fresh process of its own with no compilation cache (so each pays its own compilations, as a user's first
``flowsim predict`` did before its rank-r flows took the exact flow's solver, ``theory.restart.LARGE_METHOD``): the
rank-r flows' RKC deflated (the default: up to two directions taken out), with at
most one direction taken out at a gap of 10 (the rule before), plain, and plain at 10× tighter tolerances
(REDUCED_RTOL 1e-7, FULL_RANK_RTOL 1e-5) as the reference for the restart times. Reported: wall time, RKC field evaluations
(Jacobian-vector products count as two) and steps, and each restart's difference from the reference. Run on
a quiet machine: a second busy process slows JAX's compiled loops many times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import flowsim.solve.rkc
import theory.manifold
import theory.restart
from flowsim.config import load_config
from prediction_accuracy import random_family
from theory.predict import predict_run

from report import write_section


class PlainRKC(flowsim.solve.rkc.RKC):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "deflate": False})


def run(solver: type, tight: bool, settings: dict) -> dict:
    """One prediction with ``solver`` for the rank-r flows (``settings``: flowsim.solve.rkc's constants changed); RKC's
    evaluations and steps counted."""
    counts = {"nfev": 0, "steps": 0}
    for name, value in settings.items():
        setattr(flowsim.solve.rkc, name, value)

    class Counted(solver):
        def _step_impl(self):
            nfev = self.nfev
            result = super()._step_impl()
            counts["nfev"] += self.nfev - nfev
            counts["steps"] += 1
            return result

    saved = theory.manifold.RKC, theory.restart.REDUCED_RTOL, theory.restart.FULL_RANK_RTOL
    theory.manifold.RKC = Counted
    theory.restart.LARGE_METHOD = "RKC"  # the former route, which these runs compare; the default is "FLOW"
    if tight:
        theory.restart.REDUCED_RTOL, theory.restart.FULL_RANK_RTOL = saved[1] / 10, saved[2] / 10
    (pi, lam), = random_family(1, seed=64, dims=(64,), min_pi=0.2 / 64)
    config = load_config(None, [f"chain.pi={json.dumps(pi)}", f"chain.lam={lam}", "time.t_end=6000"])
    try:
        started = time.perf_counter()
        prediction = predict_run(config)
        seconds = time.perf_counter() - started
    finally:
        theory.manifold.RKC, theory.restart.REDUCED_RTOL, theory.restart.FULL_RANK_RTOL = saved
    restarts = {r.direction: r.t_onset for r in prediction.cycles.restarts() if r.t_onset is not None}
    return {"seconds": seconds, **counts, "restarts": restarts}


RUNS = {"deflated": (flowsim.solve.rkc.RKC, False, {}),
        "one direction at most, gap 10 (the last stop's)": (flowsim.solve.rkc.RKC, False, {"MAX_DIRECTIONS": 1, "DEFLATION_GAP": 10.0}),
        "plain": (PlainRKC, False, {}), "plain, rtol / 10 (reference)": (PlainRKC, True, {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument("--one", choices=sorted(RUNS), help=argparse.SUPPRESS)  # a single run, its result as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(*RUNS[args.one])))
        return
    runs = {}
    for name in RUNS:
        out = subprocess.run([sys.executable, __file__, "--one", name], check=True, capture_output=True, text=True,
                             env={**os.environ, "FLOWSIM_COMPILATION_CACHE": "off"}).stdout
        runs[name] = json.loads(out.splitlines()[-1])
        runs[name]["restarts"] = {int(r): t for r, t in runs[name]["restarts"].items()}
        print(name, f"{runs[name]['seconds']:.1f} s", runs[name]["nfev"], "evaluations", flush=True)
    reference = runs["plain, rtol / 10 (reference)"]["restarts"]
    directions = sorted(reference)
    lines = ["| RKC | `predict`, s | RKC evaluations | RKC steps | " + " | ".join(f"σ{r} − reference" for r in directions) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(directions)]
    for name, result in runs.items():
        errors = [f"{result['restarts'][r] - reference[r]:+.2g}" if r in result["restarts"] else "-" for r in directions]
        lines.append(f"| {name} | {result['seconds']:.1f} | {result['nfev']} | {result['steps']} | " + " | ".join(errors) + " |")
    lines.append("| reference's restart times | | | | " + " | ".join(f"{reference[r]:.6g}" for r in directions) + " |")
    text = ["## RKC deflated against plain on the d = 64 prediction (`python benchmarks/rkc_deflation.py`)", "",
            "Chain `random_family(1, seed=64, dims=(64,), min_pi=0.2/64)`, m = k = 8, t_end = 6000; each run in a "
            "fresh process, one after the other, with no compilation cache (each compiles what it runs, as a first "
            "`flowsim predict` does).", "", *lines]
    write_section(args.out, "rkc-deflation", "\n".join(text))


if __name__ == "__main__":
    main()
