"""Variable-order BDF compiled end to end in JAX, with Newton-Krylov solves: a matrix-free stiff method.

The formulas, error estimates and step-size and order control are scipy's ``BDF`` (the NDF formulas of
Shampine & Reichelt, orders 1 to 5, in quasi-constant step size: the backward differences D are rescaled
when h changes), except that the step and order chosen after q + 1 equal steps are CVODE's: each order's
error estimate is weighted by CVODE's bias (BIAS) in place of scipy's safety factor, which halves the rejected
steps of a gradient flow. Two more things differ, which suit large gradient flows. Each simplified-Newton system

    (I - c J) Δ = c f(y) - ψ - d,      c = h / α_q,

is solved by GMRES on products J·v at the step's predicted point, so nothing of size n² is formed or factorised
and a step-size change costs nothing; and the Newton iteration stops as CVODE's does: at CVODE's tolerance
(NEWTON_TOLERANCE over the order's error constant), not scipy's tighter one, and after one iteration when an
earlier step's contraction rate says it has converged. A product is a forward difference of the field by default
(one field evaluation, accurate to about √ε, far inside the Krylov tolerance; the Newton residual itself is always
the exact field), or exact from ``jax.linearize``, whose tangent of a gradient applies the product rule to every
matrix product (the costs: benchmarks/MEASUREMENTS.md, "JaxBDF: products by difference"). The whole loop, Newton and
Krylov iterations included, is one XLA ``while_loop`` with no host round trip.

The parts, each a pure function testable alone:

    rescaling_matrix   the matrix that moves D to a new step size (scipy's ``change_D``)
    gmres              Δ ≈ A⁻¹ b from at most KRYLOV_DIM products A·v, to a residual tolerance
    difference_product J·v as a forward difference of the field
    newton_solve       the simplified Newton iteration of one step (scipy's ``solve_bdf_system``)
    order_change       the order and step factor chosen after an accepted step from the error
                       estimates of orders q - 1, q, q + 1
    interpolate        the step's interpolating polynomial at a time (scipy's ``BdfDenseOutput``)

``attempt_step`` composes them, ``advance`` loops it, ``build_bdf`` compiles ``init`` and ``advance`` for one flow.

Cost per Newton iteration: one field evaluation, the k GMRES products (one field evaluation each by difference,
one tangent of the field exactly) and O(k² n) vector work; memory O(n (MAX_ORDER + KRYLOV_DIM))
besides the save buffer. The Krylov solves are inexact (to LINEAR_TOLERANCE of the Newton tolerance), which
bounds the attainable error as it does CVODE's.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flowsim.solve.stiff import FINISHED, NON_FINITE, RUNNING, SOLVER_FAILED, STEP_LIMIT, compile_loop, select_initial_step

MAX_ORDER = 5
NEWTON_MAXITER = 4
MIN_FACTOR, MAX_FACTOR = 0.2, 10.0
KAPPA = np.array([0.0, -0.1850, -1 / 9, -0.0823, -0.0415, 0.0])  # NDF coefficients (scipy's, Shampine & Reichelt)
GAMMA = np.hstack((0.0, np.cumsum(1 / np.arange(1, MAX_ORDER + 1))))
ALPHA = (1 - KAPPA) * GAMMA
ERROR_CONST = KAPPA * GAMMA + 1 / np.arange(1, MAX_ORDER + 2)
KRYLOV_DIM = 20  # GMRES products per Newton solve at most (as the benchmark's CVODE peer is set)
# The Newton iteration stops when its last correction times ERROR_CONST[q] (as the error test weighs it), RMS in
# units of the error tolerance, is below NEWTON_TOLERANCE (CVODE's nlscoef over tq[2]; scipy's tighter min(0.03,
# √rtol) on the unweighted correction costs more J·v for the same loss error), and each Krylov solve at
# LINEAR_TOLERANCE × NEWTON_TOLERANCE unweighted: relative to the order's looser Newton tolerance, an inexact solve's
# residue in D feeds rejections (benchmarks/MEASUREMENTS.md, "JaxBDF").
NEWTON_TOLERANCE = 0.1
# The Newton iteration may stop after its first correction when that correction times the last contraction rate
# measured is below tolerance (CVODE's test); the rate is forgotten after a rejected step and every RATE_REFRESH
# accepted steps (CVODE's MSBP), so that a stale rate cannot carry on: benchmarks/MEASUREMENTS.md, "JaxBDF".
RATE_REFRESH = 20
RATE_DECAY = 0.3  # the carried rate falls by at most this factor per measurement (CVODE's CRDOWN): never to 0
LINEAR_TOLERANCE = 0.3
# CVODE's BIAS1-3: the step after q + 1 equal steps is the largest of (BIAS_j · error_j)^(-1/(q + j)) over the
# orders q - 1, q, q + 1 (benchmarks/MEASUREMENTS.md, "JaxBDF: one Gram-Schmidt pass, and CVODE's step-size biases
# and Newton tolerance")
BIAS = (6.0, 6.0, 10.0)
JACOBIAN_PRODUCTS = ("difference", "exact")  # how the Newton solves form J·v (BdfProblem)
ROWS = MAX_ORDER + 3  # D holds the differences of orders 0 .. MAX_ORDER + 2


class BdfProblem(NamedTuple):
    """The flow's field ``vector_field(t, θ, loss)``, the rate schedule's kinks (steps end exactly on them) and how
    the Newton solves form J·v: ``"difference"`` (one field evaluation each) or ``"exact"`` (``jax.linearize``)."""

    vector_field: Callable
    kinks: tuple[float, ...]
    jacobian_products: str = "difference"

    def next_stop(self, t, t_end):
        """The next kink after t, or t_end."""
        kink_times = jnp.asarray(sorted(self.kinks), dtype=float).reshape(-1)
        return jnp.minimum(t_end, jnp.where(kink_times > t, kink_times, jnp.inf).min(initial=jnp.inf))


class BdfState(NamedTuple):
    """Everything the loop carries for one flow."""

    t: jax.Array  # ()
    D: jax.Array  # (ROWS, n) backward differences of the solution at step h, D[0] = y(t)
    h: jax.Array  # () the step the differences are scaled to (the next one to try)
    order: jax.Array  # () int
    n_equal_steps: jax.Array  # () accepted steps since h or the order last changed
    saved: jax.Array  # (n_save, n)
    n_saved: jax.Array  # ()
    status: jax.Array  # () a Status
    n_steps: jax.Array  # () accepted
    n_rejected: jax.Array  # ()
    nfev: jax.Array  # () field evaluations (a linearisation counts one, a difference product one)
    n_products: jax.Array  # () J·v products
    rate: jax.Array  # () the Newton contraction rate the next step's first iteration may trust (1: none)


def _rms(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x)))


# ---------------------------------------------------------------------------------
# The parts


def rescaling_matrix(order, factor) -> jax.Array:
    """The (ROWS, ROWS) matrix M with D ← M D moving the differences of orders 0..q from step h to factor·h
    (scipy's ``change_D``: (R(q, factor) U(q))^T on the first q + 1 rows), the identity on the rest."""
    size = MAX_ORDER + 1
    i = jnp.arange(1, size)[:, None]
    j = jnp.arange(1, size)[None, :]

    def r_matrix(f):
        M = jnp.zeros((size, size)).at[1:, 1:].set((i - 1 - f * j) / i).at[0].set(1.0)
        inside = (jnp.arange(size)[:, None] <= order) & (jnp.arange(size)[None, :] <= order)
        return jnp.where(inside, jnp.cumprod(M, axis=0), 0.0)

    RU = r_matrix(factor) @ r_matrix(1.0)
    rows = jnp.arange(ROWS)
    eye = jnp.eye(ROWS)
    block = eye.at[:size, :size].set(RU.T)
    inside = (rows[:, None] <= order) & (rows[None, :] <= order)
    return jnp.where(inside, block, eye)


def rescale(D: jax.Array, order, factor) -> jax.Array:
    """D moved to step factor·h; O(ROWS² n)."""
    return rescaling_matrix(order, factor) @ D


def gmres(matvec: Callable[[jax.Array], jax.Array], b: jax.Array, tol) -> tuple[jax.Array, jax.Array]:
    """x with ‖b - A x‖₂ <= tol, or the least-squares x over the Krylov space of KRYLOV_DIM products, from x0 = 0.
    Returns (x, products used). Arnoldi with modified Gram-Schmidt over the basis built so far, the
    Hessenberg matrix reduced by Givens rotations as it grows, so the residual is known at each product without
    forming x. (jax.scipy's gmres spends two more products per solve on explicit residuals; a Newton solve here
    often needs only one or two.) Cost: k products and O(k² n) vector work for k products used: only the basis
    vectors built so far are read, not the whole KRYLOV_DIM + 1 rows."""
    size = b.shape[0]
    beta = jnp.linalg.norm(b)
    V = jnp.zeros((KRYLOV_DIM + 1, size)).at[0].set(b / jnp.where(beta > 0, beta, 1.0))
    R = jnp.zeros((KRYLOV_DIM + 1, KRYLOV_DIM))
    rotations = jnp.zeros((KRYLOV_DIM, 2))
    g = jnp.zeros(KRYLOV_DIM + 1).at[0].set(beta)

    def keep_going(carry):
        k, V, R, rotations, g = carry
        return (k < KRYLOV_DIM) & (jnp.abs(g[k]) > tol)

    def orthogonalise(V, k, w, column):
        """w minus its projections on V[0..k], one basis vector at a time; the coefficients added to ``column``."""
        def project(j, carry):
            w, column = carry
            h = V[j] @ w
            return w - h * V[j], column.at[j].add(h)

        return jax.lax.fori_loop(0, k + 1, project, (w, column))

    def arnoldi_step(carry):
        k, V, R, rotations, g = carry
        # one pass: GMRES with modified Gram-Schmidt is backward stable (Paige, Rozložník & Strakoš 2006)
        w, column = orthogonalise(V, k, matvec(V[k]), jnp.zeros(KRYLOV_DIM + 1))
        norm = jnp.linalg.norm(w)
        V = V.at[k + 1].set(jnp.where(norm > 0, w / jnp.where(norm > 0, norm, 1.0), 0.0))
        column = column.at[k + 1].set(norm)

        def rotate(i, column):
            c, s = rotations[i]
            a, b = column[i], column[i + 1]
            return column.at[i].set(c * a + s * b).at[i + 1].set(-s * a + c * b)

        column = jax.lax.fori_loop(0, k, rotate, column)
        radius = jnp.hypot(column[k], column[k + 1])
        c = jnp.where(radius > 0, column[k] / jnp.where(radius > 0, radius, 1.0), 1.0)
        s = jnp.where(radius > 0, column[k + 1] / jnp.where(radius > 0, radius, 1.0), 0.0)
        column = column.at[k].set(radius).at[k + 1].set(0.0)
        g = g.at[k + 1].set(-s * g[k]).at[k].set(c * g[k])
        return k + 1, V, R.at[:, k].set(column), rotations.at[k].set(jnp.array([c, s])), g

    used, V, R, _, g = jax.lax.while_loop(keep_going, arnoldi_step, (jnp.zeros((), jnp.int32), V, R, rotations, g))
    # the unused columns solve to zero: unit diagonal, zero right-hand side
    unused = jnp.arange(KRYLOV_DIM) >= used
    triangle = jnp.where(unused[None, :] | unused[:, None], jnp.eye(KRYLOV_DIM), R[:KRYLOV_DIM])
    coefficients = jax.scipy.linalg.solve_triangular(triangle, jnp.where(unused, 0.0, g[:KRYLOV_DIM]), lower=False)
    x = jax.lax.fori_loop(0, used, lambda j, x: x + coefficients[j] * V[j], jnp.zeros(size))
    return x, used


class NewtonResult(NamedTuple):
    converged: jax.Array
    n_iter: jax.Array
    y: jax.Array
    d: jax.Array  # y - y_predict: the correction, from which the error is estimated
    nfev: jax.Array  # field evaluations, a difference product's included
    n_products: jax.Array
    rate: jax.Array  # the contraction rate to carry to the next step


def difference_product(field_at: Callable, y: jax.Array, f_y: jax.Array, u: jax.Array) -> jax.Array:
    """J(y) u ≈ (f(y + σu) - f(y)) / σ with σ = √ε (1 + ‖y‖) / ‖u‖ (2-norms): a perturbation of about √ε relative
    to y, so truncation and round-off each cost about √ε ‖J u‖. One field evaluation."""
    u_norm = jnp.linalg.norm(u)
    sigma = jnp.sqrt(jnp.finfo(y.dtype).eps) * (1 + jnp.linalg.norm(y)) / jnp.where(u_norm > 0, u_norm, 1.0)
    return (field_at(y + sigma * u) - f_y) / sigma


def newton_solve(field: Callable, t_new, y_predict, c, psi, scale, tol, linear_tol, exact_products: bool = False,
                 rate0=1.0) -> NewtonResult:
    """scipy's ``solve_bdf_system``: at most NEWTON_MAXITER iterations y ← y + Δ, (I - c J) Δ = c f(y) - ψ - d,
    J the field's Jacobian at ``y_predict`` applied by forward differences (``difference_product``) or, with
    ``exact_products``, by ``jax.linearize``; stopped as diverging when the contraction rate ρ >= 1 or
    ρ^(left)/(1-ρ) ‖Δ‖ > tol, converged when ρ/(1-ρ) ‖Δ‖ < tol (norms scaled by ``scale``), or at the first
    iteration when min(1, ρ₀) ‖Δ‖ < tol with ρ₀ = ``rate0`` an earlier step's rate (CVODE's test; ρ₀ = 1 asks for
    ‖Δ‖ < tol). Each Δ is GMRES's in scaled variables, to a residual of ``linear_tol`` (RMS). Returns the rate to
    carry: the last measured, but at least RATE_DECAY times the one before (``rate0`` when one iteration sufficed)."""
    field_at = lambda y: field(t_new, y)  # noqa: E731
    if exact_products:
        f_predict, jvp = jax.linearize(field_at, y_predict)
    else:
        f_predict = field_at(y_predict)
        jvp = lambda u: difference_product(field_at, y_predict, f_predict, u)  # noqa: E731
    size = y_predict.shape[0]
    residual_tol = linear_tol * jnp.sqrt(size)

    def matvec(v):
        return v - c * jvp(v * scale) / scale

    def iterate(carry):
        k, y, d, norm_old, _, _, f, nfev, products, last_rate = carry
        dy_scaled, used = gmres(matvec, (c * f - psi - d) / scale, residual_tol)
        dy_norm = _rms(dy_scaled)
        rate = dy_norm / norm_old
        diverging = (k > 0) & ((rate >= 1) | (rate ** (NEWTON_MAXITER - k) / (1 - rate) * dy_norm > tol))
        dy = jnp.where(diverging, 0.0, dy_scaled * scale)
        y, d = y + dy, d + dy
        first = (k == 0) & (dy_norm * jnp.minimum(1.0, last_rate) < tol)
        converged = ~diverging & ((dy_norm == 0) | first | ((k > 0) & (rate / (1 - rate) * dy_norm < tol)))
        stopped = diverging | converged | (k + 1 >= NEWTON_MAXITER)
        f = jax.lax.cond(stopped, lambda: f, lambda: field(t_new, y))
        done = stopped | ~jnp.all(jnp.isfinite(f))
        last_rate = jnp.where(k > 0, jnp.maximum(RATE_DECAY * last_rate, rate), last_rate)
        return k + 1, y, d, dy_norm, converged, done, f, nfev + (~stopped).astype(jnp.int32), products + used, last_rate

    start = (jnp.zeros((), jnp.int32), y_predict, jnp.zeros_like(y_predict), jnp.array(jnp.nan), jnp.array(False),
             ~jnp.all(jnp.isfinite(f_predict)), f_predict, jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32),
             jnp.asarray(rate0, float))
    k, y, d, _, converged, _, _, nfev, products, last_rate = jax.lax.while_loop(lambda c: ~c[5], iterate, start)
    return NewtonResult(converged, k, y, d, nfev if exact_products else nfev + products, products, last_rate)


