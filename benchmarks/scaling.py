"""Scaling benchmark: the exact mean-field flow from the paper's size to real vocabularies.

    python benchmarks/scaling.py [--cases paper,d64,...] [--methods JaxRadau,Tsit5,LSODA] [--out benchmarks/RESULTS.md]

Each case is the one-layer model on the paper family P = λI + (1-λ) 1 π^T with a Zipf-like
π_i ∝ 1/(i+1), λ = 0.5, ε = 1e-3, the default save grid, up to ``t_end``. Every (case,
method) runs in a process of its own, so its peak memory (resident set) is its own and a
compile does not profit from another's. Reported: compile time, solve time after
compilation, steps, vector-field evaluations, status, peak memory, and the largest
relative loss error over the saved times against a tight reference (JaxRadau at rtol
1e-9, atol 1e-15) where the reference fits in the time budget. LSODA runs only where its
dense n x n Hessian is affordable. Every method runs under a step budget (``--max-steps``)
and every process under a time limit (``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from report import write_section

os.environ.setdefault("FLOWSIM_COMPILATION_CACHE", "off")  # compile times measured cold

# label: (d, m = k, t_end)
CASES = {
    "paper": (4, 8, 6000.0),
    "d16": (16, 16, 6000.0),
    "d64": (64, 16, 6000.0),
    "d256": (256, 16, 6000.0),
    "d1000": (1000, 16, 6000.0),
    "d1000_m64": (1000, 64, 6000.0),
}
LSODA_MAX_SIZE = 3000  # its dense Hessian: n² numbers, n gradient evaluations per Jacobian
REFERENCE_MAX_SIZE = 40_000
MARKER = "scaling"


def case_config(label: str):
    from flowsim.config import resolve_config

    d, width, t_end = CASES[label]
    pi = 1.0 / np.arange(1, d + 1)
    pi = (pi / pi.sum()).tolist()
    return resolve_config({"chain": {"pi": pi, "lam": 0.5}, "model": {"m": width, "k": width}, "time": {"t_end": t_end}})


def run_one(label: str, method: str, rtol: float | None, atol: float | None, max_steps: int, loss_out: Path | None) -> dict:
    """One solve in this process; its loss trajectory to ``loss_out``."""
    from flowsim.experiment import prepare
    from flowsim.solvers import solve_flow

    config = case_config(label)
    prepared = prepare(config)
    started = time.perf_counter()
    result = solve_flow(prepared.flow, prepared.params0, prepared.times, method=method, rtol=rtol,
                        atol=config.solver.atol if atol is None else atol, max_steps=max_steps)
    wall = time.perf_counter() - started
    if loss_out is not None:
        np.save(loss_out, result.trajectory.loss)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stats = result.stats
    return {"case": label, "method": method, "n": prepared.flow.size, "status": result.status_name,
            "t_reached": result.t_reached, "compile_s": stats.compile_seconds, "solve_s": stats.solve_seconds,
            "wall_s": wall, "steps": stats.n_steps, "nfev": stats.nfev, "njev": stats.njev, "peak_mb": peak_mb,
            "rtol": rtol}


def in_subprocess(label: str, method: str, rtol=None, atol=None, max_steps=200_000, loss_out=None, timeout=1800) -> dict:
    command = [sys.executable, __file__, "--one", label, method, "--max-steps", str(max_steps)]
    command += [] if rtol is None else ["--rtol", str(rtol)]
    command += [] if atol is None else ["--atol", str(atol)]
    command += [] if loss_out is None else ["--loss-out", str(loss_out)]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": label, "method": method, "status": f"timeout ({timeout:g} s)"}
    if completed.returncode != 0:
        return {"case": label, "method": method, "status": "error: " + completed.stderr.strip().splitlines()[-1]}
    return json.loads(completed.stdout.strip().splitlines()[-1])


def benchmark(cases: list[str], methods: list[str], max_steps: int, timeout: float) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label in cases:
            d, width, _ = CASES[label]
            n = 2 * d * width + 2 * width * width
            reference_loss = None
            if n <= REFERENCE_MAX_SIZE:
                path = Path(folder) / f"{label}-reference.npy"
                print(f"[{label}] n = {n}: reference ...", file=sys.stderr, flush=True)
                reference = in_subprocess(label, "JaxRadau", rtol=1e-9, atol=1e-15, loss_out=path, timeout=timeout)
                if reference.get("status") == "finished":
                    reference_loss = np.load(path)
            for method in methods:
                if method == "LSODA" and n > LSODA_MAX_SIZE:
                    rows.append({"case": label, "method": method, "n": n, "status": f"skipped (n > {LSODA_MAX_SIZE})"})
                    continue
                print(f"[{label}] {method} ...", file=sys.stderr, flush=True)
                path = Path(folder) / f"{label}-{method}.npy"
                row = in_subprocess(label, method, max_steps=max_steps, loss_out=path, timeout=timeout)
                row.setdefault("n", n)
                if reference_loss is not None and path.is_file():
                    loss = np.load(path)
                    row["loss_error"] = float(np.max(np.abs(loss / reference_loss[: len(loss)] - 1)))
                rows.append(row)
                print(f"  {row}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    def show(row, key, form):
        value = row.get(key)
        return "–" if value is None else format(value, form)

    lines = ["| case | n | method | status | compile s | solve s | steps | nfev | peak MB | max rel. loss error |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        status = row["status"] if row["status"] != "step_limit" else f"step_limit at t = {row['t_reached']:.4g}"
        lines.append(f"| {row['case']} | {row['n']} | {row['method']} | {status} | {show(row, 'compile_s', '.1f')} | "
                     f"{show(row, 'solve_s', '.2f')} | {show(row, 'steps', 'd')} | {show(row, 'nfev', 'd')} | "
                     f"{show(row, 'peak_mb', '.0f')} | {show(row, 'loss_error', '.1e')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--methods", default="JaxRadau,Tsit5,LSODA")
    parser.add_argument("--max-steps", type=int, default=20_000, help="step budget of every method")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds each (case, method) process may take")
    parser.add_argument("--out", type=Path, default=None, help="Write the table into this markdown file (its own section).")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--rtol", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--atol", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loss-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.rtol, args.atol, args.max_steps, args.loss_out)))
        return
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; expected some of {list(CASES)}")
    rows = benchmark(cases, args.methods.split(","), args.max_steps, args.timeout)
    text = table(rows)
    print(text)
    if args.out is not None:
        command = "python benchmarks/scaling.py " + " ".join(sys.argv[1:])
        write_section(args.out, MARKER, f"# Scaling benchmark\n\nProduced by `{command}` (2-core CPU, float64).\n\n{text}")


if __name__ == "__main__":
    main()
