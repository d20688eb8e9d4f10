"""Scaling benchmark: the exact mean-field flow from the paper's size to real vocabularies.

    python benchmarks/scaling.py [--cases paper,d64,...] [--methods JaxRadau,Tsit5,LSODA] [--out benchmarks/RESULTS.md]
    python benchmarks/scaling.py --gpu [--out ...]      # the device check: GPU_CASES on JAX's CUDA backend

Each case is the one-layer model on the paper family P = λI + (1-λ) 1 π^T with a Zipf-like
π_i ∝ 1/(i+1), λ = 0.5, ε = 1e-3, the default save grid, up to ``t_end``. Every (case,
method) runs in a process of its own, so its peak memory (resident set) is its own and a
compile does not profit from another's. Reported: compile time, solve time after
compilation, steps, vector-field evaluations, status, peak memory, and the largest
relative loss error over the saved times against a tight reference (JaxRadau at rtol
1e-9, atol 1e-15) where the reference fits in the time budget. LSODA runs only where its
dense n x n Hessian is affordable. Every method runs under a step budget (``--max-steps``)
and every process under a time limit (``--timeout``).

Peers beside flowsim's own methods (``--methods``), both matrix-free, as a large flow needs:

* ``CVODE``: SUNDIALS CVODE (BDF, Newton with GMRES) through scikit-sundae, given the exact
  Jacobian-vector product J v = -∇²L v from JAX (one forward-over-reverse product);
* ``CVODE-DQ``: the same, its J v by CVODE's own difference quotient (one field evaluation each);
* ``Kvaerno5-GMRES``: diffrax's Kvaerno5 with optimistix's Newton iteration, its linear systems solved
  by lineax's GMRES on the linearised field (no Jacobian formed), compiled end to end like JaxRadau.

``--rtols`` runs every method at each tolerance, so that methods compare at equal loss error:
for each run of the baseline (``--baseline``, JaxRadau by default; several give a summary each), the summary gives every other method's
fastest run whose loss error is at most that run's, and the baseline's solve time over it. ``JaxBDF-exact`` is JaxBDF with exact J·v (``jax.linearize``) instead
of its default forward differences. ``field share`` is the solve time one vector-field
evaluation (timed alone) accounts for, nfev × t_field / solve s: how close a method runs to the
cost of the fields it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

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
    # through condensation (t ≈ log(1/ε)/μ1 ≈ 240 for Zipf π at d = 1000): the peers and the tight reference at
    # d = 1000 within a 2-core machine's time; the whole horizon needs a faster one
    "d1000_t300": (1000, 16, 300.0),
}
LSODA_MAX_SIZE = 3000  # its dense Hessian: n² numbers, n gradient evaluations per Jacobian
REFERENCE_MAX_SIZE = 40_000
# The device check, sized for about 3 minutes on one H200 (JaxRadau solved d = 1001 to t = 1000 there in 1.4-4.3 s):
# the compiled methods on the GPU, CVODE's field and J·v on it through host callbacks
GPU_PRESET = {"platform": "cuda", "cases": "d256,d1000_t300,d1000", "methods": "JaxBDF,JaxRadau,CVODE",
              "rtols": "1e-6,1e-8", "baseline": "CVODE", "timeout": 120.0, "section": "scaling-gpu"}
MARKER = "scaling"


def case_config(label: str):
    from flowsim.config import resolve_config

    d, width, t_end = CASES[label]
    pi = 1.0 / np.arange(1, d + 1)
    pi = (pi / pi.sum()).tolist()
    return resolve_config({"chain": {"pi": pi, "lam": 0.5}, "model": {"m": width, "k": width}, "time": {"t_end": t_end}})


PEER_RTOL = 1e-6  # the peers' tolerance when none is given


def solve_cvode(flow, theta0: np.ndarray, times: np.ndarray, rtol: float, atol: float, max_steps: int,
                exact_products: bool = True) -> dict:
    """CVODE (BDF, GMRES on J v from JAX, or on its own difference quotients) from θ0, saved at ``times``.
    Returns the saved states and counts (``njev``: J v products; by difference, each is one more field)."""
    import jax
    from sksundae.cvode import CVODE, CVODEJacTimes

    field = jax.jit(lambda t, y: flow.vector_field(t, y))
    product = jax.jit(lambda t, y, v: jax.jvp(lambda x: flow.vector_field(t, x), (y,), (v,))[1])
    field(0.0, theta0).block_until_ready(), product(0.0, theta0, theta0).block_until_ready()  # compiled before timing
    counts = {"nfev": 0, "njv": 0}

    def rhs(t, y, yp):
        counts["nfev"] += 1
        yp[:] = np.asarray(field(t, y))

    def jv(t, y, yp, v, Jv):
        counts["njv"] += 1
        Jv[:] = np.asarray(product(t, y, v))

    jactimes = CVODEJacTimes(None, jv) if exact_products else None
    solver = CVODE(rhs, method="BDF", linsolver="gmres", krylov_dim=20, jactimes=jactimes,
                   rtol=rtol, atol=atol, max_num_steps=max_steps)
    started = time.perf_counter()
    result = solver.solve(times, theta0)
    solve_s = time.perf_counter() - started
    finished = bool(result.success) and len(result.t) == len(times)
    return {"states": np.asarray(result.y), "status": "finished" if finished else f"failed: {result.message}",
            "t_reached": float(result.t[-1]), "solve_s": solve_s, "compile_s": 0.0, "steps": int(getattr(result, "nsteps", 0) or 0) or None,
            "nfev": counts["nfev"], "njev": counts["njv"] if exact_products else None}


def solve_kvaerno_krylov(flow, theta0: np.ndarray, times: np.ndarray, rtol: float, atol: float, max_steps: int) -> dict:
    """diffrax Kvaerno5, its Newton systems solved by lineax GMRES (matrix-free), from θ0 saved at ``times``."""
    import diffrax
    import jax
    import jax.numpy as jnp
    import lineax
    import optimistix

    from flowsim.model.flow import vector_field

    linear = lineax.GMRES(rtol=1e-3 * rtol, atol=1e-3 * atol, restart=20, stagnation_iters=40)
    # Newton, not diffrax's default VeryChord: VeryChord keeps a factorised Jacobian between steps, which a Krylov solver has not
    solver = diffrax.Kvaerno5(root_finder=optimistix.Newton(rtol=rtol, atol=atol, linear_solver=linear))
    # the field traced inline (lineax closure-converts the linearised field, which a nested jit would defeat)
    term = diffrax.ODETerm(lambda t, y, args: vector_field(flow.structure, t, y, flow.loss))

    @jax.jit
    def integrate(y0):
        return diffrax.diffeqsolve(term, solver, t0=float(times[0]), t1=float(times[-1]), dt0=None, y0=y0,
                                   saveat=diffrax.SaveAt(ts=jnp.asarray(times)), max_steps=max_steps, throw=False,
                                   stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol))

    started = time.perf_counter()
    compiled = integrate.lower(jnp.asarray(theta0)).compile()
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    solution = compiled(jnp.asarray(theta0))
    states = np.asarray(solution.ys)
    solve_s = time.perf_counter() - started
    reached = np.all(np.isfinite(states), axis=1)
    status = "finished" if bool(solution.result == diffrax.RESULTS.successful) else f"failed: {solution.result}"
    return {"states": states[reached], "status": status, "t_reached": float(times[reached][-1]) if reached.any() else 0.0,
            "solve_s": solve_s, "compile_s": compile_s, "steps": int(solution.stats["num_accepted_steps"]),
            "nfev": None, "njev": None}


PEERS = {"CVODE": solve_cvode, "CVODE-DQ": functools.partial(solve_cvode, exact_products=False),
         "Kvaerno5-GMRES": solve_kvaerno_krylov}
VARIANTS = {"JaxBDF-exact": ("JaxBDF", {"jacobian_products": "exact"})}  # flowsim methods with options


def field_seconds(flow, theta0: np.ndarray, repeats: int = 50) -> float:
    """Wall time of one compiled vector-field evaluation (the best of ``repeats``)."""
    import jax

    field = jax.jit(lambda y: flow.vector_field(0.0, y))
    field(theta0).block_until_ready()
    best = np.inf
    for _ in range(repeats):
        started = time.perf_counter()
        field(theta0).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return float(best)


def run_one(label: str, method: str, rtol: float | None, atol: float | None, max_steps: int, loss_out: Path | None) -> dict:
    """One solve in this process; its loss trajectory to ``loss_out``."""
    from flowsim.assemble import prepare
    from flowsim.solve.solvers import solve_flow

    config = case_config(label)
    prepared = prepare(config)
    atol = config.solver.atol if atol is None else atol
    flow = prepared.flow
    started = time.perf_counter()
    if method in PEERS:
        rtol = PEER_RTOL if rtol is None else rtol
        peer = PEERS[method](flow, flow.flatten(prepared.params0), np.asarray(prepared.times), rtol, atol, max_steps)
        loss = flow.loss_along(peer.pop("states"))
        row = peer
    else:
        method_object = method
        if method in VARIANTS:
            from flowsim.solve.solvers import method_named

            name, options = VARIANTS[method]
            method_object = dataclasses.replace(method_named(name), **options)
        result = solve_flow(flow, prepared.params0, prepared.times, method=method_object, rtol=rtol, atol=atol,
                            max_steps=max_steps)
        loss, stats = result.trajectory.loss, result.stats
        row = {"status": result.status_name, "t_reached": result.t_reached, "compile_s": stats.compile_seconds,
               "solve_s": stats.solve_seconds, "steps": stats.n_steps, "nfev": stats.nfev, "njev": stats.njev}
    wall = time.perf_counter() - started
    if loss_out is not None:
        np.save(loss_out, loss)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t_field = field_seconds(flow, flow.flatten(prepared.params0))
    share = None if not row.get("nfev") or not row.get("solve_s") else row["nfev"] * t_field / row["solve_s"]
    import jax

    return {"case": label, "method": method, "n": flow.size, **row, "wall_s": wall, "peak_mb": peak_mb, "rtol": rtol,
            "field_s": t_field, "field_share": share, "device": jax.devices()[0].device_kind}


def exception_line(stderr: str) -> str:
    """The line of a traceback that names the exception: the last one, but JAX appends a note on its filtered frames
    after it."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    while lines and (lines[-1].startswith("For simplicity, JAX has removed") or set(lines[-1]) == {"-"}):
        lines.pop()
    return lines[-1] if lines else "(no message)"