def order_change(order, error_norm, D, scale):
    """The order and step after ``order + 1`` equal steps: among q - 1, q, q + 1, the order whose error estimate
    e_j (scipy's: ERROR_CONST × the differences D[q], d, D[q + 2]) allows the largest step, by CVODE's rule
    factor_j = (BIAS_j e_j)^(-1/(q + j)), j = 0, 1, 2, the factor capped at MAX_FACTOR; order and step stay when no
    factor reaches 1 (CVODE keeps them below its THRESH = 1.5). Returns (new order, factor)."""
    constants = jnp.asarray(ERROR_CONST)
    below = jnp.where(order > 1, _rms(constants[jnp.maximum(order - 1, 0)] * D[order] / scale), jnp.inf)
    above = jnp.where(order < MAX_ORDER, _rms(constants[jnp.minimum(order + 1, MAX_ORDER)] * D[order + 2] / scale), jnp.inf)
    norms = jnp.asarray(BIAS) * jnp.stack([below, error_norm, above])
    factors = norms ** (-1.0 / (order + jnp.arange(3)))
    grows = jnp.max(factors) >= 1.0
    new_order = jnp.where(grows, order + jnp.argmax(factors) - 1, order).astype(order.dtype)
    return new_order, jnp.where(grows, jnp.minimum(MAX_FACTOR, jnp.max(factors)), 1.0)


