"""flowsim.solve.rkc: the Runge-Kutta-Chebyshev method against closed forms and another solver."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp
from scipy.linalg import expm

import flowsim.solve.rkc
from flowsim.solve.rkc import RKC


def linear_field(y, A):
    return A @ y


def stiff_linear_system(n: int = 40, seed: int = 0):
    """dy/dt = A y, A = -V diag(λ) Vᵀ with λ from 1e-2 to 1e3 (stiffness ratio 1e5): y(t) = expm(t A) y0."""
    rng = np.random.default_rng(seed)
    V = np.linalg.qr(rng.standard_normal((n, n)))[0]
    A = -(V * np.geomspace(1e-2, 1e3, n)) @ V.T
    return A, rng.standard_normal(n)


@pytest.mark.parametrize("rtol", [1e-4, 1e-6, 1e-8])
def test_stiff_linear_system_against_the_matrix_exponential(rtol):
    A, y0 = stiff_linear_system()
    times = np.array([0.5, 5.0, 50.0])
    solution = solve_ivp(None, (0.0, times[-1]), y0, method=RKC, field=linear_field, field_args=(A,), t_eval=times,
                         rtol=rtol, atol=1e-12)
    assert solution.success, solution.message
    exact = np.stack([expm(t * A) @ y0 for t in times], axis=1)
    error = np.abs(solution.y - exact).max() / np.abs(y0).max()
    assert error < 30 * rtol, error
    # stable far beyond an explicit method's limit: RK4 (stable to h λ = 2.79, 4 evaluations a step) needs 72 000
    assert solution.nfev < 4 * 1e3 * times[-1] / 2.79, solution.nfev


def test_second_order_convergence():
    """Halving the tolerance's cube root halves the steps: the global error falls like rtol^(2/3)."""
    A, y0 = stiff_linear_system(n=12, seed=1)
    exact = expm(3.0 * A) @ y0
    errors = []
    for rtol in (1e-5, 1e-7, 1e-9):
        solution = solve_ivp(None, (0.0, 3.0), y0, method=RKC, field=linear_field, field_args=(A,), rtol=rtol, atol=1e-14)
        errors.append(np.abs(solution.y[:, -1] - exact).max())
    ratios = np.log10(np.array(errors[:-1]) / np.array(errors[1:])) / 2.0  # decades of error per decade of rtol
    assert np.all(ratios > 0.4) and np.all(ratios < 1.2), (errors, ratios)


def loss(y, target):
    """Softmax cross-entropy of logits y against a target law plus a quartic coupling: curvature from
    O(1) to O(100) along the path."""
    return -(target @ jax.nn.log_softmax(y)) + 25.0 * jnp.sum((y[:-1] - y[1:]) ** 4)


def gradient_flow(y, target):
    return -jax.grad(loss)(y, target)


@pytest.mark.parametrize("deflate", [True, False])
@pytest.mark.slow
def test_nonlinear_flow_and_dense_output_against_lsoda(deflate):
    target = np.random.default_rng(2).dirichlet(np.ones(30))
    y0 = np.random.default_rng(3).standard_normal(30)
    field, hessian = jax.jit(gradient_flow), jax.jit(jax.hessian(loss))
    times = np.linspace(0.0, 20.0, 41)
    reference = solve_ivp(lambda t, y: np.asarray(field(y, target)), (0.0, 20.0), y0, method="LSODA", t_eval=times,
                          rtol=1e-12, atol=1e-14, dense_output=True, jac=lambda t, y: -np.asarray(hessian(y, target)))
    solution = solve_ivp(None, (0.0, 20.0), y0, method=RKC, field=gradient_flow, field_args=(target,), t_eval=times,
                         rtol=1e-8, atol=1e-12, dense_output=True, deflate=deflate)
    assert solution.success
    np.testing.assert_allclose(solution.y, reference.y, atol=1e-6)
    between = (times[3:-1] + times[4:]) / 2  # the dense output between the saved times
    np.testing.assert_allclose(solution.sol(between), reference.sol(between), atol=1e-6)


STIFFNESS = 1e4  # one Hessian eigenvalue about this, the others O(1-100): the shape of attention's flows


