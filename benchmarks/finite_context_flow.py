"""The flow of the loss at the run's context length s beside today's mean-field flow and SGD, on a text example.

    python benchmarks/finite_context_flow.py --corpus bridge/tinystories-d64.toml [--folder runs/cycle-tinystories-d64]
                                             [--samples 100000] [--control-variate 4096] [--out benchmarks/RESULTS.md]

Reads the example's seed-0 SGD run (FOLDER/sgd, made by `python benchmarks/text_cycle.py --corpus CONFIG`) and
integrates, from its own θ(0) and on its checkpoint times, the surrogate chain's flow under three losses:

* the mean-field loss (s → ∞, today's ODE);
* the finite-s loss to second order in the window's composition (``loss.kind = "finite_second_order"``: the
  composition's exact mean and covariance given the query, from P at the run's s);
* the same with each covariance C_q replaced by that of independent tokens drawn from the window's mean composition
  (``independent_tokens``): the ablation that says whether the Markov correlations between positions matter;
* with ``--control-variate N``, the unbiased finite-s loss (``"finite_control_variate"``: the second-order loss plus
  its remainder on N sampled windows, seed 0), whose flow costs minutes more.

Each is read as the run is (the run's probe set, the causal detectors). A second table checks the second-order
loss where the flow goes: at ten times fixed in advance (log-spaced from the condensation scale to the horizon), the
correction L₂ - L_∞ and its derivative along the flow's direction -∇L₂/|∇L₂|, against the same two numbers from
``--samples`` windows of the chain (per-window differences, so the standard error is the correction's own).
Cost at d = 64 (2-core CPU): each flow 1.5-2.5 minutes, the check under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from report import write_section

LOSSES = ("mean_field", "finite_second_order", "independent_tokens")
CHECK_TIMES = 10


def independent_tokens(composition):
    """The composition with each C_q replaced by that of a window whose other s - 1 tokens are drawn independently
    from its mean composition given q (``flowsim.model.windows.independent_covariance``). The means are kept; the
    Markov correlations between positions are dropped."""
    from flowsim.model.windows import independent_covariance

    return dataclasses.replace(composition, covariance=independent_covariance(composition.mean, composition.s))


def flow_events(config, data, chain, model, run: Path, kind: str, samples: int = 0) -> tuple[dict, float, object]:
    """The surrogate's flow under ``kind`` from the run's θ(0) on its checkpoint times: its events read on the probe
    set, its solve seconds, its trajectory."""
    from flowsim.bridge.compare import measured_like_the_run
    from flowsim.model.flow import GradientFlow
    from flowsim.model.losses import make_loss_function, second_order_loss
    from flowsim.model.windows import window_composition
    from flowsim.observe.observables import Observables
    from flowsim.observe.stages import detect_stages
    from flowsim.solve.solvers import solve_flow
    from flowsim.solve.trajectory import Trajectory

    params0 = Trajectory.load(run / "trajectory.npz").at(0)
    if kind == "independent_tokens":
        loss = second_order_loss(model, chain, independent_tokens(window_composition(chain, config.data.s)))
    else:
        loss = make_loss_function(model, chain, kind, config.data.s, mc_samples=max(samples, 2))
    started = time.perf_counter()
    result = solve_flow(GradientFlow(loss, params0), params0, Observables.load(run).t, method="auto",
                        rtol=config.compare.rtol, atol=config.compare.atol)
    seconds = time.perf_counter() - started
    return detect_stages(measured_like_the_run(model, result.trajectory, data)).events(), seconds, result.trajectory


def correction_check(chain, model, s: int, trajectory, times: np.ndarray, samples: int) -> list[dict]:
    """At each time: L₂ - L_∞ and its derivative along -∇L₂/|∇L₂|, from the moments and from ``samples`` windows."""
    import jax
    import jax.numpy as jnp

    from flowsim.model.losses import make_loss_function

    second, limit = make_loss_function(model, chain, "finite_second_order", s), make_loss_function(model, chain)
    windows = jnp.asarray(chain.sample(samples, s + 1, seed=123))
    pi = jnp.asarray(chain.pi)

    def per_window(params, windows):  # the windows an argument, not a constant XLA would fold at compile time
        logits = model.forward(params, windows[:, :-1])
        at_s = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, windows[:, -1:], -1)[:, 0]
        mean_field = model.mean_field_logits(params, pi)[windows[:, -2]]
        at_limit = jax.nn.logsumexp(mean_field, -1) - jnp.take_along_axis(mean_field, windows[:, -1:], -1)[:, 0]
        return at_s - at_limit

    correction = jax.jit(lambda params: second(params) - limit(params))
    gradient = jax.jit(jax.grad(second))
    along = jax.jit(lambda params, u, windows: (jax.jvp(correction, (params,), (u,))[1],
                                                *jax.jvp(lambda p: per_window(p, windows), (params,), (u,))))
    rows = []
    for t in times:
        params = trajectory.at(int(np.argmin(np.abs(trajectory.t - t))))
        g = gradient(params)
        norm = np.sqrt(sum(float(jnp.sum(value**2)) for value in g.values()))
        u = {name: -value / norm for name, value in g.items()}
        slope, sampled, sampled_slope = along(params, u, windows)
        sampled, sampled_slope = np.asarray(sampled), np.asarray(sampled_slope)
        rows.append({"t": float(t), "second_order": float(correction(params)), "sampled": float(sampled.mean()),
                     "stderr": float(sampled.std(ddof=1) / np.sqrt(samples)), "slope": float(slope),
                     "sampled_slope": float(sampled_slope.mean()),
                     "slope_stderr": float(sampled_slope.std(ddof=1) / np.sqrt(samples))})
    return rows


def example_run(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> tuple:
    """(name, FOLDER/sgd, its config, data, surrogate chain and model) of a text_cycle.py example's seed-0 run."""
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.surrogate import text_surrogate
    from flowsim.bridge.train import build_data
    from flowsim.model.models import model_from_config

    name = Path(arguments.corpus).stem
    run = (arguments.folder or Path("runs") / f"cycle-{name}") / "sgd"
    if not (run / "trajectory.npz").is_file():
        parser.error(f"no SGD run in {run}: run `python benchmarks/text_cycle.py --corpus {arguments.corpus}` first")
    config = load_bridge_config(run / "config.toml")
    data = build_data(config)
    chain, _ = text_surrogate(data.corpus, config.compare)
    return name, run, config, data, chain, model_from_config(config.model, data.vocab_size)