def interpolate(D: jax.Array, t, h, order, tau) -> jax.Array:
    """The interpolating polynomial of the last step at τ (scipy's ``BdfDenseOutput``): D[0] + Σ_j D[j] Π_{i<j}
    (τ - (t - i h)) / ((i + 1) h), j = 1..q. Exact at τ = t."""
    shifts = jnp.arange(MAX_ORDER)
    products = jnp.cumprod((tau - (t - h * shifts)) / (h * (1 + shifts)))
    return D[0] + jnp.where(shifts < order, products, 0.0) @ D[1:MAX_ORDER + 1]


def differences_after_step(D: jax.Array, d: jax.Array, order) -> jax.Array:
    """scipy's update of the differences after an accepted step with correction d:
    D[q+2] = d - D[q+1], D[q+1] = d, then D[i] += D[i+1] for i = q .. 0."""
    D = D.at[order + 2].set(d - D[order + 1]).at[order + 1].set(d)
    rows = jnp.arange(ROWS)
    summed = (rows[None, :] >= rows[:, None]) & (rows[None, :] <= order + 1)
    return jnp.where((rows <= order)[:, None], summed.astype(D.dtype) @ D, D)


# ---------------------------------------------------------------------------------
# The loop


def init_state(problem: BdfProblem, y0, loss, times, t_end, rtol, atol) -> BdfState:
    """Order 1 at t = times[0] with scipy's first step (status NON_FINITE where f(t0, y0) is not finite)."""
    t0 = times[0]
    field = lambda t, y: problem.vector_field(t, y, loss)  # noqa: E731
    f0 = field(t0, y0)
    h = select_initial_step(field, t0, y0, f0, t_end, rtol, atol, order=1)
    D = jnp.zeros((ROWS, y0.shape[0])).at[0].set(y0).at[1].set(f0 * h)
    zero = jnp.zeros((), jnp.int32)
    return BdfState(t=t0, D=D, h=h, order=jnp.ones((), jnp.int32), n_equal_steps=zero,
                    saved=jnp.zeros((len(times), y0.shape[0])).at[0].set(y0), n_saved=jnp.ones((), jnp.int32),
                    status=jnp.where(jnp.all(jnp.isfinite(f0)), RUNNING, NON_FINITE).astype(jnp.int32),
                    n_steps=zero, n_rejected=zero, nfev=zero + 2, n_products=zero, rate=jnp.ones(()))