def loss_with_one_stiff_direction(y, target, a):
    """``loss`` plus a steep valley across the unit vector a, curved so that the stiff direction turns along the path."""
    return loss(y, target) + 0.5 * STIFFNESS * (a @ y - 0.3 * jnp.sum(jnp.sin(y))) ** 2


def flow_with_one_stiff_direction(y, target, a):
    return -jax.grad(loss_with_one_stiff_direction)(y, target, a)


def one_stiff_direction_problem():
    """(target, y0, a) for ``flow_with_one_stiff_direction``: a seeded target law, start and unit valley normal."""
    rng = np.random.default_rng(4)
    target, y0, a = rng.dirichlet(np.ones(30)), 0.3 * rng.standard_normal(30), rng.standard_normal(30)
    return target, y0, a / np.linalg.norm(a)


def lsoda_reference(flow, loss_function, args, y0, times):
    """LSODA at rtol 1e-12 with the exact Jacobian (minus the loss's Hessian), dense output on."""
    field, hessian = jax.jit(flow), jax.jit(jax.hessian(loss_function))
    return solve_ivp(lambda t, y: np.asarray(field(y, *args)), (0.0, times[-1]), y0, method="LSODA", t_eval=times,
                     rtol=1e-12, atol=1e-14, dense_output=True, jac=lambda t, y: -np.asarray(hessian(y, *args)))


def rkc_evaluations_matching(reference, flow, args, y0, times, deflate: bool) -> int:
    """RKC at rtol 1e-6 on ``flow``: its saved times and its dense output between them within 2e-5 of ``reference``;
    returns its field evaluations."""
    run = solve_ivp(None, (0.0, times[-1]), y0, method=RKC, field=flow, field_args=args, t_eval=times, rtol=1e-6,
                    atol=1e-10, dense_output=True, deflate=deflate)
    assert run.success, run.message
    between = (times[2:-1] + times[3:]) / 2
    np.testing.assert_allclose(run.y, reference.y, atol=2e-5)
    np.testing.assert_allclose(run.sol(between), reference.sol(between), atol=2e-5)
    return run.nfev


@pytest.mark.slow
def test_deflation_takes_the_one_stiff_direction_out_of_the_stage_count():
    """With the outlying direction integrated exactly the path is LSODA's (saved and dense output), to the same
    accuracy as plain RKC's, for less than half of its field evaluations (s follows √ρ of the rest)."""
    target, y0, a = one_stiff_direction_problem()
    args = (target, a)
    spectrum = np.linalg.eigvalsh(np.asarray(jax.hessian(loss_with_one_stiff_direction)(y0, *args)))
    assert spectrum[-1] > 10 * spectrum[-2], spectrum[-3:]  # one outlier
    times = np.linspace(0.0, 10.0, 21)
    reference = lsoda_reference(flow_with_one_stiff_direction, loss_with_one_stiff_direction, args, y0, times)
    evaluations = {deflate: rkc_evaluations_matching(reference, flow_with_one_stiff_direction, args, y0, times, deflate)
                   for deflate in (True, False)}
    assert evaluations[True] < 0.5 * evaluations[False], evaluations


def loss_with_two_stiff_directions(y, target, a, b):
    """``loss_with_one_stiff_direction`` plus a second valley, 3.3x less steep, across b: two outliers, the gap
    between them as on the full-rank flows of attention (about 3)."""
    return loss_with_one_stiff_direction(y, target, a) + 0.5 * 0.3 * STIFFNESS * (b @ y - 0.2 * jnp.sum(jnp.sin(1.7 * y))) ** 2


def flow_with_two_stiff_directions(y, target, a, b):
    return -jax.grad(loss_with_two_stiff_directions)(y, target, a, b)