def check_platform(parser: argparse.ArgumentParser, platform: str) -> None:
    """Refuse a JAX backend this machine lacks before any run starts: under a JAX_PLATFORMS that names it, each run
    would fail inside JAX with a bare AssertionError."""
    import jax

    try:
        jax.devices(platform)
    except RuntimeError as error:
        parser.error(f"--platform {platform}{' (--gpu)' if platform == GPU_PRESET['platform'] else ''}: {error}")


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
        return {"case": label, "method": method, "status": "error: " + exception_line(completed.stderr)}
    return json.loads(completed.stdout.strip().splitlines()[-1])


def fastest_of(repeats: int, run: Callable[[], dict]) -> dict:
    """The run with the shortest solve of ``repeats`` (each in a fresh process): on a shared machine one solve's
    time varies from one process to the next (benchmarks/MEASUREMENTS.md), while the counts do not."""
    rows = [run() for _ in range(repeats)]
    timed = [row for row in rows if row.get("solve_s") is not None]
    best = min(timed, key=lambda row: row["solve_s"]) if timed else rows[-1]
    return {**best, "repeats": repeats} if repeats > 1 else best


def benchmark(cases: list[str], methods: list[str], max_steps: int, timeout: float,
              rtols: list[float | None] = (None,), repeats: int = 1) -> list[dict]:
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
                for rtol in rtols:
                    print(f"[{label}] {method} rtol {rtol} ...", file=sys.stderr, flush=True)
                    path = Path(folder) / f"{label}-{method}-{rtol}.npy"
                    row = fastest_of(repeats, lambda: in_subprocess(label, method, rtol=rtol, max_steps=max_steps,
                                                                    loss_out=path, timeout=timeout))
                    row.setdefault("n", n)
                    row.setdefault("rtol", rtol)
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

    lines = ["| case | n | method | rtol | status | compile s | solve s | steps | nfev | njev (CVODE: J v) | field share | peak MB | max rel. loss error |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        status = row["status"] if row["status"] != "step_limit" else f"step_limit at t = {row['t_reached']:.4g}"
        lines.append(f"| {row['case']} | {row['n']} | {row['method']} | {show(row, 'rtol', 'g')} | {status} | "
                     f"{show(row, 'compile_s', '.1f')} | {show(row, 'solve_s', '.2f')} | {show(row, 'steps', 'd')} | "
                     f"{show(row, 'nfev', 'd')} | {show(row, 'njev', 'd')} | {show(row, 'field_share', '.0%')} | "
                     f"{show(row, 'peak_mb', '.0f')} | {show(row, 'loss_error', '.1e')} |")
    return "\n".join(lines)


def equal_error_summary(rows: list[dict], baseline: str = "JaxRadau") -> str:
    """Per case, one block for each finished run of the baseline (each of its loss errors): every other method's
    fastest finished run whose loss error is at most the baseline run's, and the baseline's solve time over it (its
    speed-up; a run is never credited with an error it did not reach, so nothing is interpolated)."""
    lines = [f"| case | {baseline} rtol | {baseline} solve s | {baseline} loss error | method | rtol | solve s | "
             f"loss error | speed-up over {baseline} |", "|---|---:|---:|---:|---|---:|---:|---:|---:|"]

    def shown(rtol):
        return "default" if rtol is None else f"{rtol:g}"

    for case in dict.fromkeys(row["case"] for row in rows):
        finished = [row for row in rows if row["case"] == case and row.get("status") == "finished" and "loss_error" in row]
        others = [method for method in dict.fromkeys(row["method"] for row in finished) if method != baseline]
        for reference in sorted((row for row in finished if row["method"] == baseline), key=lambda row: -row["loss_error"]):
            level = f"| {case} | {shown(reference['rtol'])} | {reference['solve_s']:.2f} | {reference['loss_error']:.1e} |"
            for method in others:
                within = [row for row in finished if row["method"] == method
                          and row["loss_error"] <= max(reference["loss_error"], 1e-12)]
                if not within:
                    lines.append(f"{level} {method} | – | – | none within | – |")
                    continue
                best = min(within, key=lambda row: row["solve_s"])
                lines.append(f"{level} {method} | {shown(best['rtol'])} | {best['solve_s']:.2f} | {best['loss_error']:.1e} | "
                             f"{reference['solve_s'] / best['solve_s']:.2f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--methods", default="JaxRadau,Tsit5,LSODA",
                        help=f"flowsim methods, variants ({', '.join(VARIANTS)}) and peers ({', '.join(PEERS)})")
    parser.add_argument("--rtols", default="", help="comma-separated tolerances every method runs at (default: each method's own)")
    parser.add_argument("--max-steps", type=int, default=20_000, help="step budget of every method")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds each (case, method) process may take")
    parser.add_argument("--repeats", type=int, default=1, help="run each (case, method, rtol) this many times, each in "
                        "a fresh process, and report the fastest solve")
    parser.add_argument("--platform", choices=("cpu", "cuda"), default=None,
                        help="JAX's backend for every run (default: JAX's own choice); CVODE's own work stays on the host")
    parser.add_argument("--gpu", action="store_true", help=f"the device check: {GPU_PRESET}")
    parser.add_argument("--baseline", default="JaxRadau",
                        help="the method (or comma-separated methods, one summary each) the equal-error summary compares against")
    parser.add_argument("--out", type=Path, default=None, help="Write the table into this markdown file (its own section).")
    parser.add_argument("--section", default=MARKER, help="the section of --out the table replaces")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--rtol", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--atol", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loss-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.rtol, args.atol, args.max_steps, args.loss_out)))
        return
    if args.gpu:
        for name, value in GPU_PRESET.items():
            setattr(args, name, value)
    if args.platform is not None:
        check_platform(parser, args.platform)
        os.environ["JAX_PLATFORMS"] = args.platform  # the runs' subprocesses inherit it
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; expected some of {list(CASES)}")
    rtols = [float(value) for value in args.rtols.split(",") if value] or [None]
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    methods, baselines = args.methods.split(","), args.baseline.split(",")
    missing = [name for name in baselines if name not in methods]
    if missing:
        parser.error(f"--baseline {','.join(missing)} is not among --methods {args.methods}")
    rows = benchmark(cases, methods, args.max_steps, args.timeout, rtols, args.repeats)
    text = table(rows) + "".join(f"\n\nAt equal loss error, against {baseline}:\n\n" + equal_error_summary(rows, baseline)
                                 for baseline in baselines)
    print(text)
    if args.out is not None:
        command = "python benchmarks/scaling.py " + " ".join(sys.argv[1:])
        devices = sorted({row["device"] for row in rows if "device" in row}) or ["unknown device"]
        fastest = f"; each solve time the fastest of {args.repeats} processes" if args.repeats > 1 else ""
        write_section(args.out, args.section,
                      f"# Scaling benchmark\n\nProduced by `{command}` ({', '.join(devices)}, float64{fastest}).\n\n{text}")


if __name__ == "__main__":
    main()