def write_saves(saved, n_saved, accepted, t_new, D, h, order, times):
    """The save times in (t, t_new] from an accepted step's interpolating polynomial (none after a rejected
    one), written in place. Returns (saved, n_saved)."""
    n_save = saved.shape[0]

    def pending(carry):
        return accepted & (carry[1] < n_save) & (times[jnp.minimum(carry[1], n_save - 1)] <= t_new)

    def write_next(carry):
        saved, n_saved = carry
        return saved.at[n_saved].set(interpolate(D, t_new, h, order, times[n_saved])), n_saved + 1

    return jax.lax.while_loop(pending, write_next, (saved, n_saved))


def attempt_step(problem: BdfProblem, state: BdfState, loss, times, t_end, rtol, atol, max_attempts) -> BdfState:
    """One step attempt (scipy's ``BDF._step_impl`` with one Newton try per attempt: its Jacobian is always
    current): accepted, or rejected with h shrunk by the error estimate or halved after a failed Newton solve."""
    field = lambda t, y: problem.vector_field(t, y, loss)  # noqa: E731
    t, order = state.t, state.order
    stop = problem.next_stop(t, t_end)
    h = jnp.minimum(state.h, stop - t)  # ends exactly on a kink or t_end
    clipped = h < state.h
    D = jax.lax.cond(clipped, lambda: rescale(state.D, order, h / state.h), lambda: state.D)
    n_equal = jnp.where(clipped, 0, state.n_equal_steps)
    too_small = h < 10 * jnp.abs(jnp.nextafter(t, jnp.inf) - t)
    t_new = jnp.where(clipped, stop, t + h)

    below = (jnp.arange(ROWS) <= order)[:, None]
    y_predict = jnp.sum(jnp.where(below, D, 0.0), axis=0)
    scale = atol + rtol * jnp.abs(y_predict)
    rows = jnp.arange(ROWS)
    psi = jnp.where((rows >= 1) & (rows <= order), jnp.asarray(np.pad(GAMMA, (0, ROWS - len(GAMMA)))), 0.0) @ D
    psi = psi / jnp.asarray(ALPHA)[order]
    c = h / jnp.asarray(ALPHA)[order]
    newton = newton_solve(field, t_new, y_predict, c, psi, scale, NEWTON_TOLERANCE / jnp.asarray(ERROR_CONST)[order],
                          LINEAR_TOLERANCE * NEWTON_TOLERANCE, exact_products=problem.jacobian_products == "exact",
                          rate0=state.rate)

    safety = 0.9 * (2 * NEWTON_MAXITER + 1) / (2 * NEWTON_MAXITER + newton.n_iter)
    scale = atol + rtol * jnp.abs(newton.y)
    error = _rms(jnp.asarray(ERROR_CONST)[order] * newton.d / scale)
    accept = newton.converged & (error <= 1) & ~too_small
    shrink = jnp.where(newton.converged, jnp.maximum(MIN_FACTOR, safety * error ** (-1.0 / (order + 1))), 0.5)

    D_accepted = differences_after_step(D, newton.d, order)
    changes = n_equal + 1 >= order + 1
    # the order change's norms and the rescalings only when used: fewer kernels a step (MEASUREMENTS, JaxBDF at d = 64)
    new_order, grow = jax.lax.cond(changes & accept, lambda: order_change(order, error, D_accepted, scale),
                                   lambda: (order, jnp.ones((), D.dtype)))
    factor = jnp.where(accept, jnp.where(changes, grow, 1.0), shrink)
    D_next = jnp.where(accept, D_accepted, D)
    D_next = jax.lax.cond(factor != 1.0, lambda: rescale(D_next, jnp.where(accept, new_order, order), factor),
                          lambda: D_next)
    h_next = h * factor

    saved, n_saved = write_saves(state.saved, state.n_saved, accept, t_new, D_next, h_next, new_order, times)
    attempts = state.n_steps + state.n_rejected + 1
    status = jnp.where(too_small, SOLVER_FAILED, state.status)
    status = jnp.where(accept & (t_new >= t_end), FINISHED, status)
    status = jnp.where((status == RUNNING) & (attempts >= max_attempts), STEP_LIMIT, status)
    count = lambda value: value.astype(jnp.int32)  # noqa: E731
    return BdfState(
        t=jnp.where(accept, t_new, t), D=D_next, h=h_next, order=count(jnp.where(accept, new_order, order)),
        n_equal_steps=count(jnp.where(accept & ~changes, n_equal + 1, 0)), saved=saved, n_saved=n_saved,
        status=count(status), n_steps=state.n_steps + count(accept), n_rejected=state.n_rejected + count(~accept),
        nfev=count(state.nfev + newton.nfev), n_products=count(state.n_products + newton.n_products),
        rate=jnp.where(accept & ((state.n_steps + 1) % RATE_REFRESH != 0), newton.rate, 1.0),
    )


