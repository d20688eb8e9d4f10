"""JaxRadau (flowsim.solve.stiff): against a tight LSODA reference on both models, on a stiff
variant and with a complex eigensystem; batched runs against the same runs one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate._ivp.radau as scipy_radau
from scipy.linalg import lu_factor, lu_solve

from flowsim.solve import stiff
from flowsim.config import load_config
from flowsim.assemble import prepare
from flowsim.solve.solvers import solve_flow, solve_flow_batch

# One save grid size for every test here: the compiled integrator is shared.
SAVE_GRID = ["time.n_linear=41", "time.n_log=20", "time.t_log_min=0.5"]
CONFIGS = "configs/two_layer"


def _reference_error(prepared, rtol=None, atol=1e-12):
    """JaxRadau at (rtol, atol) against LSODA at rtol 1e-12: largest relative loss and parameter
    errors. ``rtol=None`` is JaxRadau's default tolerance."""
    reference = solve_flow(prepared.flow, prepared.params0, prepared.times, method="LSODA", rtol=1e-12, atol=atol * 1e-3)
    result = solve_flow(prepared.flow, prepared.params0, prepared.times, method="JaxRadau", rtol=rtol, atol=atol)
    assert reference.success and result.success, (reference.message, result.message)
    np.testing.assert_array_equal(result.trajectory.t, prepared.times)
    loss_error = np.max(np.abs(result.trajectory.loss / reference.trajectory.loss - 1))
    theta = np.stack([prepared.flow.flatten(result.trajectory.at(i)) for i in range(len(prepared.times))])
    theta_ref = np.stack([prepared.flow.flatten(reference.trajectory.at(i)) for i in range(len(prepared.times))])
    param_error = np.max(np.abs(theta - theta_ref)) / np.max(np.abs(theta_ref))
    return loss_error, param_error, result, reference


@pytest.mark.parametrize("overrides, rtol", [
    (["time.t_end=400"], None),  # the default: condensation, focus of q0, the next direction opening
    # the stiff variant: its start sits 1e-6 from the saddle, which takes rtol 1e-8 (stated in the README)
    (["time.t_end=400", "init.eps=1e-6", "chain.lam=0.9", "solver.atol=1e-18"], 1e-8),
])
def test_one_layer_matches_tight_reference(overrides, rtol):
    prepared = prepare(load_config(None, [*SAVE_GRID, *overrides]))
    loss_error, param_error, result, reference = _reference_error(prepared, rtol, atol=load_config(None, overrides).solver.atol)
    assert loss_error < 1e-6 and param_error < 1e-5, (loss_error, param_error)
    # the loss moved: agreement is not agreement on a plateau
    assert reference.trajectory.loss[-1] < 0.9 * reference.trajectory.loss[0]
    assert result.stats.njev >= 1 and result.stats.n_steps > 10


# the complex route's parts are checked alone below; the whole of it at tight tolerance is among the slow checks
@pytest.mark.slow
@pytest.mark.parametrize("config", ["baseline.toml", "smoothing_0.2.toml"])
def test_two_layer_matches_tight_reference(config):
    """baseline: J = -H, a real eigensystem; depth smoothing makes J non-symmetric (complex route)."""
    prepared = prepare(load_config(f"{CONFIGS}/{config}", [*SAVE_GRID, "time.t_end=12"]))  # through the Q/K ramp
    assert prepared.flow.eigensystem_is_real == (config == "baseline.toml")
    loss_error, param_error, _, reference = _reference_error(prepared)
    assert loss_error < 1e-6 and param_error < 1e-5, (loss_error, param_error)
    assert reference.trajectory.loss[-1] < reference.trajectory.loss[0] - 1e-3


@pytest.mark.slow
def test_batch_equals_runs_one_by_one():
    prepared = [prepare(load_config(None, [*SAVE_GRID, "time.t_end=200", f"chain.lam={lam}", f"init.seed={seed}"]))
                for lam, seed in [(0.3, 0), (0.7, 1), (0.5, 2)]]
    batch = solve_flow_batch([p.flow for p in prepared], [p.params0 for p in prepared], prepared[0].times)
    losses = [result.trajectory.loss for result in batch]
    assert np.ptp([loss[-1] for loss in losses]) > 1e-2  # the members really differ
    for p, batched in zip(prepared, batch):
        alone = solve_flow(p.flow, p.params0, p.times, method="JaxRadau")
        assert batched.success and alone.success
        assert (batched.stats.n_steps, batched.stats.njev) == (alone.stats.n_steps, alone.stats.njev)
        np.testing.assert_allclose(batched.trajectory.loss, alone.trajectory.loss, rtol=1e-12)
        for name in p.params0:
            np.testing.assert_allclose(batched.trajectory.params[name], alone.trajectory.params[name], rtol=0, atol=1e-10)


