"""Pathwise growth factors of the upper attention logits: the symbolic decomposition
against autodiff and finite differences in time, the bound on every shipped run, the
slow window's step-size factor, and the FFN write orders in the weight scale."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy as sp

from flowsim.config import load_config, shipped_config
from flowsim.assemble import sequence_law, prepare
from flowsim.solve.solvers import solve_flow
from theory.pathwise import ffn_write_expansion, logit_paths, pathwise_along, positional_pathwise_along

SHIPPED = shipped_config("two_layer")
SHIPPED_NAMES = ("baseline", "slowed", "glu", "glu_slowed", "smoothing_0.1", "smoothing_0.2")
HORIZON = ["time.t_end=40.0", "time.n_linear=41", "time.n_log=20"]  # the window, the ramp and the entropy fall


def run_config(name: str, overrides=HORIZON, times=None):
    config = load_config(SHIPPED / f"{name}.toml", overrides)
    prepared = prepare(config)
    result = solve_flow(prepared.flow, prepared.params0, prepared.times if times is None else times,
                        method="LSODA", rtol=config.solver.rtol, atol=config.solver.atol)
    assert result.success, result.message
    return config, prepared, result.trajectory


@pytest.fixture(scope="module")
def shipped_runs():
    runs = {}
    for name in SHIPPED_NAMES:
        config, prepared, trajectory = run_config(name)
        runs[name] = (config, prepared, trajectory, pathwise_along(trajectory, prepared.model, prepared.chain, prepared.flow))
    return runs


def test_every_shipped_config_is_tested():
    assert sorted(path.stem for path in SHIPPED.glob("*.toml")) == sorted(SHIPPED_NAMES)


def test_symbolic_chain_rule_matches_autodiff():
    d, m, k = 3, 4, 2
    paths = logit_paths(d, m, k)
    s = paths.symbols
    rng = np.random.default_rng(0)
    H, Q, K, G = rng.normal(size=(d, m)), rng.normal(size=(m, k)), rng.normal(size=(m, k)), rng.normal(size=(d, d))
    linearised = lambda Q, K: jnp.sum(G * (H @ Q @ K.T @ H.T))  # noqa: E731  tr(G^T Φ2)
    grad_Q, grad_K = jax.grad(linearised, argnums=(0, 1))(Q, K)
    values = {s.H: H, s.Q: Q, s.K: K, s.G: G}
    for derived, expected in ((paths.grad_Q, grad_Q), (paths.grad_K, grad_K)):
        numeric = sp.lambdify(list(values), derived, modules="numpy")(*values.values())
        np.testing.assert_allclose(numeric, expected, rtol=1e-12)
    # the two paths are the product rule: direct carries dQ, dK and drift carries dh only
    assert paths.direct.has(s.dQ) and paths.direct.has(s.dK) and not paths.direct.has(s.dh_i)
    assert paths.drift.has(s.dh_i) and paths.drift.has(s.dh_j) and not paths.drift.has(s.dQ)


@pytest.mark.slow
def test_bound_holds_at_every_saved_time_of_every_shipped_run(shipped_runs):
    for name, (config, _, trajectory, factors) in shipped_runs.items():
        assert factors.t.shape == trajectory.t.shape
        assert np.all(factors.bound > 0), name
        if config.flow.smoothing_a == 0:
            # the bound (from G = ∂L/∂Φ2 and norms) against the direct path computed from the
            # flow's own Q/K velocity, a route that does not go through G
            assert np.all(factors.bound >= np.abs(factors.direct)), name
        # the symbolic own path (through G = ∂L/∂Φ2) is the whole direct path without smoothing
        scale = np.abs(factors.direct).max()
        if config.flow.smoothing_a == 0:
            np.testing.assert_allclose(factors.own_direct, factors.direct, atol=1e-10 * scale, err_msg=name)
        else:  # smoothing carries the lower block's Q/K gradient into the upper logits
            assert np.abs(factors.coupled_direct).max() > 1e-3 * scale, name
        # the sharper bound is valid and never looser; the drift bound and their sum bound the total
        slack = 1e-12 * factors.bound.max()
        assert np.all(np.abs(factors.own_direct) <= factors.tight_bound + slack), name
        assert np.all(factors.tight_bound <= factors.bound + slack), name
        assert np.all(np.abs(factors.drift) <= factors.drift_bound + slack), name
        assert np.all(np.abs(factors.total) <= factors.total_bound + slack), name


@pytest.mark.slow
def test_the_factor_bound_is_exceeded_by_the_total_only_where_the_basis_drift_carries_the_motion(shipped_runs):
    """The factor product bounds the direct path, not ds/dt: on every shipped run the total exceeds it at some
    pair early on, and at every such point the drift path is the larger one and alone exceeds the bound."""
    for name, (_, _, _, factors) in shipped_runs.items():
        exceeded = np.abs(factors.total) > factors.bound
        assert exceeded.any(), name
        assert np.all(np.abs(factors.drift[exceeded]) > np.abs(factors.direct[exceeded])), name
        assert np.mean(np.abs(factors.drift[exceeded]) > factors.bound[exceeded]) > 0.95, name
        summary = factors.summary()
        assert summary["tight_looseness"] < summary["looseness"] / 2, (name, summary)


@pytest.mark.slow
def test_the_papers_comparative_claims_as_inequalities_between_runs(shipped_runs):
    """Slowing the upper Q/K by ρ shrinks the direct path over the window about ρ-fold while the drift path, which
    carries most of the logit motion, is unchanged; the gated FFN writes less into the residual stream and its
    residual-energy factor is smaller at every saved time after the start."""
    for plain, slowed in (("baseline", "slowed"), ("glu", "glu_slowed")):
        t0 = shipped_runs[slowed][0].flow.qk_t0
        rho = shipped_runs[slowed][0].flow.qk_rho
        base, slow = shipped_runs[plain][3], shipped_runs[slowed][3]
        window = base.t <= t0

        def motion(array):
            return np.trapezoid(np.abs(array).sum(axis=(1, 2))[window], base.t[window])

        assert rho <= motion(slow.direct) / motion(base.direct) < 1.3 * rho, (plain, slowed)
        assert motion(slow.drift) / motion(base.drift) == pytest.approx(1.0, abs=0.01)
        assert motion(base.drift) > motion(base.direct)
    for mlp, glu in (("baseline", "glu"), ("slowed", "glu_slowed")):
        plain, gated = shipped_runs[mlp][3], shipped_runs[glu][3]
        assert np.all(gated.ffn_write < plain.ffn_write), (mlp, glu)
        assert np.all(gated.residual_energy[1:] < plain.residual_energy[1:]), (mlp, glu)
        assert gated.total_bound.max() < plain.total_bound.max()


@pytest.mark.slow
def test_slowing_scales_the_step_factor_and_delays_the_upper_entropy_fall(shipped_runs):
    for plain, slowed in (("baseline", "slowed"), ("glu", "glu_slowed")):
        config = shipped_runs[slowed][0]
        rho, t0, ramp_end = config.flow.qk_rho, config.flow.qk_t0, config.flow.qk_t0 + config.flow.qk_tr
        base, slow = shipped_runs[plain][3], shipped_runs[slowed][3]
        inside, after = base.t < t0, base.t >= ramp_end
        np.testing.assert_allclose(slow.step[inside] / base.step[inside], rho, rtol=1e-12)
        np.testing.assert_allclose(slow.step[after], base.step[after], rtol=1e-12)
    # the upper layer's attention entropy (π-weighted over queries) falls later when slowed
    entropies = {}
    for name in ("baseline", "slowed"):
        _, prepared, trajectory, _ = shipped_runs[name]
        params = {key: jnp.asarray(value) for key, value in trajectory.params.items()}
        _, A2, _ = jax.vmap(prepared.model.attention_maps, in_axes=(0, None))(params, jnp.asarray(prepared.chain.pi))
        A2 = np.asarray(A2)
        entropies[name] = -np.sum(A2 * np.log(A2), axis=2) @ prepared.chain.pi
    t = shipped_runs["baseline"][2].t
    peak = entropies["baseline"].max()
    level = peak - 0.5 * (peak - entropies["baseline"][-1])  # half-way down the baseline's fall

    def fall_time(entropy):
        after_peak = np.arange(len(t)) >= np.argmax(entropy)
        return t[np.flatnonzero(after_peak & (entropy <= level))[0]]

    assert fall_time(entropies["slowed"]) > fall_time(entropies["baseline"])


@pytest.mark.slow
def test_paths_add_up_to_the_finite_difference_rate_of_the_logits():
    dt = 0.01
    times = np.concatenate([[0.0], 10.0 + dt * np.arange(11)])
    for name in ("baseline", "smoothing_0.2"):
        _, prepared, trajectory = run_config(name, ["solver.rtol=1e-11", "solver.atol=1e-13"], times)
        factors = pathwise_along(trajectory, prepared.model, prepared.chain, prepared.flow)
        params = {key: jnp.asarray(value) for key, value in trajectory.params.items()}
        _, _, h2 = jax.vmap(prepared.model.attention_maps, in_axes=(0, None))(params, jnp.asarray(prepared.chain.pi))
        logits = np.asarray(jnp.einsum("tim,tmk,tnk,tjn->tij", h2, params["W_Q2"], params["W_K2"], h2))
        central = (logits[3:] - logits[1:-2]) / (2 * dt)  # at times[2:-1]
        paths = (factors.direct + factors.drift)[2:-1]
        np.testing.assert_allclose(central, paths, atol=1e-6 * np.abs(paths).max(), err_msg=name)
        # the direct path alone: the logits with the basis h2 frozen at each time, Q and K moving
        frozen = np.asarray(jnp.einsum("tim,tmk,tnk,tjn->tij", h2[2:-1], params["W_Q2"][3:] - params["W_Q2"][1:-2],
                                       params["W_K2"][2:-1], h2[2:-1])
                            + jnp.einsum("tim,tmk,tnk,tjn->tij", h2[2:-1], params["W_Q2"][2:-1],
                                         params["W_K2"][3:] - params["W_K2"][1:-2], h2[2:-1])) / (2 * dt)
        np.testing.assert_allclose(frozen, factors.direct[2:-1], atol=1e-6 * np.abs(factors.direct).max(), err_msg=name)
        if name == "baseline":  # without smoothing the bound covers the whole direct path
            assert np.all(factors.bound[2:-1] >= np.abs(frozen)), name
        assert np.abs(factors.drift).max() > 1e-3 * np.abs(paths).max()  # both paths are active


@pytest.mark.slow
def test_ffn_write_orders_match_the_measured_slope_in_the_weight_scale():
    orders = {kind: ffn_write_expansion(kind).order for kind in ("mlp", "glu")}
    assert orders == {"mlp": 3, "glu": 5}  # the gated write is of higher order in ε
    eps_values = np.array([1e-2, 1e-3, 1e-4])
    times = np.array([0.0, 0.5, 1.0])  # early in training
    writes = {}
    for kind in ("mlp", "glu"):
        overrides = ["model.kind='two_layer'", f"model.ffn='{kind}'", "model.m=4", "model.k=3", "model.ffn_width=5"]
        prepared = prepare(load_config(None, overrides))
        rows = []
        for eps in eps_values:
            params0 = prepared.model.init(float(eps), 0)
            trajectory = solve_flow(prepared.flow, params0, times, method="LSODA", rtol=1e-9, atol=1e-4 * eps**2).trajectory
            rows.append(pathwise_along(trajectory, prepared.model, prepared.chain, prepared.flow).ffn_write)
        writes[kind] = np.array(rows)  # (ε, time)
    for kind, order in orders.items():
        slopes = np.polyfit(np.log(eps_values), np.log(writes[kind]), 1)[0]  # one slope per time
        np.testing.assert_allclose(slopes, order, atol=0.05, err_msg=kind)
    assert np.all(writes["glu"] < writes["mlp"])


# ---------------------------------------------------------------------------------
# The two-layer model over positions on the induction task

INDUCTION = shipped_config("induction")
INDUCTION_DT = 0.001  # central differences in time: O(dt²) = 1e-6 relative


def induction_run(name: str, times: np.ndarray):
    config = load_config(INDUCTION / f"{name}.toml", ["solver.rtol=1e-11", "solver.atol=1e-13"])
    prepared = prepare(config)
    result = solve_flow(prepared.flow, prepared.params0, times, method="Tsit5", rtol=1e-11, atol=1e-13)
    assert result.success, result.message
    return config, prepared, result.trajectory


@pytest.fixture(scope="module")
def induction_factors():
    times = np.concatenate([[0.0, 2.0], 13.0 + INDUCTION_DT * np.arange(5)])  # inside the slow window, and on its ramp
    runs = {}
    for name in ("baseline", "slowed", "smoothing_0.2"):
        config, prepared, trajectory = induction_run(name, times)
        runs[name] = (config, prepared, trajectory,
                      positional_pathwise_along(trajectory, prepared.model, sequence_law(prepared.chain), prepared.flow))
    return runs


@pytest.mark.slow
def test_positional_paths_add_up_to_the_finite_difference_rate_of_the_logits(induction_factors):
    for name, (_, prepared, trajectory, factors) in induction_factors.items():
        law, dt = sequence_law(prepared.chain), INDUCTION_DT
        params = {key: jnp.asarray(value) for key, value in trajectory.params.items()}
        h2 = jax.vmap(lambda p: prepared.model.streams(p, jnp.asarray(law.contexts))[2])(params)
        logits = np.asarray(jnp.einsum("tnk,tkl,tml,tnjm->tnj", h2[:, :, -1, :], params["W_Q2"], params["W_K2"], h2))
        central = (logits[4:] - logits[2:-2]) / (2 * dt)  # at times[3:-1]
        paths = (factors.direct + factors.drift)[3:-1]
        np.testing.assert_allclose(central, paths, atol=1e-6 * np.abs(paths).max(), err_msg=name)
        np.testing.assert_allclose(factors.total, factors.direct + factors.drift, atol=1e-12 * np.abs(factors.total).max())
        assert np.abs(factors.drift).max() > 1e-3 * np.abs(paths).max(), name  # both paths are active


@pytest.mark.slow
def test_positional_own_path_from_the_logit_gradient_is_the_flows_direct_path(induction_factors):
    """own_nj is built from G = ∂L/∂Φ2 (a shift of the upper logits) and the formula; the direct path
    from the flow's own Q/K velocity. Without smoothing they are one path; smoothing adds a coupled part."""
    for name in ("baseline", "slowed"):
        factors = induction_factors[name][3]
        np.testing.assert_allclose(factors.own_direct, factors.direct, atol=1e-9 * np.abs(factors.direct).max(), err_msg=name)
    smoothed = induction_factors["smoothing_0.2"][3]
    assert np.abs(smoothed.coupled_direct).max() > 1e-3 * np.abs(smoothed.direct).max()


@pytest.mark.slow
def test_positional_bounds_hold_and_order(induction_factors):
    for name, (config, _, trajectory, factors) in induction_factors.items():
        own, total = np.abs(factors.own_direct), np.abs(factors.total)
        assert np.all(own <= factors.tight_bound * (1 + 1e-12)), name
        assert np.all(factors.tight_bound <= factors.bound * (1 + 1e-12)), name
        assert np.all(np.abs(factors.drift) <= factors.drift_bound * (1 + 1e-12)), name
        assert np.all(total <= factors.total_bound * (1 + 1e-12)), name
        assert factors.total.shape == (len(trajectory.t), *sequence_law(induction_factors[name][1].chain).contexts.shape)
    base, slow = induction_factors["baseline"][3], induction_factors["slowed"][3]
    rho = induction_factors["slowed"][0].flow.qk_rho
    inside = base.t < induction_factors["slowed"][0].flow.qk_t0
    np.testing.assert_allclose(slow.step[inside] / base.step[inside], rho, rtol=1e-12)
    summary = base.summary()
    assert 0 < summary["direct_share"] < 1 and summary["tight_looseness"] <= summary["looseness"]
