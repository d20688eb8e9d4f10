"""What share of the ODE's distance to SGD on text is the context, the text and SGD's noise: one table per example.

    python benchmarks/cycle_decomposition.py --corpus bridge/tinystories-d64.toml [--folder runs/cycle-tinystories-d64]
                                             [--samples 1024,4096] [--out benchmarks/RESULTS.md]
    python benchmarks/cycle_decomposition.py --corpus tinystories --samples ""     # d = 1001: no sampled flow

Every route starts from the seed-0 SGD run's own θ(0) (FOLDER/sgd, made by ``python benchmarks/text_cycle.py --corpus
CONFIG``), is saved on its checkpoint times, read on its probe set and labelled by the same causal detectors:

1. **SGD on the text**: the run itself.
2. **SGD on the chain**: the same run (lr, batch, steps, seed) with ``data.train_on = "surrogate"``: its training
   windows drawn from the text's bigram chain (FOLDER/chain-sgd). Route 1 against route 2 is what the text carries
   beyond its bigram chain.
3. **Sampled flows at s**: the flow of the chain's loss at the run's s, ``compare.surrogate_loss =
   "finite_control_variate"`` (the second-order loss plus its remainder on N fixed windows: unbiased for the loss,
   biased for the flow at small N by the fixed sample) at each N of ``--samples``, with the events extrapolated to
   N → ∞ as t(N₂) + (t(N₂) - t(N₁)) / (N₂/N₁ - 1) (a 1/N bias; its size says how far the largest N is from the limit).
   Route 2 against route 3 is SGD's noise and step on the loss at s.
4. **The second-order flow at s** (``"finite_second_order"``, the loss the bridge offers at any d, folded where the
   run's ``compare.kept_types`` says). Route 4 against route 3 is the expansion's error.
5. **SGD on the s → ∞ loss**: SGD at the run's lr, batch and steps on the mean-field loss, each step's B (query,
   next token) pairs drawn from the chain (query ~ π, next ~ P[query]), in JAX (``sgd_on_limit_loss``): SGD's noise
   and step with no finite context. Route 5 against route 6 is SGD's noise and step without the context.
6. **The mean-field flow** (s → ∞, the bridge's ``compare.surrogate_loss = "mean_field"``).

The shares, each in % of t₁: text = t₁ - t₂, noise and step = t₂ - t₃ (t₄ where no sampled flow is run), context
= t₃ - t₆; where neither flow at s is run, the context under SGD t₂ - t₅ and the noise and step at s → ∞ t₅ - t₆. Routes 2, 3 and 5 are cached in FOLDER (chain-sgd/, sgd/ode-finite_control_variate-nN/, limit-sgd/): a second
call rebuilds the table. Cost at d = 64 on this 2-core CPU: route 2 about 8 minutes, each sampled flow 5-20 minutes,
route 5 under a minute.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from report import write_section

LIMIT_SGD_DIR = "limit-sgd"
CHAIN_SGD_DIR = "chain-sgd"


def sgd_on_limit_loss(model, chain, params0: dict, lr: float, batch: int, steps: np.ndarray, seed: int,
                      progress=print):
    """SGD on the mean-field (s → ∞) loss: each step θ ← θ - lr ∇ (1/B) Σ_b -log softmax(Z[q_b])[y_b] with
    q_b ~ π, y_b ~ P[q_b] drawn afresh (B = ``batch``), Z the mean-field logits of the queries drawn. Saved at the
    given step counts (ascending, the first 0) as a ``Trajectory`` on t = lr × steps, its loss column the exact
    mean-field loss. Cost O(d² k + B d m) a step (Φ whole, the logits of the B queries only)."""
    import jax
    import jax.numpy as jnp

    from flowsim.model.losses import make_loss_function
    from flowsim.solve.trajectory import Trajectory

    pi, log_pi = jnp.asarray(chain.pi), jnp.log(jnp.asarray(chain.pi))
    log_P = jnp.log(jnp.clip(jnp.asarray(chain.P), 1e-300))

    def batch_loss(params, query, target):
        logits = model.logits_over_types(params, log_pi[None, :], query)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[:, None], -1)[:, 0])

    gradient = jax.grad(batch_loss)

    @jax.jit
    def advance(params, key, n):
        def step(_, carry):
            params, key = carry
            key, draw_query, draw_target = jax.random.split(key, 3)
            query = jax.random.choice(draw_query, chain.d, (batch,), p=pi)
            target = jax.random.categorical(draw_target, log_P[query])
            g = gradient(params, query, target)
            return {name: params[name] - lr * g[name] for name in params}, key
        return jax.lax.fori_loop(0, n, step, (params, key))

    limit_loss = jax.jit(make_loss_function(model, chain))
    params, key = {name: jnp.asarray(value) for name, value in params0.items()}, jax.random.PRNGKey(seed)
    saved, losses, done, started = [], [], 0, time.perf_counter()
    for target_step in steps:
        params, key = advance(params, key, int(target_step) - done)
        done = int(target_step)
        saved.append({name: np.asarray(value) for name, value in params.items()})
        losses.append(float(limit_loss(params)))
        if len(saved) % 50 == 0:
            progress(f"SGD on the s → ∞ loss: step {done}/{int(steps[-1])}, {time.perf_counter() - started:.0f} s")
    return Trajectory(t=lr * np.asarray(steps, float), loss=np.asarray(losses),
                      params={name: np.stack([p[name] for p in saved]) for name in saved[0]})


def limit_sgd_observables(folder: Path, config, data, chain, model, progress=print):
    """Route 5's observables, cached in FOLDER/limit-sgd/ (its trajectory.npz; deleted to recompute)."""
    from flowsim.bridge.compare import measured_like_the_run
    from flowsim.observe.observables import Observables
    from flowsim.solve.trajectory import Trajectory

    run = folder / "sgd"
    out = folder / LIMIT_SGD_DIR / "trajectory.npz"
    t = Observables.load(run).t
    steps = np.rint(t / config.optim.lr).astype(int)
    if out.is_file():
        trajectory = Trajectory.load(out)
    else:
        trajectory = sgd_on_limit_loss(model, chain, Trajectory.load(run / "trajectory.npz").at(0), config.optim.lr,
                                       config.data.batch_size, steps, config.data.seed, progress)
        out.parent.mkdir(exist_ok=True)
        trajectory.save(out)
    return measured_like_the_run(model, trajectory, data)


