"""The two-layer hierarchical model: exact losses against enumeration, finite differences
and the one-layer model it contains."""

import jax
import numpy as np
import pytest
from conftest import random_params

import flowsim
from flowsim.model.losses import (
    population_loss_enumerated,
    population_loss_finite,
    population_loss_mean_field,
)
from flowsim.model.models import TwoLayerTransformer


def general_chain(d: int, seed: int) -> flowsim.MarkovChain:
    P = np.random.default_rng(seed).random((d, d)) + 0.2
    return flowsim.MarkovChain(P=P / P.sum(axis=1, keepdims=True))


@pytest.mark.parametrize("ffn", ["none", "mlp", "glu"])
@pytest.mark.slow
def test_finite_s_count_programme_equals_enumeration(ffn):
    chain = general_chain(3, seed=1)
    model = TwoLayerTransformer(d=3, m=4, k=3, ffn=ffn, ffn_width=5)
    params = random_params(model, 0.8, seed=2)
    for s in (1, 3, 6):
        exact = float(population_loss_finite(params, chain, s, model))
        enumerated = float(population_loss_enumerated(params, chain, s, model))
        assert exact == pytest.approx(enumerated, abs=1e-13), (s, exact, enumerated)


@pytest.mark.parametrize("ffn", ["mlp", "glu"])
def test_mean_field_gradient_matches_finite_differences(ffn):
    chain = flowsim.MarkovChain(pi=[0.75, 0.19, 0.05, 0.01], lam=0.5)
    model = TwoLayerTransformer(d=4, m=4, k=3, ffn=ffn, ffn_width=5)
    params = random_params(model, 0.5, seed=3)
    loss = jax.jit(flowsim.make_loss_function(model, chain))
    gradient = jax.jit(jax.grad(flowsim.make_loss_function(model, chain)))(params)
    rng = np.random.default_rng(4)
    h = 1e-5
    for name in model.shapes:
        index = tuple(rng.integers(0, n) for n in model.shapes[name])
        up = {key: np.array(value) for key, value in params.items()}
        down = {key: np.array(value) for key, value in params.items()}
        up[name][index] += h
        down[name][index] -= h
        central = (float(loss(up)) - float(loss(down))) / (2 * h)
        assert float(gradient[name][index]) == pytest.approx(central, abs=1e-9), name


@pytest.mark.parametrize("ffn", ["none", "mlp", "glu"])
def test_mean_field_logits_are_the_type_weight_route_at_pi(ffn):
    """The mean-field path (one residual stream for all queries) equals the general route
    that runs every query type with its own type weights, here all log π."""
    chain = general_chain(4, seed=8)
    model = TwoLayerTransformer(d=4, m=4, k=3, ffn=ffn, ffn_width=5)
    params = random_params(model, 0.9, seed=9)
    pi = jax.numpy.asarray(chain.pi)
    per_query = model.logits_over_types(params, jax.numpy.broadcast_to(jax.numpy.log(pi), (4, 4)), jax.numpy.arange(4))
    np.testing.assert_allclose(model.mean_field_logits(params, pi), per_query, rtol=1e-13, atol=1e-14)


def test_finite_s_approaches_mean_field():
    chain = flowsim.MarkovChain(pi=[0.6, 0.3, 0.1], lam=0.4)
    model = TwoLayerTransformer(d=3, m=4, k=3, ffn="glu", ffn_width=5)
    params = random_params(model, 0.6, seed=5)
    limit = float(population_loss_mean_field(params, chain, model))
    gaps = [abs(float(population_loss_finite(params, chain, s, model)) - limit) for s in (16, 32, 64, 128)]
    scaled = [s * gap for s, gap in zip((16, 32, 64, 128), gaps)]
    assert gaps[-1] < gaps[0] / 4
    assert max(scaled[1:]) / min(scaled[1:]) < 1.5  # |L_s - L_inf| = O(1/s)


