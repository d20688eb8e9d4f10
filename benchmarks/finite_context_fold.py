"""The fold's error at d = 1001: the second-order loss with the Markov correlations kept among K types only, against
the same loss with every C_q exact, on the points SGD passes through.

    python benchmarks/finite_context_fold.py --corpus tinystories [--folder runs/cycle-tinystories]
                                             [--kept 32,64,128,256] [--points 6] [--out benchmarks/RESULTS.md]

Reads the example's seed-0 SGD run (FOLDER/sgd, made by `python benchmarks/text_cycle.py --corpus CORPUS`) and, at
``--points`` of its checkpoints log-spaced from t = horizon / 100 to the horizon (fixed before anything is read),
computes the second-order loss L₂ and its gradient with the exact covariance (built in blocks of queries,
``second_order_losses_by_blocks``: d³ never held) and folded at each K (``kept_types``). The fold changes only the
correction L₂ - L_∞ (L_∞ the mean-field loss), so its errors are read against the correction: in value, and in the
correction's gradient (|g_K - g| / |g - g_∞|, and the cosine between g_K - g_∞ and g - g_∞), and against the whole
gradient (|g_K - g| / |g|: what moves the flow). Also one gradient's
seconds for each loss (jitted, the median of three after a warm call; on a busy machine these are not a benchmark).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from report import write_section


def flat(gradient: dict) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(gradient[name])) for name in sorted(gradient)])


def gradient_seconds(gradient, params) -> float:
    """The median of three timed calls after a warm one."""
    import jax

    jax.block_until_ready(gradient(params))
    times = []
    for _ in range(3):
        started = time.perf_counter()
        jax.block_until_ready(gradient(params))
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def main() -> None:
    import jax

    from finite_context_flow import example_run

    from flowsim.model.losses import make_loss_function, second_order_losses_by_blocks
    from flowsim.solve.trajectory import Trajectory

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="tinystories or wikitext2 (the d = 1001 examples)")
    parser.add_argument("--folder", type=Path, default=None, help="the text_cycle.py folder (default runs/cycle-NAME)")
    parser.add_argument("--kept", default="32,64,128,256", help="comma-separated kept-type counts K")
    parser.add_argument("--points", type=int, default=6, help="SGD checkpoints to check at")
    parser.add_argument("--block", type=int, default=64, help="queries per block of the exact covariance")
    parser.add_argument("--out", type=Path, default=None, help="a markdown file to write the table into (its section)")
    arguments = parser.parse_args()
    kept = [int(k) for k in arguments.kept.split(",")]
    name, run, config, data, chain, model = example_run(parser, arguments)
    s = config.data.s
    trajectory = Trajectory.load(run / "trajectory.npz")
    horizon = float(trajectory.t[-1])
    wanted = np.geomspace(horizon / 100, horizon, arguments.points)
    indices = sorted({int(np.argmin(np.abs(trajectory.t - t))) for t in wanted})
    points = [trajectory.at(i) for i in indices]

    print(f"{name}: the exact covariance in blocks of {arguments.block} queries at {len(points)} points", flush=True)
    started = time.perf_counter()
    exact = second_order_losses_by_blocks(model, chain, s, points, arguments.block)
    exact_seconds = time.perf_counter() - started
    losses = {"mean_field": make_loss_function(model, chain)}
    for k in kept:
        print(f"{name}: the fold at K = {k}", flush=True)
        losses[k] = make_loss_function(model, chain, "finite_second_order", s, kept_types=k)
    value_and_gradient = jax.jit(lambda params, loss: jax.value_and_grad(loss)(params))
    seconds = {label: gradient_seconds(lambda p, loss=loss: value_and_gradient(p, loss), points[0])
               for label, loss in losses.items()}

    lines = [f"{config.data.kind}, d = {chain.d}, s = {s}; points on SGD seed {config.data.seed}'s path; the exact "
             f"covariance's loss and gradient at all {len(points)} points took {exact_seconds:.0f} s; one gradient: "
             + ", ".join(f"{'mean-field' if label == 'mean_field' else f'K = {label}'} {seconds[label]:.2f} s"
                         for label in losses), "",
             "| t | L₂ - L_∞ (exact) | K | correction's error | gradient: abs(g_K - g) / abs(g - g_∞) | cosine "
             "| abs(g_K - g) / abs(g) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for index, params, (value, gradient) in zip(indices, points, exact):
        limit_value, limit_gradient = value_and_gradient(params, losses["mean_field"])
        correction, g, g_limit = value - float(limit_value), flat(gradient), flat(limit_gradient)
        for k in kept:
            folded_value, folded_gradient = value_and_gradient(params, losses[k])
            g_k = flat(folded_gradient)
            error = abs(float(folded_value) - value) / abs(correction)
            drift = np.linalg.norm(g_k - g) / np.linalg.norm(g - g_limit)
            cosine = float((g_k - g_limit) @ (g - g_limit) / np.linalg.norm(g_k - g_limit) / np.linalg.norm(g - g_limit))
            lines.append(f"| {trajectory.t[index]:.4g} | {correction:+.3g} | {k} | {100 * error:.1f}% | "
                         f"{100 * drift:.1f}% | {cosine:.4f} | {100 * np.linalg.norm(g_k - g) / np.linalg.norm(g):.2g}% |")
    text = "\n".join(lines)
    print(text)
    if arguments.out is not None:
        command = f"python benchmarks/finite_context_fold.py --corpus {arguments.corpus} --kept {arguments.kept}"
        write_section(arguments.out, f"finite-context-fold-{name}", f"## The fold at d = 1001 ({name})\n\n`{command}`\n\n{text}")


if __name__ == "__main__":
    main()