def chain_sgd_observables(folder: Path, progress: bool = True):
    """Route 2's observables: the run with its windows drawn from the bigram chain (FOLDER/chain-sgd, resumed)."""
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.train import train
    from flowsim.observe.observables import Observables

    config = load_bridge_config(folder / "sgd" / "config.toml", ["data.train_on=surrogate"])
    train(config, folder / CHAIN_SGD_DIR, progress=progress)
    return Observables.load(folder / CHAIN_SGD_DIR)


def extrapolated(small: float | None, large: float | None, ratio: float) -> float | None:
    """The N → ∞ time of an event from its times at N and ratio·N, under a bias ∝ 1/N."""
    return None if small is None or large is None else large + (large - small) / (ratio - 1)


def share(a: float | None, b: float | None, reference: float | None) -> str:
    return "–" if a is None or b is None or not reference else f"{100 * (a - b) / reference:+.0f}%"


def main() -> None:
    from flowsim.bridge.compare import ode_beside
    from flowsim.bridge.validate import flow_at_s_fold
    from flowsim.observe.observables import Observables
    from flowsim.observe.stages import detect_stages, event_label

    from finite_context_flow import example_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="a bridge config, or tinystories / wikitext2 (d = 1001)")
    parser.add_argument("--folder", type=Path, default=None, help="the text_cycle.py folder (default runs/cycle-NAME)")
    parser.add_argument("--samples", default="1024,4096", help="the sampled flows' N, two ascending (\"\": none)")
    parser.add_argument("--without-second-order", action="store_true",
                        help="leave route 4 out (at d = 1001 its folded flow takes tens of minutes)")
    parser.add_argument("--out", type=Path, default=None, help="a markdown file to write the table into (its section)")
    arguments = parser.parse_args()
    try:
        samples = [int(n) for n in arguments.samples.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--samples must be comma-separated integers, got {arguments.samples!r}")
    if samples and (len(samples) != 2 or samples[0] >= samples[1]):
        parser.error(f"--samples takes two ascending sample counts or none, got {samples}")
    name, run, config, data, chain, model = example_run(parser, arguments)
    folder = run.parent
    report = lambda message: print(f"{name}: {message}", flush=True)  # noqa: E731

    seconds = {}
    routes: dict[str, Observables] = {"text SGD": Observables.load(run)}
    started = time.perf_counter()
    report("SGD on the chain")
    routes["chain SGD"] = chain_sgd_observables(folder)
    seconds["chain SGD"] = time.perf_counter() - started
    for n in samples:
        report(f"the sampled flow at s, N = {n}")
        started = time.perf_counter()
        routes[f"sampled flow, N = {n}"] = ode_beside(run, True, "finite_control_variate", samples=n)[0]
        seconds[f"sampled flow, N = {n}"] = time.perf_counter() - started
    if not arguments.without_second_order:
        report("the second-order flow at s")
        started = time.perf_counter()
        kept_types, _ = flow_at_s_fold(config, folded=True)
        routes["second-order flow"] = ode_beside(run, True, "finite_second_order", kept_types=kept_types)[0]
        seconds["second-order flow"] = time.perf_counter() - started
    report("SGD on the s → ∞ loss")
    started = time.perf_counter()
    routes["SGD on s → ∞"] = limit_sgd_observables(folder, config, data, chain, model, report)
    seconds["SGD on s → ∞"] = time.perf_counter() - started
    report("the mean-field flow")
    started = time.perf_counter()
    routes["mean-field flow"] = ode_beside(run, True, "mean_field")[0]
    seconds["mean-field flow"] = time.perf_counter() - started

    events = {route: detect_stages(observables).events() for route, observables in routes.items()}
    if samples:
        small, large = (events[f"sampled flow, N = {n}"] for n in samples)
        events["sampled flow, N → ∞"] = {event: extrapolated(small.get(event), large.get(event), samples[1] / samples[0])
                                         for event in set(small) & set(large)}
    at_s = next((route for route in ("sampled flow, N → ∞", "second-order flow") if route in events), None)
    shares = [("text (1 - 2)", "text SGD", "chain SGD")] + (
        [(f"noise, step (2 - {at_s})", "chain SGD", at_s), (f"context ({at_s} - 6)", at_s, "mean-field flow")] if at_s
        else [("context under SGD (2 - 5)", "chain SGD", "SGD on s → ∞"), ("noise, step at s → ∞ (5 - 6)", "SGD on s → ∞",
                                                                          "mean-field flow")])
    names = [str(token) for token in routes["text SGD"].constants["type_names"]]
    order = sorted(set().union(*events.values()),
                   key=lambda event: min(times.get(event) or np.inf for times in events.values()))
    columns = list(events)
    show = lambda value: "–" if value is None else f"{value:.4g}"  # noqa: E731
    lines = [f"{config.data.kind}, d = {chain.d}, s = {config.data.s}, seed {config.data.seed}, lr {config.optim.lr:g}, "
             f"B = {config.data.batch_size}, to t = {config.optim.lr * config.optim.steps:g}; every route from the run's "
             "θ(0), read on its probe set by the causal detectors; shares in % of SGD on the text's time. Seconds (cached "
             "routes: reading only): " + ", ".join(f"{route} {value:.0f}" for route, value in seconds.items()), "",
             "| event | token | " + " | ".join(columns) + " | " + " | ".join(label for label, _, _ in shares) + " |",
             "|---|---|" + "---:|" * (len(columns) + len(shares))]
    for event in order:
        token = names[event[1]] if event[1] is not None else "-"
        t = {column: events[column].get(event) for column in columns}
        lines.append(f"| {event_label(event)} | {token} | " + " | ".join(show(t[column]) for column in columns) + " | "
                     + " | ".join(share(t[a], t[b], t["text SGD"]) for _, a, b in shares) + " |")
    sigma1 = {column: routes[column]["sv_W0"][-1, 0] for column in columns if column in routes}
    lines.append(f"| σ1(W0) at t = {routes['text SGD'].t[-1]:.4g} | - | "
                 + " | ".join(f"{sigma1[column]:.3g}" if column in sigma1 else "–" for column in columns)
                 + " |" * (len(shares) + 1))
    text = "\n".join(lines)
    print(text)
    if arguments.out is not None:
        command = (f"python benchmarks/cycle_decomposition.py --corpus {arguments.corpus} --samples \"{arguments.samples}\""
                   + (" --without-second-order" if arguments.without_second_order else ""))
        write_section(arguments.out, f"decomposition-{name}", f"## The cycle's decomposition ({name})\n\n`{command}`\n\n{text}")


if __name__ == "__main__":
    main()
