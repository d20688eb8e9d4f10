import numpy as np
import pytest
from conftest import PAPER_PI

import flowsim
from flowsim import MarkovChain, OneLayerTransformer
from flowsim.model import flow as flow_module
from flowsim.model.flow import GradientFlow, RateSchedule, SlowWindow
from flowsim.solve.solvers import solve_flow


@pytest.fixture(scope="module")
def default_run(default_flow):
    """LSODA on the default flow up to t = 6000 (the run of `flowsim run`)."""
    flow, params0 = default_flow
    return solve_flow(flow, params0, np.linspace(0.0, 6000.0, 601), method="LSODA", rtol=1e-8, atol=1e-12)


def test_default_run_finishes_and_loss_never_increases(default_run):
    assert default_run.success, default_run.message
    loss = default_run.trajectory.loss
    assert loss[0] == pytest.approx(np.log(4), abs=1e-5)  # near θ = 0 the prediction is uniform
    assert np.all(np.diff(loss) <= 1e-12)
    assert loss[-1] < 0.6


def test_qk_gram_difference_is_conserved(default_run):
    """Q and K enter only through W_Q W_K^T, so W_Q^T W_Q - W_K^T W_K is a constant of motion."""
    params = default_run.trajectory.params
    gram = np.einsum("tmk,tml->tkl", params["W_Q"], params["W_Q"]) - np.einsum("tmk,tml->tkl", params["W_K"], params["W_K"])
    scale = np.max(np.abs(params["W_Q"])) ** 2
    assert scale > 0.1  # attention did grow, so the check is not trivial
    assert np.max(np.abs(gram - gram[0])) < 1e-6 * scale


def test_embedding_balance_is_conserved(default_run):
    """L is invariant under W0 → W0 G, W1 → G⁻¹W1, W_Q → G⁻¹W_Q, W_K → G⁻¹W_K (Φ and M do not move), so with one rate
    for every group W0^T W0 - W1 W1^T - W_Q W_Q^T - W_K W_K^T (m × m) is a constant of motion: a check on W0's and
    W1's gradients that the W_Q/W_K law cannot see."""
    params = default_run.trajectory.params
    embedding = np.einsum("tda,tdb->tab", params["W0"], params["W0"])  # m × m Gram matrices along the run
    output = np.einsum("tad,tbd->tab", params["W1"], params["W1"])
    attention = sum(np.einsum("tak,tbk->tab", params[name], params[name]) for name in ("W_Q", "W_K"))
    scale = np.max(np.abs(embedding))
    assert scale > 1.0  # W0 condensed, so its Gram moved by far more than the tolerance below
    balance = embedding - output - attention
    assert np.max(np.abs(balance - balance[0])) < 1e-6 * scale
    without_attention = embedding - output  # the attention's part is needed: alone, this drifts
    assert np.max(np.abs(without_attention - without_attention[0])) > 1e-2 * scale


def test_rates_scale_each_group_and_slow_window_ramps(default_flow, paper_chain, paper_model):
    flow, params0 = default_flow
    theta = flow.flatten({name: 3e2 * value for name, value in params0.items()})  # off the origin
    window = SlowWindow(rho=0.25, t0=10.0, tr=4.0)
    slowed = GradientFlow(flow.loss, params0, RateSchedule(constant={"W1": 2.0}, window=window))
    base = flow.unravel(flow.vector_field(0.0, theta))
    for t, qk_factor in [(5.0, 0.25), (12.0, 0.25 + 0.75 * 0.5), (20.0, 1.0)]:
        field = slowed.unravel(slowed.vector_field(t, theta))
        np.testing.assert_allclose(field["W_Q"], qk_factor * base["W_Q"], rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(field["W_K"], qk_factor * base["W_K"], rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(field["W1"], 2.0 * base["W1"], rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(field["W0"], base["W0"], rtol=1e-12, atol=1e-300)
    with pytest.raises(ValueError, match="unknown parameter groups"):
        GradientFlow(flow.loss, params0, RateSchedule(constant={"W_V": 2.0}))


def test_jacobian_is_the_derivative_of_the_vector_field(default_flow):
    flow, params0 = default_flow
    rng = np.random.default_rng(0)
    theta = 0.3 * rng.standard_normal(flow.size)
    direction = rng.standard_normal(flow.size)
    h = 1e-6
    finite_difference = (flow.vector_field(1.0, theta + h * direction) - flow.vector_field(1.0, theta - h * direction)) / (2 * h)
    np.testing.assert_allclose(flow.jacobian(1.0, theta) @ direction, finite_difference, atol=1e-7)


def test_early_growth_rate_of_M_is_twice_mu1():
    """Near the origin ‖M‖ grows like exp(2 μ1 t), μ1 = ‖π‖ ‖π - u‖, for any λ."""
    pi = np.array(PAPER_PI)
    mu1 = np.linalg.norm(pi) * np.linalg.norm(pi - 1 / len(pi))
    model = OneLayerTransformer(d=4)
    params0 = model.init(1e-4, 1)
    times = np.linspace(0.0, 14.0, 141)
    for lam in (0.2, 0.8):
        flow = GradientFlow(flowsim.make_loss_function(model, MarkovChain(pi=pi, lam=lam)), params0)
        params = solve_flow(flow, params0, times, rtol=1e-10, atol=1e-16).trajectory.params
        log_norm_M = np.log(np.linalg.norm(np.einsum("tdm,tme->tde", params["W0"], params["W1"]), axis=(1, 2)))
        window = times >= 8.0
        slope = np.polyfit(times[window], log_norm_M[window], 1)[0]
        assert abs(slope / (2 * mu1) - 1) < 0.02, (lam, slope, 2 * mu1)


def test_flows_of_one_structure_share_compiled_functions_and_keep_their_own_data():
    model = OneLayerTransformer(d=4, m=3, k=2)
    params = model.init(0.3, 0)
    flows = [GradientFlow(flowsim.make_loss_function(model, MarkovChain(pi=PAPER_PI, lam=lam)), params) for lam in (0.2, 0.8)]
    other = GradientFlow(flowsim.make_loss_function(OneLayerTransformer(d=4, m=4, k=2), MarkovChain(pi=PAPER_PI, lam=0.2)),
                         OneLayerTransformer(d=4, m=4, k=2).init(0.3, 0))
    assert flows[0].structure_key == flows[1].structure_key != other.structure_key
    theta = flows[0].flatten(params)[None]
    compiled = flow_module._loss_batch_jit._cache_size
    before = compiled()
    for flow in flows:  # one compiled function, evaluating each flow's own chain
        assert flow.loss_along(theta)[0] == pytest.approx(float(flow.loss(params)), rel=1e-13)
    assert compiled() == before + 1
    other.loss_along(other.flatten(other.unravel(np.zeros(other.size)))[None])
    assert compiled() == before + 2
    assert flows[0].loss_along(theta)[0] != pytest.approx(flows[1].loss_along(theta)[0], rel=1e-6)
    split = flows[0].unflatten_batch(np.stack([theta[0], 2 * theta[0]]))
    for name in params:
        np.testing.assert_array_equal(split[name][1], 2 * np.asarray(params[name]))
