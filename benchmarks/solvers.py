"""Solver benchmark: every method side by side in one process, on both models.

    python benchmarks/solvers.py [--models one_layer,two_layer] [--methods JaxRadau,...] [--out benchmarks/RESULTS.md]

For each model (the default one-layer run to t = 6000; configs/two_layer/baseline.toml
to t = 200) and each method, it reports the compile time, the solve time after
compilation, steps, evaluations, and the error against a tight reference (scipy Radau
at rtol 1e-12): the largest relative loss error over the whole trajectory and the
relative error of the final parameters. Every method times its compilation (zero where
it reuses compiled code) apart from its solve; the fast methods run ``--repeats`` more
times and the least solve time is reported. Ratios are LSODA's solve time over the
method's, for LSODA at its default rtol 1e-8 and at rtol 1e-6 (equal accuracy: the
loosest LSODA setting whose loss error stays below 1e-6).

diffrax's methods run under a step budget (``--diffrax-max-steps``): on this stiff flow
the explicit ones need far more steps than that. Gradient descent runs at the largest
learning rates that are stable; its error is O(η), so the table also gives the η that
would reach a loss error of 1e-6 and the time that would take at the measured cost per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

# Compile times are measured cold: no executables from the on-disk cache of earlier runs.
os.environ.setdefault("FLOWSIM_COMPILATION_CACHE", "off")

from flowsim.config import load_config  # noqa: E402
from flowsim.assemble import prepare  # noqa: E402
from flowsim.methods import default_rtol  # noqa: E402
from flowsim.solve.solvers import solve_flow  # noqa: E402
from report import write_section  # noqa: E402

MODELS = {
    "one_layer": (None, ["time.t_end=6000"], [0.004, 0.002]),
    "two_layer": ("configs/two_layer/baseline.toml", [], [0.02, 0.01]),
}
TARGET_LOSS_ERROR = 1e-6


def errors(flow, result, reference) -> tuple[float, float]:
    """Largest relative loss error over the saved times reached; relative error of the last parameters."""
    n = len(result.trajectory)
    loss_error = float(np.max(np.abs(result.trajectory.loss / reference.trajectory.loss[:n] - 1)))
    if not result.success:
        return loss_error, float("nan")
    final = flow.flatten(result.trajectory.at(-1))
    final_reference = flow.flatten(reference.trajectory.at(-1))
    return loss_error, float(np.linalg.norm(final - final_reference) / np.linalg.norm(final_reference))


def run_method(prepared, label, method, repeats: int, **options) -> dict:
    """Compile time from the first call; with ``repeats``, the solve time is the least of
    that many further calls (a fresh executable's first run pays one-time set-up, and this
    machine's timings vary by tens of percent from run to run)."""
    result = solve_flow(prepared.flow, prepared.params0, prepared.times, method=method, **options)
    compile_seconds, solve_seconds = result.stats.compile_seconds, result.stats.solve_seconds
    if repeats:
        repeats = [solve_flow(prepared.flow, prepared.params0, prepared.times, method=method, **options) for _ in range(repeats)]
        result = repeats[-1]
        solve_seconds = min(run.stats.solve_seconds for run in repeats)
    stats = result.stats
    return {"label": label, "status": result.status_name, "t_reached": result.t_reached,
            "compile_s": compile_seconds, "solve_s": solve_seconds, "steps": stats.n_steps,
            "rejected": stats.n_rejected, "nfev": stats.nfev, "njev": stats.njev, "result": result}


def benchmark_model(name: str, args) -> list[dict]:
    config, overrides, learning_rates = MODELS[name]
    prepared = prepare(load_config(config, overrides))
    atol = load_config(config, overrides).solver.atol
    print(f"[{name}] n = {prepared.flow.size} parameters, t_end = {prepared.times[-1]:g}, {len(prepared.times)} save times",
          file=sys.stderr)
    started = time.perf_counter()
    reference = solve_flow(prepared.flow, prepared.params0, prepared.times, method="Radau", rtol=1e-12, atol=atol * 1e-3)
    print(f"[{name}] reference Radau rtol 1e-12: {reference.stats.n_steps} steps, {time.perf_counter() - started:.1f} s",
          file=sys.stderr)
    runs = []
    default = default_rtol("JaxRadau")
    plan = [
        ("LSODA rtol 1e-8 (LSODA's default)", "LSODA", dict(rtol=1e-8, atol=atol)),
        ("LSODA rtol 1e-6", "LSODA", dict(rtol=1e-6, atol=atol)),
        ("LSODA rtol 1e-5", "LSODA", dict(rtol=1e-5, atol=atol)),
        ("BDF rtol 1e-8", "BDF", dict(rtol=1e-8, atol=atol)),
        ("Radau rtol 1e-8", "Radau", dict(rtol=1e-8, atol=atol)),
        (f"**JaxRadau rtol {default:g} (project default)**", "JaxRadau", dict(rtol=default, atol=atol)),
        ("JaxRadau rtol 1e-6", "JaxRadau", dict(rtol=1e-6, atol=atol)),
        ("JaxRadau rtol 1e-8", "JaxRadau", dict(rtol=1e-8, atol=atol)),
        (f"JaxBDF rtol {default_rtol('JaxBDF'):g} (its default)", "JaxBDF", dict(rtol=default_rtol("JaxBDF"), atol=atol)),
        ("JaxBDF rtol 1e-8", "JaxBDF", dict(rtol=1e-8, atol=atol)),
        *[(f"{method} rtol 1e-8", method, dict(rtol=1e-8, atol=atol, max_steps=args.diffrax_max_steps))
          for method in ("Kvaerno5", "Tsit5", "Dopri8")],
        *[(f"gradient descent η = {lr:g}", "gradient_descent", dict(lr=lr, max_steps=10**8)) for lr in learning_rates],
    ]
    # LSODA's rows always run: they are the baselines of the ratio columns.
    plan = [row for row in plan if row[1] == "LSODA" or args.methods is None or row[1] in args.methods.split(",")]
    for label, method, options in plan:
        print(f"[{name}] {label} ...", file=sys.stderr)
        fast = method in ("LSODA", "BDF", "Radau", "JaxRadau", "JaxBDF", "Tsit5", "Dopri8")
        run = run_method(prepared, label, method, repeats=args.repeats if fast else 0, **options)
        run["loss_error"], run["param_error"] = errors(prepared.flow, run.pop("result"), reference)
        runs.append(run)
    # Ratios against LSODA at its default and at rtol 1e-6, the loosest LSODA setting
    # whose loss error stays below the 1e-6 target (equal accuracy).
    baseline, equal_accuracy = runs[0]["solve_s"], runs[1]["solve_s"]
    for run in runs:
        finished = run["status"] == "finished"
        run["ratio"] = baseline / run["solve_s"] if finished else float("nan")
        run["ratio_equal"] = equal_accuracy / run["solve_s"] if finished else float("nan")
    descent = [run for run in runs if run["label"].startswith("gradient descent")]
    if len(descent) == 2 and all(run["status"] == "finished" for run in descent):
        # error ∝ η: the η that meets the target, and its cost at the measured time per step
        lr = learning_rates[-1] * TARGET_LOSS_ERROR / descent[-1]["loss_error"]
        per_step = descent[-1]["solve_s"] / descent[-1]["steps"]
        steps = prepared.times[-1] / lr
        runs.append({"label": f"gradient descent η = {lr:.2g} (extrapolated)", "status": "estimate", "compile_s": float("nan"),
                     "solve_s": steps * per_step, "steps": int(steps), "rejected": None, "nfev": int(steps), "njev": 0,
                     "loss_error": TARGET_LOSS_ERROR, "param_error": float("nan"), "ratio": baseline / (steps * per_step),
                     "ratio_equal": equal_accuracy / (steps * per_step),
                     "t_reached": prepared.times[-1]})
    return runs


def table(name: str, runs: list[dict]) -> str:
    lines = [f"### {name}", "",
             "| method | status | compile s | solve s | LSODA 1e-8 / method | LSODA 1e-6 / method | steps | rejected | nfev | njev "
             "| max rel. loss error | rel. final θ error |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        status = run["status"] if run["status"] in ("finished", "estimate") else f"{run['status']} at t = {run['t_reached']:.4g}"
        lines.append(
            f"| {run['label']} | {status} | {run['compile_s']:.1f} | {run['solve_s']:.3f} | {run['ratio']:.2f} | {run['ratio_equal']:.2f} | {run['steps']} | "
            f"{run['rejected'] if run['rejected'] is not None else '–'} | {run['nfev'] if run['nfev'] is not None else '–'} | "
            f"{run['njev'] if run['njev'] is not None else '–'} | {run['loss_error']:.1e} | {run['param_error']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="one_layer,two_layer")
    parser.add_argument("--methods", default=None, help="Comma-separated methods to run (default: all; LSODA always runs).")
    parser.add_argument("--diffrax-max-steps", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=5, help="compiled solves per fast method; the least time counts")
    parser.add_argument("--out", type=Path, default=None, help="Write the tables as markdown here.")
    args = parser.parse_args()
    sections = []
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
        sections.append(table(name, benchmark_model(name, args)))
    text = "\n\n".join(sections)
    print(text)
    if args.out is not None:
        command = "python benchmarks/solvers.py " + " ".join(sys.argv[1:])
        write_section(args.out, "solvers", f"# Solver benchmark\n\nProduced by `{command}`.\n\n{text}")


if __name__ == "__main__":
    main()