def main() -> None:
    from flowsim.observe.observables import Observables
    from flowsim.observe.stages import detect_stages, event_label

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="a bridge config (the d = 64 examples)")
    parser.add_argument("--folder", type=Path, default=None, help="the text_cycle.py folder (default runs/cycle-NAME)")
    parser.add_argument("--samples", type=int, default=100_000, help="windows for the check of the second-order loss")
    parser.add_argument("--control-variate", type=int, default=0, metavar="N",
                        help="also the control-variate loss's flow on N sampled windows (0: not run)")
    parser.add_argument("--out", type=Path, default=None, help="a markdown file to write the tables into (its section)")
    arguments = parser.parse_args()
    losses = LOSSES + (("finite_control_variate",) if arguments.control_variate else ())
    name, run, config, data, chain, model = example_run(parser, arguments)
    measured = Observables.load(run)
    names = [str(name) for name in measured.constants["type_names"]]
    sgd = detect_stages(measured).events()
    flows, seconds, trajectories = {}, {}, {}
    for kind in losses:
        print(f"{name}: the {kind} flow", flush=True)
        flows[kind], seconds[kind], trajectories[kind] = flow_events(config, data, chain, model, run, kind,
                                                                     arguments.control_variate)

    show = lambda value: "–" if value is None else f"{value:.4g}"  # noqa: E731
    error = lambda value, reference: ("–" if value is None or reference is None  # noqa: E731
                                      else f"{100 * (value - reference) / reference:+.0f}%")
    events = sorted(set(sgd) | {event for kind in losses for event in flows[kind]},
                    key=lambda event: min([sgd.get(event, np.inf)] + [flows[kind].get(event, np.inf) for kind in losses]))
    lines = [f"{config.data.kind}, d = {config.data.vocab_size + 1}, s = {config.data.s}, SGD seed {config.data.seed} "
             f"at lr {config.optim.lr:g} to t = {config.optim.lr * config.optim.steps:g}; every flow from the run's θ(0), "
             "read on its probe set; solve seconds " + ", ".join(f"{kind} {seconds[kind]:.0f}" for kind in losses), "",
             "| event | token | SGD | mean-field flow | vs SGD | second-order flow | vs SGD | independent tokens | vs SGD |"
             + (f" control variate, N = {arguments.control_variate} | vs SGD |" if arguments.control_variate else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if arguments.control_variate else "")]
    for event in events:
        token = names[event[1]] if event[1] is not None else "-"
        cells = [f"{show(flows[kind].get(event))} | {error(flows[kind].get(event), sgd.get(event))}" for kind in losses]
        lines.append(f"| {event_label(event)} | {token} | {show(sgd.get(event))} | " + " | ".join(cells) + " |")

    horizon = config.optim.lr * config.optim.steps
    start = flows["finite_second_order"].get(("condensation", None, None, 1), horizon / 100)
    times = np.geomspace(start, horizon, CHECK_TIMES)
    check = correction_check(chain, model, config.data.s, trajectories["finite_second_order"], times, arguments.samples)
    lines += ["", f"The second-order loss along its own flow against {arguments.samples} sampled windows (± one "
              "standard error):", "", "| t | L₂ - L_∞ | sampled | along -∇L₂: L₂ | sampled |", "|---:|---:|---:|---:|---:|"]
    for row in check:
        lines.append(f"| {row['t']:.4g} | {row['second_order']:+.5f} | {row['sampled']:+.5f} ± {row['stderr']:.5f} | "
                     f"{row['slope']:+.5f} | {row['sampled_slope']:+.5f} ± {row['slope_stderr']:.5f} |")
    text = "\n".join(lines)
    print(text)
    if arguments.out is not None:
        command = f"python benchmarks/finite_context_flow.py --corpus {arguments.corpus}" + (
            f" --control-variate {arguments.control_variate}" if arguments.control_variate else "")
        write_section(arguments.out, f"finite-context-{name}", f"## The finite-context flow ({name})\n\n`{command}`\n\n{text}")


if __name__ == "__main__":
    main()
