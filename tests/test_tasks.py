"""The induction task: its exact law against independent routes, the positional two-layer
model against a loop, an induction circuit built by hand near the Bayes loss where a
one-layer model stays far from it, and the Q/K window and smoothing on the new model."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from jax.flatten_util import ravel_pytree

from flowsim.cli import compare_runs
from flowsim.config import ConfigError, load_config
from flowsim.assemble import prepare
from flowsim.runs.experiment import execute_run
from flowsim.model.flow import DepthSmoothing, GradientFlow
from flowsim.model.losses import _sampled_cross_entropy_jit, make_task_loss, population_loss_task
from flowsim.model.models import PositionalTwoLayerTransformer
from flowsim.observe.observables import Observables
from flowsim.observe.specialisation import summarise
from flowsim.model.tasks import InductionTask

TASK = InductionTask(d=3, s=6, noise=0.1)


def test_law_is_a_distribution_with_uniform_averaged_transitions():
    law = TASK.law
    assert np.isclose(law.probability.sum(), 1.0, atol=1e-12) and np.all(law.probability > 0)
    np.testing.assert_allclose(law.next_law.sum(axis=1), 1.0, atol=1e-12)
    # averaged over the permutation every transition is uniform: the query alone predicts nothing
    for q in range(TASK.d):
        rows = law.contexts[:, -1] == q
        np.testing.assert_allclose(law.probability[rows] @ law.next_law[rows] / law.probability[rows].sum(), 1 / TASK.d, atol=1e-12)
    np.testing.assert_allclose(TASK.pi, 1 / TASK.d, atol=1e-12)
    assert 0 < TASK.bayes_loss < math.log(TASK.d) - 0.5
    # without noise a query seen before fixes the next token: its law is a point mass
    exact = InductionTask(d=3, s=5, noise=0.0).law
    seen = np.array([row[-1] in row[:-1] for row in exact.contexts])
    assert seen.any() and np.allclose(exact.next_law[seen].max(axis=1), 1.0)


def test_next_token_law_is_the_posterior_over_permutations():
    """Bayes' rule written out per context, one permutation at a time."""
    law = TASK.law
    rng = np.random.default_rng(0)
    for n in rng.choice(len(law.contexts), 25, replace=False):
        context = law.contexts[n]
        weights, predictions = [], []
        for g in itertools.permutations(range(TASK.d)):
            step = lambda x, y: (1 - TASK.noise) * (y == g[x]) + TASK.noise / TASK.d  # noqa: E731
            weights.append(np.prod([step(a, b) for a, b in zip(context[:-1], context[1:])]))
            predictions.append([step(context[-1], y) for y in range(TASK.d)])
        posterior = np.array(weights) / np.sum(weights)
        np.testing.assert_allclose(law.next_law[n], posterior @ np.array(predictions), atol=1e-12)


def test_exact_loss_matches_monte_carlo_and_the_sampler_matches_the_law():
    model = PositionalTwoLayerTransformer(d=3, s=6, m=6, k=4, ffn="mlp", ffn_width=5)
    params = model.init(0.7, 1)
    exact = float(population_loss_task(params, TASK, model))
    sequences = TASK.sample(200_000, seed=2)
    losses = np.asarray(_sampled_cross_entropy_jit(model, params, sequences[:, :-1], sequences[:, -1]))
    assert abs(losses.mean() - exact) < 4 * losses.std() / np.sqrt(len(losses))
    # the sampler's context frequencies against the exact law (the 20 most likely contexts)
    codes = sequences[:, :-1] @ (TASK.d ** np.arange(TASK.s)[::-1])
    exact_codes = TASK.law.contexts @ (TASK.d ** np.arange(TASK.s)[::-1])
    counts = np.bincount(codes, minlength=TASK.d**TASK.s)[exact_codes] / len(sequences)
    top = np.argsort(-TASK.law.probability)[:20]
    p = TASK.law.probability[top]
    assert np.all(np.abs(counts[top] - p) < 5 * np.sqrt(p * (1 - p) / len(sequences)))
    assert float(make_task_loss(model, TASK)(params)) == pytest.approx(exact, rel=1e-14)
    with pytest.raises(ValueError, match="loss.mc_samples must be an integer >= 2, got 1"):
        make_task_loss(model, TASK, "monte_carlo", mc_samples=1)