def test_batch_rejects_mixed_structures():
    one = prepare(load_config(None, SAVE_GRID))
    two = prepare(load_config(None, [*SAVE_GRID, "model.m=4"]))
    with pytest.raises(ValueError, match="share one structure"):
        solve_flow_batch([one.flow, two.flow], [one.params0, two.params0], one.times)


def test_dense_output_reproduces_the_step_end():
    """The collocation polynomial at x = 1 is y_old + Z[2], the step's end: P @ [1, 1, 1] = e_3."""
    np.testing.assert_allclose(stiff.P @ np.ones(3), [0.0, 0.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(stiff.T @ stiff.TI, np.eye(3), atol=1e-12)


@pytest.mark.slow
def test_compilation_cache_variable_keeps_compiled_code_on_disk(tmp_path):
    """FLOWSIM_COMPILATION_CACHE=DIR: the integrator compiled in one process is written under DIR."""
    import os
    import subprocess
    import sys

    script = ("import numpy as np; from flowsim.config import load_config; from flowsim.assemble import prepare; "
              "from flowsim.solve.solvers import solve_flow; p = prepare(load_config(None, ['time.t_end=5'])); "
              "print(solve_flow(p.flow, p.params0, p.times, method='JaxRadau').status_name)")
    cache = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "FLOWSIM_COMPILATION_CACHE": str(cache)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "finished", run.stderr[-2000:]
    assert cache.is_dir() and sum(1 for path in cache.rglob("*") if path.is_file()) >= 2


@pytest.mark.parametrize("setting, expected", [(None, "{xdg}/flowsim/xla"), ("off", "None"), ("{tmp}/mine", "{tmp}/mine")])
def test_compilation_cache_location(tmp_path, setting, expected):
    """By default compiled code goes under the user's cache directory; "off" turns the cache off."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "FLOWSIM_COMPILATION_CACHE"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if setting is not None:
        env["FLOWSIM_COMPILATION_CACHE"] = setting.format(tmp=tmp_path)
    script = "import flowsim, jax; print(jax.config.jax_compilation_cache_dir)"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == expected.format(xdg=tmp_path / "xdg", tmp=tmp_path)


def test_compiler_options_reach_xla_and_unknown_ones_fall_back(monkeypatch):
    """A small flow's loop compiles with ``stiff.COMPILER_OPTIONS`` (its small products as XLA loops, not
    library calls), a flow above ``LIBRARY_CALLS_ABOVE_SIZE`` with XLA's defaults; an XLA that does not know an
    option compiles without it, other errors still raise."""
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b).lower(jnp.ones((192, 3)), jnp.ones((3, 3)))
    small, large = stiff.LIBRARY_CALLS_ABOVE_SIZE, stiff.LIBRARY_CALLS_ABOVE_SIZE + 1
    if "ynn_fusion" not in lowered.compile().as_text():
        pytest.skip("this XLA makes no YNNPACK library calls")
    assert "ynn_fusion" not in stiff.compile_loop(lowered, small).as_text()
    assert "ynn_fusion" in stiff.compile_loop(lowered, large).as_text()
    monkeypatch.setattr(stiff, "COMPILER_OPTIONS", {"xla_flowsim_no_such_option": ""})
    assert "ynn_fusion" in stiff.compile_loop(lowered, small).as_text()
    monkeypatch.setattr(stiff, "COMPILER_OPTIONS", {"xla_cpu_experimental_ynn_fusion_type": 3.5})
    with pytest.raises(Exception):
        stiff.compile_loop(lowered, small)
    stiff.compile_loop(lowered, large)  # the options are not read above the threshold


# ---------------------------------------------------------------------------------
# The parts of the method, each against an independent route (dense linear algebra,
# scipy's Radau, a polynomial the collocation must reproduce exactly)


N = 5


def _jacobian_and_eigensystem(seed, symmetric):
    """A stable J (its eigensystem real for a symmetrisable J, complex otherwise), batched as B = 1."""
    rng = np.random.default_rng(seed)
    if symmetric:  # J = -D^½ K D^-½ with K symmetric positive definite: a real spectrum
        root = np.sqrt(rng.uniform(0.5, 2.0, N))
        K = rng.standard_normal((N, N))
        K = K @ K.T + np.eye(N)
        curvature, basis = np.linalg.eigh(K)
        J = -(root[:, None] * K / root[None, :])
        eigen = stiff.Eigensystem(root[:, None] * basis, basis.T / root[None, :], -curvature, np.zeros((N, 0)))
    else:
        J = rng.standard_normal((N, N)) - 3 * np.eye(N)
        values, vectors = np.linalg.eig(J)
        eigen = stiff.Eigensystem(vectors, np.linalg.inv(vectors), values, np.zeros((N, 0), complex))
    return J, stiff.Eigensystem(*(jnp.asarray(a)[None] for a in eigen))


def _problem(J):
    """y' = J y - y³/10, a mildly nonlinear flow around J."""
    A = jnp.asarray(J)
    return stiff.RadauProblem(lambda t, y, loss: A @ y - 0.1 * y**3, None, ())


@pytest.mark.parametrize("symmetric", [True, False], ids=["real_eigensystem", "complex_eigensystem"])
def test_newton_systems_equal_dense_solves(symmetric):
    J, eigen = _jacobian_and_eigensystem(1, symmetric)
    rhs = np.random.default_rng(2).standard_normal((1, 3, N))
    h = np.array([0.3])
    m_real, m_re, m_im = stiff.MU_REAL / h, stiff.MU_COMPLEX.real / h, stiff.MU_COMPLEX.imag / h
    solved = np.asarray(stiff.solve_newton_systems(eigen, jnp.asarray(rhs), m_real, m_re, m_im))[0]
    x = np.linalg.solve(m_real[0] * np.eye(N) - J, rhs[0, 0])
    z = np.linalg.solve((m_re[0] + 1j * m_im[0]) * np.eye(N) - J, rhs[0, 1] + 1j * rhs[0, 2])
    np.testing.assert_allclose(solved, np.stack([x, z.real, z.imag]), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("symmetric", [True, False], ids=["real_eigensystem", "complex_eigensystem"])
def test_newton_solve_equals_scipys_collocation_solve(symmetric):
    J, eigen = _jacobian_and_eigensystem(3, symmetric)
    problem = _problem(J)
    y, h, rtol, atol = np.random.default_rng(4).standard_normal(N), 0.05, 1e-8, 1e-10
    scale = atol + np.abs(y) * rtol
    tol = max(10 * np.finfo(float).eps / rtol, min(0.03, rtol**0.5))
    fun = lambda t, x: np.asarray(problem.vector_field(t, jnp.asarray(x), None))  # noqa: E731
    LU_real = lu_factor(stiff.MU_REAL / h * np.eye(N) - J)
    LU_complex = lu_factor(stiff.MU_COMPLEX / h * np.eye(N) - J)
    converged, _, Z_scipy, _ = scipy_radau.solve_collocation_system(fun, 0.0, y, h, np.zeros((3, N)), scale, tol,
                                                                     LU_real, LU_complex, lu_solve)
    ours = stiff.newton_solve(problem, eigen, jnp.zeros(1), jnp.asarray(y)[None], jnp.full(1, h), jnp.zeros((1, 3, N)),
                              jnp.asarray(scale)[None], tol, jnp.ones(1), jnp.ones(1, bool), jnp.zeros(1, jnp.int32),
                              jnp.zeros(1))
    assert converged and bool(ours.converged[0])
    assert int(ours.nfev[0]) == 3 * int(ours.n_iter[0]) >= 3
    # both converge to the collocation solution within the Newton tolerance (in units of scale)
    assert np.max(np.abs(np.asarray(ours.Z[0]) - Z_scipy) / scale) < 10 * tol


def test_error_norm_equals_scipys_estimate_and_its_refinement():
    J, eigen = _jacobian_and_eigensystem(5, True)
    problem = _problem(J)
    rng = np.random.default_rng(6)
    y, Z, h, rtol, atol = rng.standard_normal(N), 1e-2 * rng.standard_normal((3, N)), 0.2, 1e-6, 1e-9
    y_new, f = y + Z[2], np.asarray(problem.vector_field(0.0, jnp.asarray(y), None))
    LU_real = lu_factor(stiff.MU_REAL / h * np.eye(N) - J)
    ZE = Z.T @ stiff.E / h
    scale = atol + np.maximum(np.abs(y), np.abs(y_new)) * rtol
    error = lu_solve(LU_real, f + ZE)
    first = np.sqrt(np.mean((error / scale) ** 2))
    refined = np.sqrt(np.mean((lu_solve(LU_real, np.asarray(problem.vector_field(0.0, jnp.asarray(y + error), None)) + ZE) / scale) ** 2))
    assert first > 1  # so that the refinement applies
    arguments = (problem, eigen, jnp.zeros(1), jnp.asarray(y)[None], jnp.asarray(y_new)[None], jnp.asarray(f)[None],
                 jnp.asarray(Z)[None], jnp.full(1, h))
    norm, spent = stiff.error_norm(*arguments, jnp.zeros(1, bool), rtol, atol, None)
    np.testing.assert_allclose(float(norm[0]), first, rtol=1e-10)
    assert not bool(spent[0])
    norm, spent = stiff.error_norm(*arguments, jnp.ones(1, bool), rtol, atol, None)
    np.testing.assert_allclose(float(norm[0]), refined, rtol=1e-10)
    assert bool(spent[0])


@pytest.mark.parametrize("h, h_old, error, error_old", [
    (0.1, 0.2, 0.5, 0.8), (0.1, 0.05, 2.0, 0.3), (1.0, 1.0, 1e-3, 1e-2), (0.1, None, 0.5, None), (0.1, 0.2, 1e-300, 0.5),
])
def test_step_size_factor_equals_scipys(h, h_old, error, error_old):
    expected = scipy_radau.predict_factor(h, h_old, error, error_old)
    nan = float("nan")
    ours = float(stiff.predict_factor(jnp.array([h]), jnp.array([nan if h_old is None else h_old]), jnp.array([error]),
                                      jnp.array([nan if error_old is None else error_old]))[0])
    assert ours == pytest.approx(expected, rel=1e-12)


NO_RATE = jnp.full(4, jnp.nan)  # a one-iteration Newton solve measures no rate
TARGET = stiff.NewtonControl().rate_target


def test_a_zero_error_grows_the_step_as_far_as_allowed():
    """scipy divides by the error; here a zero error gives an infinite factor, capped at MAX_FACTOR."""
    factor = stiff.predict_factor(jnp.array([0.1]), jnp.array([0.2]), jnp.array([0.0]), jnp.array([0.5]))
    assert np.isinf(float(factor[0]))
    grown = stiff.next_step_size(jnp.array([0.1]), jnp.array([0.2]), jnp.array([0.0]), jnp.array([0.5]), jnp.ones(1),
                                 jnp.array([True]), jnp.array([False]), jnp.array([False]), jnp.array([0.1]), NO_RATE[:1],
                                 TARGET)
    assert float(grown[0]) == pytest.approx(stiff.MAX_FACTOR * 0.1)


def test_next_step_size_bounds_and_cases():
    h, h_old, error_old = jnp.full(4, 0.1), jnp.full(4, 0.1), jnp.full(4, 0.5)
    accept, reject, halve = (jnp.array(flags) for flags in ([1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]))
    tiny, huge = jnp.full(4, 1e-12), jnp.full(4, 1e12)
    grown = stiff.next_step_size(h, h_old, tiny, error_old, jnp.ones(4), accept > 0, reject > 0, halve > 0, jnp.full(4, 7.0),
                                 NO_RATE, TARGET)
    shrunk = stiff.next_step_size(h, h_old, huge, error_old, jnp.ones(4), accept > 0, reject > 0, halve > 0, jnp.full(4, 7.0),
                                  NO_RATE, TARGET)
    assert float(grown[0]) == pytest.approx(stiff.MAX_FACTOR * 0.1)  # growth capped
    assert float(shrunk[1]) == pytest.approx(stiff.MIN_FACTOR * 0.1)  # shrinking floored
    assert float(grown[2]) == float(shrunk[2]) == pytest.approx(0.05)  # a failed Newton solve halves
    assert float(grown[3]) == 7.0  # a member that did nothing keeps its step
    # more Newton iterations, a smaller safety factor: a smaller next step
    error = jnp.full(4, 0.5)
    few, many = (stiff.next_step_size(h, h_old, error, error_old, jnp.full(4, n), accept > 0, reject > 0, halve > 0, h,
                                      NO_RATE, TARGET) for n in (1, 8))
    assert float(many[0]) < float(few[0])


def test_a_slow_newton_solve_caps_the_growth_of_the_step():
    """After an accepted step the next h is at most h · rate_target / rate (never below h
    on that account); the error controller's step stands where it is smaller."""
    h, h_old, error_old = jnp.full(4, 0.1), jnp.full(4, 0.1), jnp.full(4, 0.5)
    accept, no = jnp.ones(4, bool), jnp.zeros(4, bool)
    tiny = jnp.full(4, 1e-12)  # the error controller alone would grow h by MAX_FACTOR
    target = 0.3
    rates = jnp.array([target / 4, target, 4 * target, jnp.nan])
    grown = stiff.next_step_size(h, h_old, tiny, error_old, jnp.full(4, 3), accept, no, no, h, rates, target)
    np.testing.assert_allclose(np.asarray(grown), [0.4, 0.1, 0.1, 0.1 * stiff.MAX_FACTOR], rtol=1e-12)
    shrinking = stiff.next_step_size(h, h_old, jnp.full(4, 0.9), error_old, jnp.full(4, 3), accept, no, no, h, rates, target)
    unlimited = stiff.next_step_size(h, h_old, jnp.full(4, 0.9), error_old, jnp.full(4, 3), accept, no, no, h, NO_RATE, target)
    np.testing.assert_allclose(np.asarray(shrinking), np.asarray(unlimited), rtol=1e-12)


def test_dense_output_reproduces_a_cubic_and_writes_only_the_step():
    """The collocation polynomial has degree 3: increments taken from a cubic return it exactly."""
    cubic = lambda t: np.stack([1 + 2 * t - t**2 + 0.5 * t**3, np.cos(0) * t**3 - 4 * t])  # noqa: E731
    t, h = 1.0, 0.5
    y = cubic(t)
    Z = np.stack([cubic(t + c * h) - y for c in stiff.C])
    times = jnp.asarray([0.0, 0.9, 1.1, 1.3, 1.5, 1.7, np.inf, np.inf])
    saved = jnp.zeros((2, 8, 2))
    n_saved = jnp.array([2, 2])  # 0.0 and 0.9 already written
    args = (jnp.full(2, t), jnp.asarray(np.stack([y, y])), jnp.full(2, h), jnp.full(2, t + h), jnp.asarray(np.stack([Z, Z])), times)
    saved, n_saved = stiff.dense_output(saved, n_saved, jnp.array([True, False]), *args)
    assert n_saved.tolist() == [5, 2]  # 1.1, 1.3, 1.5 are in (1.0, 1.5]; 1.7 is not
    np.testing.assert_allclose(np.asarray(saved[0, 2:5]), cubic(np.array([1.1, 1.3, 1.5])).T, rtol=1e-13, atol=1e-13)
    assert not np.any(np.asarray(saved[1]))  # a member whose step was not accepted writes nothing


def test_refresh_recomputes_only_the_flagged_members():
    J, _ = _jacobian_and_eigensystem(7, True)
    A = jnp.asarray(J)
    scales = jnp.asarray([1.0, 2.0, 3.0])  # the "loss" data of each member scales its Jacobian

    def eigensystem(t, y, loss, previous, first=False):
        values, vectors = jnp.linalg.eig(loss * A)
        return stiff.Eigensystem(vectors, jnp.linalg.inv(vectors), values, jnp.zeros((N, 0), values.dtype))

    problem = stiff.RadauProblem(lambda t, y, loss: loss * (A @ y), eigensystem, ())
    y0 = jnp.asarray(np.random.default_rng(8).standard_normal((3, N)))
    state = stiff.init_state(problem, y0, scales, jnp.zeros(4), 1.0, 1e-6, 1e-9)
    assert state.njev.tolist() == [1, 1, 1] and bool(state.jacobian_is_current.all())
    stale = state._replace(jacobian=jax.tree_util.tree_map(jnp.zeros_like, state.jacobian),
                           jacobian_is_current=jnp.zeros(3, bool))
    refreshed = stiff.refresh_eigensystems(problem.eigensystem, stale, jnp.array([False, True, False]), scales)
    assert refreshed.njev.tolist() == [1, 2, 1] and refreshed.jacobian_is_current.tolist() == [False, True, False]
    V, V_inv, lam = (np.asarray(a[1]) for a in refreshed.jacobian[:3])
    np.testing.assert_allclose((V * lam) @ V_inv, 2.0 * J, atol=1e-10)  # member 1's own Jacobian
    assert not np.any(np.asarray(refreshed.jacobian.V[0])) and not np.any(np.asarray(refreshed.jacobian.V[2]))


def test_low_rank_eigensystem_finds_the_stiffest_directions():
    """Subspace iteration on Hessian-vector products against numpy's full eigendecomposition."""
    rng = np.random.default_rng(9)
    n, rank = 30, 4
    basis = np.linalg.qr(rng.standard_normal((n, n)))[0]
    curvature = np.concatenate([[400.0, -250.0, 120.0, 90.0], rng.uniform(-1, 1, n - rank)])  # a clear gap
    H = jnp.asarray(basis * curvature @ basis.T)
    rates = jnp.asarray(rng.uniform(0.5, 2.0, n))
    eigensystem = stiff.low_rank_eigensystem(lambda t: rates, lambda theta, loss: H @ theta, n, rank)
    V, V_inv, lam, _ = eigensystem(0.0, jnp.zeros(n), None, None, first=True)
    J = -np.asarray(rates)[:, None] * np.asarray(H)
    expected = np.linalg.eigvals(J)
    expected = expected[np.argsort(-np.abs(expected))][:rank].real
    np.testing.assert_allclose(np.sort(np.asarray(lam)), np.sort(expected), rtol=1e-8)
    np.testing.assert_allclose(J @ np.asarray(V), np.asarray(V) * np.asarray(lam), atol=1e-6 * np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(V_inv) @ np.asarray(V), np.eye(rank), atol=1e-10)


@pytest.mark.parametrize("lagged", [False, True])
def test_later_low_rank_refreshes_keep_iterating_the_subspace(lagged):
    """From a poor first basis (one sweep), each later call advances the subspace by one sweep,
    lagged (through ``ahead``) or not, until the pairs are numpy's."""
    rng = np.random.default_rng(10)
    n, rank = 30, 4
    basis = np.linalg.qr(rng.standard_normal((n, n)))[0]
    curvature = np.concatenate([[40.0, -25.0, 12.0, 9.0], rng.uniform(-3, 3, n - rank)])
    H = jnp.asarray(basis * curvature @ basis.T)
    eigensystem = stiff.low_rank_eigensystem(lambda t: jnp.ones(n), lambda theta, loss: H @ theta, n, rank,
                                             first_iterations=1, lagged=lagged)
    eigen = eigensystem(0.0, jnp.zeros(n), None, None, first=True)
    first_error = np.max(np.abs(np.sort(np.asarray(eigen.lam)) - np.sort(-curvature[:rank])))
    for _ in range(60):
        eigen = eigensystem(0.0, jnp.zeros(n), None, eigen)
    assert first_error > 0.1
    np.testing.assert_allclose(np.sort(np.asarray(eigen.lam)), np.sort(-curvature[:rank]), rtol=1e-8)


@pytest.mark.slow
def test_a_three_hundred_token_flow_agrees_with_tsit5():
    """d = 300 (n = 2432, the low-rank eigensystem and the O(d² m) loss) through condensation:
    JaxRadau against the explicit Tsit5 at a tight tolerance."""
    from flowsim.config import resolve_config

    d = 300
    pi = 1.0 / np.arange(1, d + 1) ** 1.5
    config = resolve_config({"chain": {"pi": (pi / pi.sum()).tolist(), "lam": 0.5}, "model": {"m": 4, "k": 4},
                             "init": {"eps": 0.05}, "time": {"t_end": 40.0, "n_linear": 9, "n_log": 0}})
    prepared = prepare(config)
    radau, tsit5 = (solve_flow(prepared.flow, prepared.params0, prepared.times, method=method, rtol=rtol, atol=1e-12)
                    for method, rtol in (("JaxRadau", 1e-8), ("Tsit5", 1e-10)))
    assert radau.success and tsit5.success
    assert tsit5.trajectory.loss[-1] < 0.6 * tsit5.trajectory.loss[0]  # condensation happened
    np.testing.assert_allclose(radau.trajectory.loss, tsit5.trajectory.loss, rtol=1e-7)
    theta, reference = (prepared.flow.flatten(result.trajectory.at(-1)) for result in (radau, tsit5))
    assert np.abs(theta - reference).max() < 1e-5 * np.abs(reference).max()