def advance(problem: BdfProblem, state: BdfState, loss, times, t_end, t_stop, rtol, atol, max_attempts,
            chunk_attempts) -> BdfState:
    """Step until the flow stops or reaches ``t_stop``, or after ``chunk_attempts`` attempts in this call
    (the steps are the same however the loop is cut)."""

    def keep_going(carry):
        state, attempts = carry
        return (state.status == RUNNING) & (state.t < t_stop) & (attempts < chunk_attempts)

    def step(carry):
        state, attempts = carry
        return attempt_step(problem, state, loss, times, t_end, rtol, atol, max_attempts), attempts + 1

    return jax.lax.while_loop(keep_going, step, (state, jnp.zeros((), jnp.int32)))[0]


class BdfFunctions(NamedTuple):
    """The compiled entry points for one flow structure and number of save slots."""

    init: Callable
    advance: Callable
    compile_seconds: float


def build_bdf(problem: BdfProblem, n_save: int, size: int, loss) -> BdfFunctions:
    """Compile ``init(y0, loss, times, t_end, rtol, atol)`` and ``advance(state, loss, times, t_end, t_stop, rtol,
    atol, max_attempts, chunk_attempts)`` for a flow of ``size`` parameters saved at ``n_save`` times."""

    def init(y0, loss, times, t_end, rtol, atol):
        return init_state(problem, y0, loss, times, t_end, rtol, atol)

    def advance_problem(state, loss, times, t_end, t_stop, rtol, atol, max_attempts, chunk_attempts):
        return advance(problem, state, loss, times, t_end, t_stop, rtol, atol, max_attempts, chunk_attempts)

    started = time.perf_counter()
    y_example, times_example, scalar = jnp.zeros(size), jnp.zeros(n_save), jnp.zeros(())
    init_compiled = compile_loop(jax.jit(init).lower(y_example, loss, times_example, scalar, scalar, scalar), size)
    state_example = jax.eval_shape(init, y_example, loss, times_example, scalar, scalar, scalar)
    count = jnp.zeros((), jnp.int32)
    advance_compiled = compile_loop(jax.jit(advance_problem, donate_argnums=0).lower(
        state_example, loss, times_example, scalar, scalar, scalar, scalar, count, count), size)
    return BdfFunctions(init_compiled, advance_compiled, time.perf_counter() - started)