def test_positional_forward_matches_an_explicit_loop():
    model = PositionalTwoLayerTransformer(d=3, s=4, m=5, k=3, ffn="glu", ffn_width=4)
    p = {name: np.asarray(value) for name, value in model.init(0.8, 3).items()}
    tokens = np.random.default_rng(4).integers(0, 3, (7, 4))
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    expected = []
    for row in tokens:
        h0 = p["W_E"][row] + p["W_P"]
        h1 = h0.copy()
        for i in range(4):
            scores = np.array([h0[i] @ p["W_Q1"] @ p["W_K1"].T @ h0[j] for j in range(i + 1)])
            a = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
            h1[i] = h0[i] + sum(a[j] * h0[j] @ p["W_V1"] @ p["W_O1"] for j in range(i + 1))
        h2 = h1 + (silu(h1 @ p["W_gate"]) * (h1 @ p["W_up"])) @ p["W_down"]
        scores = np.array([h2[-1] @ p["W_Q2"] @ p["W_K2"].T @ h2[j] for j in range(4)])
        a = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
        expected.append((h2[-1] + sum(a[j] * h2[j] @ p["W_V2"] @ p["W_O2"] for j in range(4))) @ p["W_U"])
    np.testing.assert_allclose(model.forward(p, tokens), np.array(expected), atol=1e-12)


def induction_circuit(d: int, s: int, alpha: float, beta: float, gamma: float) -> tuple[int, int, dict]:
    """(m, k, params) of an induction circuit in orthogonal subspaces of the residual stream:
    token T, position, previous token T' and output U. Layer 1 attends from position i to
    i - 1 (by positions, sharpness beta) and writes its token into T'; layer 2's query (x_s
    in T) matches keys in T' (sharpness gamma; the first position, with no predecessor, is
    pushed away) and copies their token into U, which W_U reads (scale alpha)."""
    T, pos, prev, out = np.arange(d), d + np.arange(s), d + s + np.arange(d), 2 * d + s + np.arange(d)
    m, k = 3 * d + s, max(s, d)
    p = {name: np.zeros(shape) for name, shape in PositionalTwoLayerTransformer(d=d, s=s, m=m, k=k).shapes.items()}
    p["W_E"][T, T] = 1
    p["W_P"][np.arange(s), pos] = 1
    p["W_Q1"][pos, np.arange(s)] = beta
    p["W_K1"][pos[:-1], np.arange(1, s)] = 1
    p["W_V1"][T, T] = 1
    p["W_O1"][T, prev] = 1
    p["W_Q2"][T, np.arange(d)] = gamma
    p["W_K2"][prev, np.arange(d)] = 1
    p["W_K2"][pos[0], :d] = -1
    p["W_V2"][T, T] = 1
    p["W_O2"][T, out] = 1
    p["W_U"][out, np.arange(d)] = alpha
    return m, k, {name: jnp.asarray(value) for name, value in p.items()}


def best_loss(model, params0, loss, frozen=()):
    """L-BFGS on the exact loss over every parameter not in ``frozen`` (held at zero)."""
    free = {name: value for name, value in params0.items() if name not in frozen}
    flat, unravel = ravel_pytree(free)
    zeros = {name: jnp.zeros_like(params0[name]) for name in frozen}
    value_and_grad = jax.jit(jax.value_and_grad(lambda x: loss({**unravel(x), **zeros})))
    result = scipy.optimize.minimize(lambda x: tuple(np.asarray(v, float) for v in value_and_grad(jnp.asarray(x))),
                                     np.asarray(flat), jac=True, method="L-BFGS-B", options={"maxiter": 2000})
    return result.fun


def test_an_induction_circuit_nearly_reaches_the_bayes_loss_and_one_layer_stays_far_from_it():
    m, k, _ = induction_circuit(TASK.d, TASK.s, 1.0, 1.0, 1.0)
    model = PositionalTwoLayerTransformer(d=TASK.d, s=TASK.s, m=m, k=k)
    circuit = float(population_loss_task(induction_circuit(TASK.d, TASK.s, 3.1, 16.5, 50.0)[2], TASK, model))
    bayes, chance = TASK.bayes_loss, math.log(TASK.d)
    assert bayes < circuit < bayes + 0.15 * (chance - bayes)  # at least 85% of the way from chance to Bayes
    # one layer: the same model with the lower block's write W_V1 W_O1 held at 0 (and no FFN)
    # is a one-layer positional Transformer; from two starts it stays well above the circuit
    loss = make_task_loss(model, TASK)
    one_layer = min(best_loss(model, model.init(0.3, seed), loss, frozen=("W_V1", "W_O1")) for seed in (0, 1))
    assert one_layer > circuit + 0.1


def task_config(overrides=()):
    base = ["task.kind='induction'", "task.d=3", "task.s=5", "model.kind='two_layer'", "model.m=6", "model.k=4",
            "loss.kind='finite'", "init.eps=0.3", "solver.method='Tsit5'", "time.t_end=30.0", "time.n_linear=16", "time.n_log=8", "time.t_log_min=0.5",
            "solver.atol=1e-10"]
    return load_config(None, [*base, *overrides])