@pytest.mark.slow
def test_deflation_takes_two_stiff_directions_out(monkeypatch):
    """Two outlying eigenvalues (4·10⁴ and 3.5·10³, the rest below 10²): with both taken out the path is LSODA's and
    the run needs fewer evaluations than with only the first taken out, and far fewer than plain RKC."""
    rng = np.random.default_rng(6)
    target, y0 = rng.dirichlet(np.ones(30)), 0.3 * rng.standard_normal(30)
    a, b = np.linalg.qr(rng.standard_normal((30, 2)))[0].T
    args = (target, a, b)
    times = np.linspace(0.0, 100.0, 21)
    reference = lsoda_reference(flow_with_two_stiff_directions, loss_with_two_stiff_directions, args, y0, times)
    hessian = jax.jit(jax.hessian(loss_with_two_stiff_directions))
    for y in reference.y.T[1:]:  # once in the valleys
        spectrum = np.linalg.eigvalsh(np.asarray(hessian(y, *args)))
        assert spectrum[-1] > 2.5 * spectrum[-2] and spectrum[-2] > 10 * spectrum[-3], spectrum[-3:]
    evaluations = {}
    for taken, deflate in ((2, True), (1, True), (2, False)):
        monkeypatch.setattr(flowsim.solve.rkc, "MAX_DIRECTIONS", taken)
        evaluations[taken, deflate] = rkc_evaluations_matching(reference, flow_with_two_stiff_directions, args, y0, times,
                                                               deflate)
    assert evaluations[2, True] < 0.8 * evaluations[1, True] and evaluations[2, True] < 0.4 * evaluations[2, False], evaluations


def test_deflated_steps_converge_at_second_order():
    """A linear system with one eigenvalue 10⁴ above a spectrum from 1e-2 to 10: the global error falls like
    rtol^(2/3) with v's direction integrated exactly, as without."""
    rng = np.random.default_rng(5)
    V = np.linalg.qr(rng.standard_normal((12, 12)))[0]
    A, y0 = -(V * np.append(np.geomspace(1e-2, 10.0, 11), 1e4)) @ V.T, rng.standard_normal(12)
    exact = expm(3.0 * A) @ y0
    errors = []
    for rtol in (1e-5, 1e-7, 1e-9):
        solution = solve_ivp(None, (0.0, 3.0), y0, method=RKC, field=linear_field, field_args=(A,), rtol=rtol, atol=1e-14)
        errors.append(np.abs(solution.y[:, -1] - exact).max())
    ratios = np.log10(np.array(errors[:-1]) / np.array(errors[1:])) / 2.0
    assert np.all(ratios > 0.4) and np.all(ratios < 1.2), (errors, ratios)


def test_power_iteration_ends_with_its_own_product_and_stops_once_its_estimate_settles():
    """On a linear field J = A (eigenvalues 100, 40, the rest at most 10): the returned product is J u exactly, the
    estimate ‖J u‖ is ρ to the tolerance's order in fewer products than the cap, and on the complement of the dominant
    direction it is the next eigenvalue."""
    rng = np.random.default_rng(7)
    V = np.linalg.qr(rng.standard_normal((20, 20)))[0]
    A = (V * np.append(np.linspace(0.5, 10.0, 18), [40.0, 100.0])) @ V.T
    power, y, start = flowsim.solve.rkc.power_iteration(linear_field), np.zeros(20), rng.standard_normal(20)
    f0 = np.asarray(linear_field(y, jnp.asarray(A)))
    u, Ju, count = (np.asarray(x) for x in power(y, f0, start, (jnp.asarray(A),), tolerance=1e-3))
    np.testing.assert_allclose(Ju, A @ u, atol=1e-12)
    assert abs(np.linalg.norm(Ju) - 100.0) < 0.5 and int(count) < flowsim.solve.rkc.POWER_ITERATIONS, (np.linalg.norm(Ju), count)
    assert int(power(y, f0, start, (jnp.asarray(A),))[2]) == flowsim.solve.rkc.POWER_ITERATIONS  # no tolerance: every product
    away = np.zeros((20, flowsim.solve.rkc.MAX_DIRECTIONS))
    away[:, 0] = V[:, -1]
    u, Ju, _ = (np.asarray(x) for x in power(y, f0, start, (jnp.asarray(A),), away=away, tolerance=1e-3))
    off = np.eye(20) - np.outer(V[:, -1], V[:, -1])
    np.testing.assert_allclose(Ju, off @ A @ u, atol=1e-12)
    assert abs(np.linalg.norm(Ju) - 40.0) < 0.2, np.linalg.norm(Ju)