@pytest.mark.parametrize("s", [None, 5])
def test_reduces_to_the_one_layer_model_without_upper_attention_and_ffn(s):
    chain = general_chain(4, seed=6)
    two = TwoLayerTransformer(d=4, m=5, k=3, ffn="none")
    params = random_params(two, 0.7, seed=7)
    params["W_O2"] = np.zeros_like(params["W_O2"])  # the upper block writes nothing
    one = flowsim.OneLayerTransformer(d=4, m=5, k=3, value_matrix=True, residual=True)
    # f = A (W0 W_V W1) + (W0 W1)[query] with W0 = W_E, W_V = W_V1 W_O1, W1 = W_U
    one_params = {"W0": params["W_E"], "W_Q": params["W_Q1"], "W_K": params["W_K1"],
                  "W_V": params["W_V1"] @ params["W_O1"], "W1": params["W_U"]}
    if s is None:
        expected = population_loss_mean_field(one_params, chain, one)
        got = population_loss_mean_field(params, chain, two)
    else:
        expected = population_loss_finite(one_params, chain, s, one)
        got = population_loss_finite(params, chain, s, two)
    assert float(got) == pytest.approx(float(expected), abs=1e-14)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="model.ffn"):
        TwoLayerTransformer(d=3, ffn="swish")
    with pytest.raises(ValueError, match="model.ffn_width"):
        TwoLayerTransformer(d=3, ffn_width=0)


@pytest.mark.slow
def test_two_layer_runs_through_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from flowsim.cli import app
    from flowsim.observe.observables import Observables

    runner = CliRunner()
    run_dir = tmp_path / "two"
    settings = ["model.kind='two_layer'", "model.ffn='mlp'", "model.m=4", "model.k=3", "model.ffn_width=5",
                "flow.qk_rho=0.25", "flow.qk_t0=20.0", "flow.qk_tr=5.0", "time.t_end=40.0", "time.n_linear=21", "time.n_log=20"]
    result = runner.invoke(app, ["run", "--quiet", "--out", str(run_dir), *[a for s in settings for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    observables = Observables.load(run_dir)
    assert str(observables.constants["model_kind"]) == "two_layer"  # the run says what it holds
    assert (run_dir / "summary.png").stat().st_size > 0
    assert np.all(np.diff(observables["loss"]) <= 1e-12)  # a descent flow
    entropy = observables["attention_entropy_2"]
    assert entropy.shape[1] == 4 and np.all(entropy >= 0) and np.all(entropy <= np.log(4) + 1e-12)
    assert observables["basis_angle"][-1] == pytest.approx(0.0, abs=1e-6)  # h2 against itself at the end
    # the slow window slows the upper query and key by default: at t < t0 their rate is rho
    from flowsim.config import load_config
    from flowsim.assemble import prepare

    prepared = prepare(load_config(run_dir / "config.toml"))
    rates = dict(zip(prepared.flow.groups, np.asarray(prepared.flow.rates.rates(1.0, prepared.flow.groups))))
    assert rates["W_Q2"] == rates["W_K2"] == 0.25 and rates["W_Q1"] == 1.0
    stages = runner.invoke(app, ["stages", str(run_dir)])
    assert stages.exit_code == 2 and "one-layer" in stages.output
    table = runner.invoke(app, ["compare-runs", str(run_dir), "--loss-target", "10"])
    assert table.exit_code == 0, table.output
    row = table.output.strip().splitlines()[1].split()
    assert row[0] == "two" and row[1] == "mlp" and float(row[2]) == 0.25
    assert float(row[6]) == 0.0  # a loss target above the initial loss is met at t = 0
    factors = table.output.strip().splitlines()[4].split()  # after the probes table and a blank line
    assert factors[0] == "two" and float(factors[1]) == 0.25  # the step-size factor at t = 0 is rho
    assert (run_dir / "pathwise.npz").is_file()