@pytest.mark.slow
def test_the_slow_window_and_depth_smoothing_act_on_the_intended_tensors():
    config = task_config(["flow.qk_rho=0.25", "flow.qk_t0=10.0", "flow.qk_tr=5.0"])
    prepared = prepare(config)
    flow, params = prepared.flow, prepared.params0
    gradient = jax.grad(flow.loss)(params)
    theta = flow.flatten(params)
    for t, rate in ((1.0, 0.25), (12.5, 0.625), (20.0, 1.0)):
        field = flow.unravel(flow.vector_field(t, theta))
        for name in params:
            expected = rate if name in ("W_Q2", "W_K2") else 1.0
            np.testing.assert_allclose(-np.asarray(field[name]), expected * np.asarray(gradient[name]), atol=1e-14, err_msg=name)
    a = 0.2
    smoothed = GradientFlow(flow.loss, params, smoothing=DepthSmoothing(a, prepared.model.repeated_blocks))
    field = smoothed.unravel(smoothed.vector_field(0.0, smoothed.flatten(params)))
    for lower, upper in prepared.model.repeated_blocks:
        g1, g2 = np.asarray(gradient[lower]), np.asarray(gradient[upper])
        np.testing.assert_allclose(-np.asarray(field[lower]), (1 - a / 2) * g1 + a / 2 * g2, atol=1e-14)
        np.testing.assert_allclose(-np.asarray(field[upper]), a / 2 * g1 + (1 - a / 2) * g2, atol=1e-14)
    for name in ("W_E", "W_P", "W_U"):  # embeddings and the unembedding are not smoothed
        np.testing.assert_allclose(-np.asarray(field[name]), np.asarray(gradient[name]), atol=1e-14)


@pytest.mark.slow
def test_the_task_runs_through_flowsim_run_with_its_probes(tmp_path, capsys):
    config = task_config()
    result = execute_run(config, tmp_path / "run", progress=False)
    assert result.success, result.message
    loss = result.trajectory.loss
    assert np.all(np.diff(loss) <= 1e-12) and loss[-1] < loss[0] - 0.05
    observables = Observables.load(tmp_path / "run")
    for column in ("attention_entropy_1", "attention_entropy_2", "prev_token_mass", "induction_mass", "basis_angle", "sv_W_P"):
        assert column in observables.columns, column
    assert observables["attention_entropy_2"].shape == (len(observables.t), 3)
    assert str(observables.constants["model_kind"]) == "two_layer"  # the positional model is of the two-layer family
    assert observables["basis_angle"][-1] == pytest.approx(0.0, abs=1e-6)
    summary = summarise(observables, loss_target=float(loss[-1]) + 1e-3)
    assert summary.final_loss == pytest.approx(loss[-1]) and summary.t_loss_target is not None
    doubling = observables["basis_doubling_angle"]
    assert np.isnan(doubling[0]) and np.isnan(doubling[-1]) and np.all(doubling[1:][observables.t[1:] <= observables.t[-1] / 2] >= 0)
    compare_runs([tmp_path / "run"], loss_target=None)  # the probes table and the pathwise factors read it too
    out = capsys.readouterr().out
    assert (tmp_path / "run" / "pathwise.npz").is_file() and "none:" not in out


def test_bad_task_settings_are_named():
    with pytest.raises(ConfigError, match="model.kind = 'two_layer'"):
        prepare(task_config(["model.kind='one_layer'"]))
    with pytest.raises(ConfigError, match="mean_field"):
        prepare(task_config(["loss.kind='mean_field'"]))
    with pytest.raises(ConfigError, match="task.noise"):
        task_config(["task.noise=1.0"])
    with pytest.raises(ValueError, match="over the limit"):
        InductionTask(d=5, s=9)


@pytest.mark.slow
def test_a_sweep_over_seeds_records_the_specialisation_probes(tmp_path):
    from flowsim.runs.sweep import run_sweep

    base = ["task.kind='induction'", "task.d=3", "task.s=4", "model.kind='two_layer'", "model.m=6", "model.k=4",
            "loss.kind='finite'", "init.eps=0.3", "solver.method='Tsit5'", "time.t_end=10.0", "time.n_linear=11",
            "time.n_log=5", "time.t_log_min=0.5"]
    rows = run_sweep(None, {"flow.qk_rho": [1.0, 0.25]}, 2, tmp_path / "sweep", base_overrides=base)
    assert len(rows) == 4 and {row["seed"] for row in rows} == {0, 1}
    task = InductionTask(d=3, s=4, noise=0.1)
    for row in rows:
        assert row["bayes_loss"] == pytest.approx(task.bayes_loss, rel=1e-12)
        assert row["curve"]["loss"][-1] == pytest.approx(row["final_loss"])
        assert len(row["curve"]["t"]) == len(row["curve"]["basis_angle"]) == len(row["curve"]["upper_entropy"])
        assert "premature_index" in row and "t_basis_mature" in row
    # the same seed starts every variant from the same parameters
    starts = {(row["flow.qk_rho"], row["seed"]): row["curve"]["loss"][0] for row in rows}
    assert starts[(1.0, 0)] == starts[(0.25, 0)] != starts[(1.0, 1)]
    assert "premature_index" in (tmp_path / "sweep" / "sweep.csv").read_text().splitlines()[0]
