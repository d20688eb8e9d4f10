"""Gradient descent and SGD on a text surrogate's mean-field loss, at a run's learning rate and batch.

    python benchmarks/surrogate_descent.py [--corpus wikitext2] [--routes 0.125:0,0.03125:0,0.125:256]
                                           [--seeds 0,1,2] [--t-end 1000] [--out benchmarks/RESULTS.md]

Each route is lr:B, from the d = 1001 example's start (configs/bridge/CORPUS-onelayer.toml) on the surrogate
of `flowsim bridge compare` (its bigram chain over the whole vocabulary), on the t = lr × steps clock:

- B = 0: gradient descent on the exact mean-field loss L, the flow's own discretisation at step lr;
- B > 0: SGD whose examples are (query i, next token y) pairs drawn from π_i P_iy, each with the loss
  ℓ(i, y) = logsumexp(F_i) - F_iy, F = softmax(Φ + log π) W0 W1: the s -> ∞ limit of a sequence's
  last-position loss, so that E ℓ = L and the batch noise is the pairs' alone (no finite context, no text).

Between the flow and SGD on the text, GD isolates what the step size does on the surrogate, SGD what its
batch noise adds. σ1(W0) is read every 5 units of t where it first exceeds 2, 3 and 5 times its start
(the detectors' restart is 10). Cost per step: O(d² m) for GD, O(B d m + d m k) for SGD.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from report import write_section
from surrogate_gap import DEPARTURE_FACTORS, first_crossings

jax.config.update("jax_enable_x64", True)

MARKER = "surrogate-descent"
READ_EVERY = 5.0  # units of t between readings of σ(W0)


def example_losses(model, params, log_pi: jax.Array, query: jax.Array, target: jax.Array) -> jax.Array:
    """ℓ(i, y) = logsumexp(F_i) - F_iy for each pair (query[b], target[b]), with F_i the mean-field logits of
    query type i (attention softmax(Φ_i + log π) over key types): O(B d m + d m k)."""
    queries = params["W0"][query] @ params["W_Q"]
    keys = params["W0"] @ params["W_K"]
    scale = 1.0 if model.logit_scale == "one" else 1.0 / np.sqrt(model.k)  # as model.attention_logits
    attention = jax.nn.softmax(scale * (queries @ keys.T) + log_pi, axis=-1)
    logits = model.logits_from_mixed(params, attention @ params["W0"], query)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, target[:, None], axis=1)[:, 0]


def pair_sampler(chain):
    """draw(key, B) -> B pairs (query i, target y) from π_i P_iy by inverse CDF: O(B log d), where a categorical draw
    over each query's row would cost O(B d). Row i's cumulative sums are offset by i, so one sorted array of d² holds
    them all and i + u finds row i's target (to float64's resolution at i, about 1e-13 for d = 1001)."""
    d = chain.d
    cumulative_pi = jnp.asarray(np.cumsum(chain.pi))
    cumulative_rows = jnp.asarray((np.cumsum(chain.P, axis=1) + np.arange(d)[:, None]).ravel())

    def draw(key, batch):
        key_query, key_target = jax.random.split(key)
        query = jnp.minimum(jnp.searchsorted(cumulative_pi, jax.random.uniform(key_query, (batch,)) * cumulative_pi[-1],
                                             side="right"), d - 1)
        row_total = cumulative_rows.reshape(d, d)[query, -1] - query  # 1 up to rounding
        u = jax.random.uniform(key_target, (batch,)) * row_total
        target = jnp.searchsorted(cumulative_rows, query + u, side="right") - query * d
        return query, jnp.clip(target, 0, d - 1)

    return draw


def descend(model, chain, params, lr: float, batch: int, t_end: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """GD (batch 0) or SGD on the surrogate from ``params``: the times and W0's singular values every READ_EVERY."""
    from flowsim.model.losses import population_loss_mean_field

    log_pi = jnp.log(jnp.asarray(chain.pi))
    draw = pair_sampler(chain)
    exact_gradient = jax.grad(lambda p: population_loss_mean_field(p, chain, model))
    batch_gradient = jax.grad(lambda p, i, y: jnp.mean(example_losses(model, p, log_pi, i, y)))
    per_reading = max(1, int(round(READ_EVERY / lr)))

    def step(carry, _):
        p, key = carry
        key, key_batch = jax.random.split(key)
        gradient = exact_gradient(p) if batch == 0 else batch_gradient(p, *draw(key_batch, batch))
        return (jax.tree_util.tree_map(lambda w, g: w - lr * g, p, gradient), key), None

    advance = jax.jit(lambda p, key: jax.lax.scan(step, (p, key), None, length=per_reading)[0])
    key = jax.random.PRNGKey(seed)
    times, sigmas = [0.0], [np.linalg.svd(np.asarray(params["W0"]), compute_uv=False)]
    for reading in range(int(round(t_end / lr)) // per_reading):
        params, key = advance(params, key)
        times.append((reading + 1) * per_reading * lr)
        sigmas.append(np.linalg.svd(np.asarray(params["W0"]), compute_uv=False))
    return np.array(times), np.array(sigmas)


def parse_routes(text: str) -> list[tuple[float, int]]:
    routes = []
    for item in text.split(","):
        lr, _, batch = item.partition(":")
        try:
            routes.append((float(lr), int(batch)))
        except ValueError:
            raise SystemExit(f"--routes: {item!r} is not lr:batch (e.g. 0.125:256, batch 0 for gradient descent)")
        if not (routes[-1][0] > 0 and routes[-1][1] >= 0):
            raise SystemExit(f"--routes: {item!r} needs lr > 0 and batch >= 0")
    return routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="wikitext2", choices=("wikitext2", "tinystories"))
    parser.add_argument("--routes", default="0.125:0,0.0625:0,0.03125:0,0.125:256,0.125:1024,0.125:4096,0.03125:256")
    parser.add_argument("--seeds", default="0", help="noise seeds of the SGD routes (GD has none)")
    parser.add_argument("--t-end", type=float, default=1000.0)
    parser.add_argument("--out", type=Path, default=None, help="write the table into this markdown file (its own section)")
    args = parser.parse_args()
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.data import load_corpus
    from flowsim.bridge.surrogate import text_surrogate
    from flowsim.model.models import model_from_config

    config = load_bridge_config(f"configs/bridge/{args.corpus}-onelayer.toml")
    chain, _ = text_surrogate(load_corpus(config.data.kind, config.data.vocab_size), config.compare)
    model = model_from_config(config.model, chain.d)
    params0 = model.init(config.model.init_eps, config.data.seed)  # the run's start (bridge.train)
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = ["| lr | batch | seed | " + " | ".join(f"σ1 > {f:g} ×" for f in DEPARTURE_FACTORS)
             + " | σ1 at t = " + " / ".join(str(int(args.t_end * q / 5)) for q in range(1, 6)) + " | s |",
             "|---:|---:|---:|" + "---:|" * len(DEPARTURE_FACTORS) + "---|---:|"]
    for lr, batch in parse_routes(args.routes):
        for seed in (seeds if batch else [0]):
            started = time.perf_counter()
            times, sigmas = descend(model, chain, params0, lr, batch, args.t_end, seed)
            crossings = first_crossings(times, sigmas[:, 1])
            cells = [f"{crossings[f]:g}" if f in crossings else "–" for f in DEPARTURE_FACTORS]
            at = " / ".join(f"{sigmas[np.argmin(abs(times - args.t_end * q / 5)), 1]:.3g}" for q in range(1, 6))
            lines.append(f"| {lr:g} | {batch or 'GD'} | {seed if batch else '–'} | " + " | ".join(cells)
                         + f" | {at} | {time.perf_counter() - started:.0f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        command = "python benchmarks/surrogate_descent.py " + " ".join(sys.argv[1:])
        write_section(args.out, f"{MARKER}-{args.corpus}",
                      f"## Descent on the surrogate's mean-field loss ({args.corpus}, d = {chain.d})\n\n"
                      f"Produced by `{command}`.\n\n{text}")


if __name__ == "__main__":
    main()
