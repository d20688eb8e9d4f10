"""JaxBDF's parts, each against an independent route, and the whole method against scipy's BDF."""

from math import comb

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp
from scipy.linalg import expm

from flowsim.solve import bdf


def backward_differences(polynomial, t: float, h: float, rows: int = bdf.ROWS) -> np.ndarray:
    """∇^j y(t) at step h, j = 0 .. rows - 1, from samples y(t - i h) (the definition)."""
    return np.array([[sum((-1) ** i * comb(j, i) * polynomial(t - i * h) for i in range(j + 1))] for j in range(rows)])


@pytest.mark.parametrize("order", [1, 2, 3, 5])
@pytest.mark.parametrize("factor", [0.3, 0.5, 2.0, 7.5])
def test_rescaling_moves_the_differences_of_a_polynomial_to_the_new_step(order, factor):
    coefficients = np.random.default_rng(order).normal(size=order + 1)
    polynomial = np.polynomial.Polynomial(coefficients)
    t, h = 1.7, 0.2
    D = backward_differences(polynomial, t, h)
    moved = np.asarray(bdf.rescale(jnp.asarray(D), order, factor))
    expected = backward_differences(polynomial, t, factor * h)
    np.testing.assert_allclose(moved[:order + 1], expected[:order + 1], rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(moved[order + 1:], D[order + 1:])  # the rows above the order are kept


@pytest.mark.parametrize("order", [1, 3, 5])
def test_interpolation_is_exact_on_polynomials_of_the_order(order):
    polynomial = np.polynomial.Polynomial(np.random.default_rng(10 + order).normal(size=order + 1))
    t, h = 3.0, 0.25
    D = jnp.asarray(backward_differences(polynomial, t, h))
    for tau in (t, t - 0.1, t - h, t - 2.5 * h):
        np.testing.assert_allclose(float(bdf.interpolate(D, t, h, order, tau)[0]), polynomial(tau), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("order", [1, 2, 4, 5])
def test_difference_update_after_a_step_is_scipys_loop(order):
    rng = np.random.default_rng(order)
    D, d = rng.normal(size=(bdf.ROWS, 4)), rng.normal(size=4)
    expected = D.copy()
    expected[order + 2] = d - expected[order + 1]
    expected[order + 1] = d
    for i in reversed(range(order + 1)):
        expected[i] += expected[i + 1]
    np.testing.assert_allclose(np.asarray(bdf.differences_after_step(jnp.asarray(D), jnp.asarray(d), order)), expected,
                               rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("order", [1, 3, 5])
def test_order_change_takes_the_order_allowing_the_largest_biased_step(order):
    """CVODE's rule on differences whose error estimates are set: e_j = ERROR_CONST · RMS of D[q] (order q - 1),
    of the correction (order q), of D[q + 2] (order q + 1), each step factor (BIAS_j e_j)^(-1/(q + j))."""
    n = 6
    scale = np.full(n, 1e-3)
    for below, current, above in ((1e-3, 1e-2, 1e-1), (1e-1, 1e-2, 1e-3), (1e-4, 1e-4, 1e-4), (0.5, 0.9, 0.7)):
        D = np.zeros((bdf.ROWS, n))
        D[order] = below / bdf.ERROR_CONST[max(order - 1, 0)] * scale
        D[order + 2] = above / bdf.ERROR_CONST[min(order + 1, bdf.MAX_ORDER)] * scale
        new_order, factor = bdf.order_change(jnp.int32(order), current, jnp.asarray(D), jnp.asarray(scale))
        candidates = {order: (6 * current) ** (-1 / (order + 1))}
        if order > 1:
            candidates[order - 1] = (6 * below) ** (-1 / order)
        if order < bdf.MAX_ORDER:
            candidates[order + 1] = (10 * above) ** (-1 / (order + 2))
        best = max(candidates, key=candidates.get)
        if candidates[best] < 1:  # no order allows a longer step: keep order and step
            assert (int(new_order), float(factor)) == (order, 1.0)
        else:
            assert int(new_order) == best
            assert float(factor) == pytest.approx(min(bdf.MAX_FACTOR, candidates[best]), rel=1e-12)


def test_gmres_solves_a_small_system_exactly_and_stops_at_its_tolerance():
    rng = np.random.default_rng(0)
    n = 15  # below KRYLOV_DIM: the Krylov space reaches the whole space
    A = np.eye(n) + 0.3 * rng.normal(size=(n, n))
    b = rng.normal(size=n)
    x, used = bdf.gmres(lambda v: jnp.asarray(A) @ v, jnp.asarray(b), 1e-12)
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(A, b), rtol=1e-9, atol=1e-10)
    assert int(used) <= n

    loose = 0.1 * np.linalg.norm(b)
    x, used_loose = bdf.gmres(lambda v: jnp.asarray(A) @ v, jnp.asarray(b), loose)
    assert np.linalg.norm(b - A @ np.asarray(x)) <= loose * (1 + 1e-9)  # the residual it reports is the true one
    assert 0 < int(used_loose) < int(used)


def test_gmres_with_one_gram_schmidt_pass_reports_its_true_residual_on_an_ill_conditioned_system():
    """Modified Gram-Schmidt once (no reorthogonalisation) on I + cH with H's eigenvalues over ten decades, as on a
    stiff flow: the residual GMRES stops on is the true one down to Newton's tolerances, and below them the solution is
    backward stable (Paige, Rozložník & Strakoš 2006): ‖b - A x‖ within a small multiple of ε ‖A‖ ‖x‖."""
    rng = np.random.default_rng(5)
    n = bdf.KRYLOV_DIM
    Q = np.linalg.qr(rng.normal(size=(n, n)))[0]
    A = Q @ np.diag(1 + np.logspace(-2, 8, n)) @ Q.T
    b = rng.normal(size=n)
    for tol in (1e-2, 1e-4, 1e-6, 1e-12):
        x, used = bdf.gmres(lambda v: jnp.asarray(A) @ v, jnp.asarray(b), tol * np.linalg.norm(b))
        x = np.asarray(x)
        residual = np.linalg.norm(b - A @ x)
        floor = 100 * np.finfo(float).eps * np.linalg.norm(A, 2) * np.linalg.norm(x)
        assert residual <= max(1.01 * tol * np.linalg.norm(b), floor), (tol, residual, floor, int(used))
    assert tol * np.linalg.norm(b) < floor  # the last tolerance is below what any GMRES in floating point reaches


def test_newton_solve_reaches_the_implicit_equation_of_a_linear_step():
    rng = np.random.default_rng(1)
    n = 10
    A = np.diag(np.logspace(-1, 3, n))
    y_predict, psi = rng.normal(size=n), 0.01 * rng.normal(size=n)
    c = 0.05
    newton = bdf.newton_solve(lambda t, y: -jnp.asarray(A) @ y, 1.0, jnp.asarray(y_predict), c, jnp.asarray(psi),
                              jnp.full(n, 1e-6), 1e-3, bdf.LINEAR_TOLERANCE * 1e-3)
    # c f(y) - ψ - d = 0 with y = y_pred + d and f = -A y
    d = np.linalg.solve(np.eye(n) + c * A, -c * A @ y_predict - psi)
    assert bool(newton.converged) and int(newton.n_iter) == 2  # no earlier rate: a second iteration confirms
    np.testing.assert_allclose(np.asarray(newton.d), d, rtol=1e-6, atol=1e-9)
    first_norm = float(np.sqrt(np.mean((d / 1e-6) ** 2)))
    for rate0, iterations in ((0.5e-3 / first_norm, 1), (2e-3 / first_norm, 2)):  # CVODE's test: min(1, ρ₀)‖Δ‖ < tol
        newton = bdf.newton_solve(lambda t, y: -jnp.asarray(A) @ y, 1.0, jnp.asarray(y_predict), c, jnp.asarray(psi),
                                  jnp.full(n, 1e-6), 1e-3, bdf.LINEAR_TOLERANCE * 1e-3, rate0=rate0)
        assert bool(newton.converged) and int(newton.n_iter) == iterations, rate0
        np.testing.assert_allclose(np.asarray(newton.d), d, rtol=1e-6, atol=1e-9)


def stiff_nonlinear_problem(n: int = 12):
    rng = np.random.default_rng(0)
    Q = np.linalg.qr(rng.normal(size=(n, n)))[0]
    A = Q @ np.diag(np.logspace(-2, 4, n)) @ Q.T
    return A, rng.normal(size=n)


def test_the_difference_product_is_the_jacobian_product_to_about_root_epsilon():
    """Against jax.jvp on a nonlinear field whose entries span six decades, for directions of every size."""
    rng = np.random.default_rng(3)
    A, _ = stiff_nonlinear_problem()
    y = jnp.asarray(rng.normal(size=len(A)) * np.logspace(-3, 3, len(A)))

    def field_at(y):
        return -jnp.asarray(A) @ jnp.tanh(y) - 0.1 * jnp.sin(y) * y

    for u_scale in (1e-12, 1.0, 1e6):
        u = jnp.asarray(rng.normal(size=len(A))) * u_scale
        exact = jax.jvp(field_at, (y,), (u,))[1]
        approximate = bdf.difference_product(field_at, y, field_at(y), u)
        assert float(jnp.linalg.norm(approximate - exact) / jnp.linalg.norm(exact)) < 1e-6, u_scale
    assert np.all(np.asarray(bdf.difference_product(field_at, y, field_at(y), jnp.zeros(len(A)))) == 0)


def run_small_bdf(functions, A, y0, times, rtol, atol=1e-12):
    state = functions.init(jnp.asarray(y0), jnp.asarray(A), jnp.asarray(times), times[-1], rtol, atol)
    return functions.advance(state, jnp.asarray(A), jnp.asarray(times), times[-1], times[-1], rtol, atol,
                             np.int32(10**5), np.int32(2**31 - 1))


@pytest.fixture(scope="module")
def small_problem():
    A, y0 = stiff_nonlinear_problem()
    times = np.linspace(0.0, 10.0, 11)

    def field(t, y):
        return -A @ y - 0.1 * np.sin(y)

    def jacobian(t, y):
        return -A - 0.1 * np.diag(np.cos(y))

    reference = solve_ivp(field, (0, 10), y0, method="Radau", rtol=1e-12, atol=1e-14, t_eval=times, jac=jacobian)
    scipy_runs = {rtol: solve_ivp(field, (0, 10), y0, method="BDF", rtol=rtol, atol=1e-12, t_eval=times, jac=jacobian,
                                  dense_output=True) for rtol in (1e-4, 1e-7)}
    return A, y0, times, reference, scipy_runs


@pytest.fixture(scope="module")
def small_bdf(small_problem):
    A, y0, times = small_problem[:3]
    return {route: bdf.build_bdf(bdf.BdfProblem(lambda t, y, A: -A @ y - 0.1 * jnp.sin(y), (), route),
                                 len(times), len(y0), jnp.asarray(A))
            for route in ("exact", "difference")}


@pytest.mark.parametrize("rtol", [1e-4, 1e-7])
@pytest.mark.slow
def test_the_whole_method_follows_scipys_bdf(small_problem, small_bdf, rtol):
    """Same formulas as scipy's BDF (exact J·v, as scipy's Jacobian is) on a stiff nonlinear system: about its error
    and steps (CVODE's biases choose steps up to about a fifth shorter than scipy's safety factor, and the step-size
    path moves by ±20% with last-digit changes); CVODE's Newton stopping takes fewer field evaluations."""
    A, y0, times, reference, scipy_runs = small_problem
    state = run_small_bdf(small_bdf["exact"], A, y0, times, rtol)
    assert int(state.status) == bdf.FINISHED and int(state.n_saved) == len(times)
    error = np.abs(np.asarray(state.saved) - reference.y.T).max()
    scipy_error = np.abs(scipy_runs[rtol].y.T - reference.y.T).max()
    assert error < 3 * scipy_error + 1e-12
    scipy_steps = len(scipy_runs[rtol].sol.ts) - 1  # accepted steps: the dense output's pieces
    assert 0.8 * scipy_steps <= int(state.n_steps) <= 1.5 * scipy_steps
    assert int(state.nfev) < scipy_runs[rtol].nfev
    np.testing.assert_array_equal(np.asarray(state.saved[0]), y0)


@pytest.mark.parametrize("rtol", [1e-4, 1e-7])
def test_difference_products_keep_the_methods_accuracy(small_problem, small_bdf, rtol):
    """J·v by forward differences changes only the Newton iteration's path, not what it converges to: the error
    stays within scipy's, and each product is counted as a field evaluation."""
    A, y0, times, reference, scipy_runs = small_problem
    state = run_small_bdf(small_bdf["difference"], A, y0, times, rtol)
    assert int(state.status) == bdf.FINISHED and int(state.n_saved) == len(times)
    error = np.abs(np.asarray(state.saved) - reference.y.T).max()
    assert error < 3 * np.abs(scipy_runs[rtol].y.T - reference.y.T).max() + 1e-12
    exact = run_small_bdf(small_bdf["exact"], A, y0, times, rtol)
    newton_fields = int(state.nfev) - int(state.n_products)
    assert int(state.n_products) > 0 and abs(newton_fields - int(exact.nfev)) <= 0.5 * int(exact.nfev)


def test_steps_end_on_the_kinks_and_a_chunked_run_takes_the_same_steps(small_problem):
    A, y0, times = small_problem[:3]
    problem = bdf.BdfProblem(lambda t, y, A: -jnp.where(t > 2.5, 2.0, 1.0) * (A @ y), (2.5,))
    functions = bdf.build_bdf(problem, len(times), len(y0), jnp.asarray(A))
    arguments = (jnp.asarray(A), jnp.asarray(times), times[-1])
    limits = (1e-6, 1e-12, np.int32(10**5))

    def start():
        return functions.init(jnp.asarray(y0), *arguments, 1e-6, 1e-12)

    whole = functions.advance(start(), *arguments, times[-1], *limits, np.int32(2**31 - 1))
    at_kink = functions.advance(start(), *arguments, 2.5, *limits, np.int32(2**31 - 1))
    assert float(at_kink.t) == 2.5  # a step ended exactly on the kink
    state = start()
    while int(state.status) == bdf.RUNNING:
        state = functions.advance(state, *arguments, times[-1], *limits, np.int32(7))
    np.testing.assert_array_equal(np.asarray(state.saved), np.asarray(whole.saved))
    assert int(state.n_steps) == int(whole.n_steps)
    exact = np.stack([expm(-2 * A * max(t - 2.5, 0.0)) @ expm(-A * min(t, 2.5)) @ y0 for t in times])
    assert np.abs(np.asarray(whole.saved) - exact).max() < 1e-5


@pytest.mark.slow
def test_the_compiled_loop_keeps_library_calls_only_above_the_size_threshold():
    """``build_bdf`` passes the flow's size to ``stiff.compile_loop``: a field of dense products compiles to YNNPACK
    calls above ``LIBRARY_CALLS_ABOVE_SIZE`` parameters and to XLA's own loops at it."""
    from flowsim.solve import stiff

    def linear_field(t, y, matrix):
        return -(matrix @ y.reshape(-1, 32)).reshape(-1) * 1e-3

    problem = bdf.BdfProblem(linear_field, ())
    plain = jax.jit(lambda y, matrix: linear_field(0.0, y, matrix))
    texts = {}
    for size in (stiff.LIBRARY_CALLS_ABOVE_SIZE, stiff.LIBRARY_CALLS_ABOVE_SIZE + 32):
        matrix = jnp.eye(size // 32)
        if "ynn_fusion" not in plain.lower(jnp.zeros(size), matrix).compile().as_text():
            pytest.skip("this XLA makes no YNNPACK library calls")
        texts[size] = bdf.build_bdf(problem, 2, size, matrix).advance.as_text()
    small, large = sorted(texts)
    assert "ynn_fusion" not in texts[small]
    assert "ynn_fusion" in texts[large]
