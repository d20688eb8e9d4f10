"""The window loss's cost at the real vocabulary: the positional forward pass's two exact routes side by side.

    python benchmarks/window_loss_cost.py [--corpus wikitext2] [--windows 8192] [--repeats 20]

The shipped d = 1001 example's model (m = k = 16) on N training windows of s = 64 tokens, at its initial parameters.
Each route's vector field and J·v (``jax.linearize``) are compiled, called once, then timed as the mean of
``--repeats`` calls, in one process:

* rows: Σ_j a_j W0[x_j] from the context's embedding rows, O(N s m) (``OneLayerTransformer.mixture_over_rows``,
  the model's route where d > m);
* types: attention over the d token types through a one-hot tensor of the context, O(N s d)
  (``mixture_over_types``, its route where d <= m).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from flowsim.bridge.config import load_bridge_config
from flowsim.bridge.train import build_data
from flowsim.bridge.validate import example_config
from flowsim.model.flow import GradientFlow
from flowsim.model.losses import make_window_loss
from flowsim.model.models import OneLayerTransformer


class TypesRoute(OneLayerTransformer):
    """The same model, its positional pass always through attention over token types."""

    def context_mixture(self, params, weights, tokens):
        return self.mixture_over_types(params, weights, tokens)


def mean_seconds(function, argument, repeats: int) -> float:
    function(argument).block_until_ready()
    started = time.perf_counter()
    for _ in range(repeats):
        result = function(argument)
    result.block_until_ready()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="wikitext2", choices=("wikitext2", "tinystories"))
    parser.add_argument("--windows", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.windows < 1 or args.repeats < 1:
        parser.error(f"--windows and --repeats must be at least 1, got {args.windows} and {args.repeats}")
    config = load_bridge_config(example_config(args.corpus), [])
    data = build_data(config)
    windows = data.corpus.batch(args.windows, config.data.s + 1, config.data.seed + 7919, 0, "train").numpy()
    m = config.model
    rows = OneLayerTransformer(d=data.vocab_size, m=m.m, k=m.k)
    params0 = rows.init(m.init_eps, config.data.seed)
    print(f"{args.corpus}: d = {rows.d}, m = k = {m.m}, N = {args.windows} windows of s = {config.data.s}")
    for name, model in (("rows", rows), ("types", TypesRoute(d=rows.d, m=m.m, k=m.k))):
        flow = GradientFlow(make_window_loss(model, windows), params0)
        theta = jnp.concatenate([jnp.ravel(params0[group]) for group in flow.groups])
        field = jax.jit(lambda y, flow=flow: flow.vector_field(0.0, y))
        product = jax.jit(jax.linearize(field, theta)[1])
        field_s = mean_seconds(field, theta, args.repeats)
        product_s = mean_seconds(product, jnp.ones_like(theta), args.repeats)
        print(f"{name:>5}: field {1e3 * field_s:8.1f} ms   J·v {1e3 * product_s:8.1f} ms")


if __name__ == "__main__":
    main()