def test_power_iterations_products_are_the_jacobians_to_a_forward_differences_error():
    """The products are forward differences of the field (one evaluation each): on a nonlinear field away from 0 one
    product is JAX's exact Jacobian-vector product to about √(machine ε), relative."""
    rng = np.random.default_rng(3)
    A = jnp.asarray(rng.standard_normal((30, 30)))

    def field(y, A):
        return -A @ jnp.tanh(y) - y**3

    y, start = rng.standard_normal(30) * 3.0, rng.standard_normal(30)
    u, Ju, count = (np.asarray(x) for x in flowsim.solve.rkc.power_iteration(field)(y, np.asarray(field(y, A)), start, (A,),
                                                                             iterations=1))
    exact = np.asarray(jax.jvp(lambda x: field(x, A), (jnp.asarray(y),), (jnp.asarray(u),))[1])
    assert int(count) == 1
    assert np.linalg.norm(Ju - exact) < 1e-6 * np.linalg.norm(exact), np.linalg.norm(Ju - exact) / np.linalg.norm(exact)


@pytest.mark.parametrize("rtol, pays", [(1e-4, True), (1e-11, False)])
def test_a_direction_is_taken_out_only_where_its_stages_saved_outweigh_its_refreshes(rtol, pays):
    """One outlier at 10⁴: at a loose tolerance the steps are long (h ρ in the hundreds) and it is taken out; at a tight
    one they are so short that s is 3 with it or without, and it is not (from the second estimate of ρ on: the first
    is made before any step size is known, and takes it out on the gap alone)."""
    target, y0, a = one_stiff_direction_problem()
    solver = RKC(None, 0.0, y0, 10.0, field=flow_with_one_stiff_direction, field_args=(target, a), rtol=rtol, atol=1e-14)
    taken, stages = [], []
    while solver.status == "running" and len(taken) < 400:
        t = solver.t
        solver.step()
        taken.append(solver.taken)
        stages.append(flowsim.solve.rkc.stage_count(solver.t - t, solver.radius))
    later = slice(flowsim.solve.rkc.RADIUS_AGE, None)
    assert len(taken) > 2 * flowsim.solve.rkc.RADIUS_AGE
    assert (max(taken[later]) > 0) == pays and (max(stages[later]) > 3) == pays, (taken, stages)


def test_field_is_required():
    with pytest.raises(ValueError, match="RKC needs field="):
        solve_ivp(None, (0.0, 1.0), np.ones(2), method=RKC)


def test_steps_that_shrink_while_accepted_end_in_a_failure_not_a_stalled_clock(monkeypatch):
    """An error estimate that stays just below 1 accepts every step while shrinking it (as where stale stiff
    directions floor the estimate): RKC stops with its reason before t + h == t (scipy would raise on the repeated
    time), and the reduced flow names where it failed."""
    A, y0 = stiff_linear_system(8)
    monkeypatch.setattr(RKC, "_error", lambda self, y_new, f_new, h: 0.99)
    solution = solve_ivp(None, (0.0, 1.0), y0, method=RKC, field=linear_field, field_args=(jnp.asarray(A),), rtol=1e-6)
    assert solution.status == -1 and "spacing of floating-point numbers" in solution.message
    assert np.all(np.diff(solution.t) > 0) and solution.t[-1] < 1.0


def test_hermite_output_is_scipys_cubic_hermite_spline_either_way_in_time():
    from scipy.interpolate import CubicHermiteSpline

    from flowsim.solve.rkc import HermiteOutput

    y0, y1, f0, f1 = np.random.default_rng(0).standard_normal((4, 5))
    for t_old, t_new in ((0.3, 1.7), (2.0, 0.5)):
        forward = t_old < t_new
        spline = CubicHermiteSpline(sorted([t_old, t_new]), np.stack([y0, y1] if forward else [y1, y0], axis=1),
                                    np.stack([f0, f1] if forward else [f1, f0], axis=1), axis=1)
        output = HermiteOutput(t_old, t_new, y0, y1, f0, f1)
        for t in (t_old, t_new, 0.9, np.array([0.6, 1.1, 1.5])):
            np.testing.assert_allclose(output(t), spline(t), rtol=1e-13, atol=1e-13)
