"""Radau IIA of order 5, compiled end to end in JAX, for a batch of gradient flows.

The implicit Runge-Kutta method of Hairer & Wanner (RADAU5, the method of scipy's
``Radau``), with one change that suits gradient flows: the Jacobian
J = -diag(r) ∇²L is diagonalised, J = V diag(λ) V⁻¹, instead of LU-factorised. Each
simplified-Newton system (μ/h - J) x = b then costs two matrix products, for any step
size h, so h changes freely and J is recomputed only when the Newton iteration
converges slowly. The three stage evaluations of a Newton iteration run as one batch.

The method is a handful of module-level parts, each a pure function of arrays with a
leading batch axis B and testable alone:

    initial_step_size      scipy's select_initial_step for an order-5 method
    solve_newton_systems   (μ/h - J)^-1 for the real and the complex Newton system
    newton_solve           the simplified Newton iteration on the collocation system
    error_norm             the embedded error estimate (refined after a rejection)
    next_step_size         Hairer's predictive (Gustafsson) step-size controller, its growth
                           capped by the Newton contraction rate (``NewtonControl``)
    dense_output           the collocation polynomial at the save times
    refresh_eigensystems   recompute (V, V⁻¹, λ) for the members that need it

``attempt_step`` composes them into one step attempt, ``advance`` loops it in
``lax.while_loop`` with no host round trip, and ``build_radau`` compiles ``init`` and
``advance``. ``advance`` stops once every member has reached a given time, so a caller
can show progress and checkpoint between calls without changing the steps.

A batch is B flows of one structure (``GradientFlow.structure_key``: the same model and
rates, different chains and starts). Each member keeps its own t, h and Jacobian and
takes exactly the steps it takes alone; a Jacobian is recomputed only for the members
that need one. Member status is ``flowsim.solve.status.Status``.

Cost per Newton iteration: three vector-field evaluations and O(n k) for the solve,
with k the rank of the eigensystem kept (n for a full one, ``solvers.stiff_rank(n)`` otherwise).
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flowsim.solve.status import Status

RUNNING, FINISHED, STEP_LIMIT, NON_FINITE, SOLVER_FAILED = (
    int(Status.RUNNING), int(Status.FINISHED), int(Status.STEP_LIMIT), int(Status.NON_FINITE), int(Status.SOLVER_FAILED))

S6 = 6**0.5
C = np.array([(4 - S6) / 10, (4 + S6) / 10, 1.0])  # collocation nodes
E = np.array([-13 - 7 * S6, -13 + 7 * S6, -1.0]) / 3  # error estimator weights
MU_REAL = 3 + 3 ** (2 / 3) - 3 ** (1 / 3)  # eigenvalues of the inverse Butcher matrix
MU_COMPLEX = 3 + 0.5 * (3 ** (1 / 3) - 3 ** (2 / 3)) - 0.5j * (3 ** (5 / 6) + 3 ** (7 / 6))
T = np.array([
    [0.09443876248897524, -0.14125529502095421, 0.03002919410514742],
    [0.25021312296533332, 0.20412935229379994, -0.38294211275726192],
    [1.0, 1.0, 0.0],
])
TI = np.array([
    [4.17871859155190428, 0.32768282076106237, 0.52337644549944951],
    [-4.17871859155190428, -0.32768282076106237, 0.47662355450055044],
    [0.50287263494578682, -2.57192694985560522, 0.59603920482822492],
])
# Dense output: y(t_old + x h) = y_old + Z^T P [x, x², x³].
P = np.array([
    [13 / 3 + 7 * S6 / 3, -23 / 3 - 22 * S6 / 3, 10 / 3 + 5 * S6],
    [13 / 3 - 7 * S6 / 3, -23 / 3 + 22 * S6 / 3, 10 / 3 - 5 * S6],
    [1 / 3, -8 / 3, 10 / 3],
])
# The Newton iteration runs until it converges, diverges (rate >= 1) or reaches this count.
# Hairer's and scipy's early exit (a rate too slow to converge within 6 iterations) fails
# many steps of the stiff phase here, and each failure costs a Jacobian and a retried
# step; a few more iterations cost less (benchmarks/MEASUREMENTS.md).
NEWTON_MAXITER = 10
MIN_FACTOR, MAX_FACTOR = 0.2, 10.0


class Eigensystem(NamedTuple):
    """J = V diag(λ) V⁻¹ on the range of V (J treated as 0 on its complement)."""

    V: jax.Array  # (n, k) or batched (B, n, k)
    V_inv: jax.Array  # (k, n) or (B, k, n)
    lam: jax.Array  # (k,) or (B, k)
    # A lagged low-rank eigensystem's next subspace, one sweep ahead ((n, k), R⁻¹ scaled);
    # (n, 0) for the others.
    ahead: jax.Array


class RadauState(NamedTuple):
    """Everything the loop carries, each with a leading batch axis B."""

    t: jax.Array  # (B,)
    y: jax.Array  # (B, n)
    f: jax.Array  # (B, n)  f(t, y)
    h: jax.Array  # (B,)    next step size to try
    h_old: jax.Array  # (B,) last accepted step (nan before the first)
    error_old: jax.Array  # (B,) its error norm (nan before the first)
    rejected: jax.Array  # (B,) the last attempt was rejected
    t_old: jax.Array  # (B,)   start of the last accepted step
    y_old: jax.Array  # (B, n) state there
    Z: jax.Array  # (B, 3, n) its stage increments (dense output and Newton guesses)
    jacobian: Eigensystem  # of J, batched
    jacobian_is_current: jax.Array  # (B,) J was computed at the current (t, y)
    contraction: jax.Array  # (B,) θ/(1-θ) of the last Newton solve (θ its contraction rate)
    saved: jax.Array  # (B, n_save, n)
    n_saved: jax.Array  # (B,)
    status: jax.Array  # (B,) a Status
    n_steps: jax.Array  # (B,) accepted
    n_rejected: jax.Array  # (B,)
    nfev: jax.Array  # (B,)
    njev: jax.Array  # (B,)


class NewtonControl(NamedTuple):
    """How the step size and the Jacobian follow the simplified Newton iteration.

    After an accepted step, h grows at most to h · ``rate_target`` / (the solve's contraction
    rate) (``next_step_size``). A Jacobian costs tens of stage evaluations, so it is recomputed
    only after a slow solve: more than ``recompute_after_iterations`` iterations at a rate above
    ``recompute_above_rate`` (scipy: more than 2 iterations at rate 1e-3). ``LARGE_FLOW_CONTROL``
    suits flows with more stiff directions than the eigensystem keeps (benchmarks/MEASUREMENTS.md)."""

    rate_target: float = 0.2
    recompute_after_iterations: int = 4
    recompute_above_rate: float = 0.1


LARGE_FLOW_CONTROL = NewtonControl(rate_target=0.1, recompute_after_iterations=6, recompute_above_rate=0.2)


class RadauProblem(NamedTuple):
    """The functions of one member that the loop calls, and the rate schedule's kinks.

    ``vector_field(t, θ, loss)`` is f; ``eigensystem(t, θ, loss, previous, first)`` returns
    the ``Eigensystem`` of J at (t, θ) (``previous`` is the last one, ``first`` marks the
    first call); steps end exactly on the ``kinks``. ``sequential_stages`` evaluates the
    three stages one after another instead of as one vectorised batch: for large flows the
    batched form's products run slower than three plain ones (benchmarks/MEASUREMENTS.md).
    ``newton`` sets the step-size cap and the Jacobian refreshes (``NewtonControl``)."""

    vector_field: Callable
    eigensystem: Callable
    kinks: tuple[float, ...]
    sequential_stages: bool = False
    newton: NewtonControl = NewtonControl()

    def field_batch(self, t, y, loss):
        return jax.vmap(self.vector_field)(t, y, loss)

    def field_stages(self, t, y, loss):
        """f at (B, 3) stage times and (B, 3, n) stage states."""
        if self.sequential_stages:
            def member(t, y, loss):
                return jax.lax.map(lambda stage: self.vector_field(stage[0], stage[1], loss), (t, y))

            return jax.vmap(member)(t, y, loss)
        return jax.vmap(jax.vmap(self.vector_field, in_axes=(0, 0, None)))(t, y, loss)

    def next_stop(self, t, t_end):
        """The next kink after t, or t_end."""
        kink_times = jnp.asarray(sorted(self.kinks), dtype=float).reshape(-1)
        later = jnp.where(kink_times[None, :] > t[:, None], kink_times[None, :], jnp.inf)
        return jnp.minimum(t_end, later.min(axis=1, initial=jnp.inf))


def _rms(x: jax.Array, axes) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=axes))


def _batched_matvec(matrix: jax.Array, vectors: jax.Array) -> jax.Array:
    """(B, n, n) times (B, n, k) -> (B, n, k)."""
    return jnp.einsum("bij,bjk->bik", matrix, vectors)


def _apply_inverse(eigen: Eigensystem, b, m):
    """(m - J)^-1 b per member, for J = V diag(λ) V^-1 on the range of V and 0 on its
    complement (exact when V is square); b (B, n), m (B,)."""
    V, V_inv, lam, _ = eigen
    m = m[:, None]
    return b / m + _batched_matvec(V, (_batched_matvec(V_inv, b[..., None])[..., 0] * (1 / (m - lam) - 1 / m))[..., None])[..., 0]


def solve_real_system(eigen: Eigensystem, b, m_real):
    """(m - J)^-1 b for real b and m (a complex eigensystem leaves rounding in the imaginary part)."""
    x = _apply_inverse(eigen, b, m_real)
    return x.real if jnp.iscomplexobj(x) else x


def solve_newton_systems(eigen: Eigensystem, rhs, m_real, m_complex_re, m_complex_im):
    """The two Newton systems of Radau IIA, (m_real - J) x = b_real and (m_complex - J) z =
    b_complex, with every complex vector stored as its real and imaginary parts:
    rhs = (b_real, Re b_complex, Im b_complex) of shape (B, 3, n) -> (x, Re z, Im z).
    XLA on the CPU runs complex products far slower than real ones, so a real
    eigensystem keeps the whole solve real. Cost O(n k) per member."""
    V, V_inv, lam, _ = eigen
    if jnp.iscomplexobj(lam):
        x = solve_real_system(eigen, rhs[:, 0], m_real)
        z = _apply_inverse(eigen, rhs[:, 1] + 1j * rhs[:, 2], m_complex_re + 1j * m_complex_im)
        return jnp.stack([x, z.real, z.imag], axis=1)
    m_r, a, b = m_real[:, None], m_complex_re[:, None], m_complex_im[:, None]
    # (m - J)^-1 = 1/m + V diag(1/(m - λ) - 1/m) V^-1, with m = a + ib for the complex system.
    coefficients = jnp.einsum("bkn,bjn->bjk", V_inv, rhs)
    c_real = coefficients[:, 0] * (1 / (m_r - lam) - 1 / m_r)
    shifted, size = (a - lam) ** 2 + b**2, a**2 + b**2
    d_re, d_im = (a - lam) / shifted - a / size, -b / shifted + b / size
    c_re = coefficients[:, 1] * d_re - coefficients[:, 2] * d_im
    c_im = coefficients[:, 1] * d_im + coefficients[:, 2] * d_re
    x = jnp.einsum("bnk,bjk->bjn", V, jnp.stack([c_real, c_re, c_im], axis=1))
    base_re = (rhs[:, 1] * a + rhs[:, 2] * b) / size
    base_im = (rhs[:, 2] * a - rhs[:, 1] * b) / size
    return x + jnp.stack([rhs[:, 0] / m_r, base_re, base_im], axis=1)


# ---------------------------------------------------------------------------------
# Eigensystems of J: eigensystem(t, θ, loss, previous, first) -> Eigensystem


def symmetric_eigensystem(rate_vector: Callable, hessian: Callable) -> Callable:
    """All of J = -R K R^-1, K = R H R, R = diag(√r): one symmetric eigenproblem of size n, O(n³)."""

    def eigensystem(t, theta, loss, previous, first=False):
        root = jnp.sqrt(rate_vector(t))
        curvature, basis = jnp.linalg.eigh(root[:, None] * hessian(theta, loss) * root[None, :])
        return Eigensystem(root[:, None] * basis, basis.T / root[None, :], -curvature, jnp.zeros((theta.size, 0)))

    return eigensystem


def general_eigensystem(jacobian: Callable) -> Callable:
    """All of a general J, in complex arithmetic (depth smoothing, zero rates), O(n³)."""

    def eigensystem(t, theta, loss, previous, first=False):
        values, vectors = jnp.linalg.eig(jacobian(t, theta, loss))
        return Eigensystem(vectors, jnp.linalg.inv(vectors), values, jnp.zeros((theta.size, 0), values.dtype))

    return eigensystem


def low_rank_eigensystem(rate_vector: Callable, gradient: Callable, size: int, rank: int,
                         first_iterations: int = 20, lagged: bool = False) -> Callable:
    """The ``rank`` eigenpairs of K = R H R largest in magnitude (J = -R K R^-1), by
    subspace iteration on Hessian-vector products, then Rayleigh-Ritz. The Newton solves
    treat J as 0 off this subspace: exact for the stiff directions, and the simplified
    Newton iteration absorbs the rest.

    ``gradient(θ, loss)`` is ∇L; it is linearised once per call, so the products share
    one forward pass. The first call (``first``) runs ``first_iterations`` sweeps from a
    random basis; a later call, one sweep from the last basis, then Rayleigh-Ritz: 2 ``rank``
    Hessian-vector products and O(n rank²). ``lagged`` halves that: the products K B of a
    call's Rayleigh-Ritz also give its next subspace, qr(K B) (kept as ``ahead``), so a later
    call applies K once, to that subspace (the sweep made with the last point's K). Large
    flows, whose refreshes cost most, gain; at the paper's sizes the lag costs more Jacobians
    than it saves (benchmarks/MEASUREMENTS.md)."""
    start = jnp.asarray(np.linalg.qr(np.random.default_rng(0).standard_normal((size, rank)))[0])

    def eigensystem(t, theta, loss, previous, first=False):
        root = jnp.sqrt(rate_vector(t))
        _, hessian_product = jax.linearize(lambda x: gradient(x, loss), theta)
        apply_k = jax.vmap(lambda v: root * hessian_product(root * v), in_axes=1, out_axes=1)
        sweep = lambda basis: jnp.linalg.qr(apply_k(basis))[0]  # noqa: E731
        if first:
            basis = jax.lax.fori_loop(0, first_iterations, lambda _, basis: sweep(basis), start)
        elif lagged:
            basis = jnp.linalg.qr(previous.ahead)[0]
        else:
            # The last basis spans R_old^-1 U_old: the stiff directions, up to the change of rates.
            basis = sweep(jnp.linalg.qr(previous.V_inv.T)[0])
        product = apply_k(basis)
        projected = basis.T @ product
        curvature, rotation = jnp.linalg.eigh(0.5 * (projected + projected.T))
        vectors = basis @ rotation
        ahead = jnp.linalg.qr(product)[0] / root[:, None] if lagged else jnp.zeros((size, 0))
        return Eigensystem(root[:, None] * vectors, vectors.T / root[None, :], -curvature, ahead)

    return eigensystem


def refresh_eigensystems(eigensystem: Callable, state: RadauState, need: jax.Array, loss, first: bool = False) -> RadauState:
    """Recompute the eigensystem of J at (t, y) for the members flagged in ``need``, one by one."""

    def refresh_one(carry):
        state, need = carry
        i = jnp.argmax(need)
        loss_i = jax.tree_util.tree_map(lambda leaf: leaf[i], loss)
        previous = jax.tree_util.tree_map(lambda leaf: leaf[i], state.jacobian)
        fresh = eigensystem(state.t[i], state.y[i], loss_i, previous, first)
        jacobian = jax.tree_util.tree_map(lambda batched, value: batched.at[i].set(value), state.jacobian, Eigensystem(*fresh))
        state = state._replace(jacobian=jacobian, jacobian_is_current=state.jacobian_is_current.at[i].set(True),
                               njev=state.njev.at[i].add(1))
        return state, need.at[i].set(False)

    # The cond keeps XLA from paying for the loop on the (most) steps that need no Jacobian.
    return jax.lax.cond(jnp.any(need), lambda s: jax.lax.while_loop(lambda c: jnp.any(c[1]), refresh_one, (s, need))[0],
                        lambda s: s, state)


# ---------------------------------------------------------------------------------
# The parts of one step


def collocation_weights(x: jax.Array) -> jax.Array:
    """w(x) = P [x, x², x³], so the collocation polynomial is y_old + Σ_i w_i(x) Z_i at t_old + x h."""
    return jnp.stack([x, x**2, x**3], axis=-1) @ jnp.asarray(P).T


def select_initial_step(field: Callable, t0, y0, f0, t_end, rtol, atol, order: int) -> jax.Array:
    """The first step from t0 of one flow, as scipy's select_initial_step for a method of ``order`` (one more
    evaluation of ``field(t, y)``)."""
    scale = atol + jnp.abs(y0) * rtol
    d0, d1 = _rms(y0 / scale, None), _rms(f0 / scale, None)
    h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / jnp.where(d1 > 0, d1, 1.0))
    f1 = field(t0 + h0, y0 + h0 * f0)
    d2 = _rms((f1 - f0) / scale, None) / h0
    h1 = jnp.where((d1 <= 1e-15) & (d2 <= 1e-15), jnp.maximum(1e-6, h0 * 1e-3),
                   (0.01 / jnp.maximum(d1, d2)) ** (1 / (order + 1)))
    return jnp.minimum(jnp.minimum(100 * h0, h1), t_end - t0)


def initial_step_size(problem: RadauProblem, t0, y0, f0, loss, t_end, rtol, atol) -> jax.Array:
    """Each member's first step from t0 (``select_initial_step`` for a method of order 5)."""
    def member(t0, y0, f0, loss):
        return select_initial_step(lambda t, y: problem.vector_field(t, y, loss), t0, y0, f0, t_end, rtol, atol, order=5)

    return jax.vmap(member)(t0, y0, f0, loss)


class NewtonCarry(NamedTuple):
    """The state of the simplified Newton iteration, per member."""

    iteration: jax.Array  # () iterations run so far (for the batch)
    W: jax.Array  # (B, 3, n) transformed stage increments T^-1 Z
    Z: jax.Array  # (B, 3, n) stage increments
    norm_old: jax.Array  # (B,) last increment norm (nan before the first)
    rate: jax.Array  # (B,) last contraction rate
    contraction: jax.Array  # (B,) θ/(1-θ)
    iterating: jax.Array  # (B,) still iterating
    converged: jax.Array  # (B,)
    n_iter: jax.Array  # (B,) iterations this member ran
    nfev: jax.Array  # (B,)


class NewtonResult(NamedTuple):
    converged: jax.Array
    n_iter: jax.Array
    Z: jax.Array
    rate: jax.Array
    contraction: jax.Array
    nfev: jax.Array


def newton_solve(problem: RadauProblem, eigen: Eigensystem, t, y, h, Z0, scale, newton_tol, contraction, active, nfev,
                 loss) -> NewtonResult:
    """Simplified Newton on the collocation system, as scipy's solve_collocation_system but
    without its early exit on a slow rate (see NEWTON_MAXITER). ``contraction`` is the last
    solve's θ/(1-θ), used to judge the first iteration (Hairer's test)."""
    m_real, m_complex_re, m_complex_im = MU_REAL / h, MU_COMPLEX.real / h, MU_COMPLEX.imag / h
    stage_times = t[:, None] + h[:, None] * jnp.asarray(C)[None, :]
    ti_matrix, t_matrix = jnp.asarray(TI), jnp.asarray(T)

    def iterate(c: NewtonCarry) -> NewtonCarry:
        F = problem.field_stages(stage_times, y[:, None, :] + c.Z, loss)
        finite = jnp.all(jnp.isfinite(F), axis=(1, 2))
        # TI F - diag(m_real, m_complex) W, the complex row as its real and imaginary parts
        a, b = m_complex_re[:, None], m_complex_im[:, None]
        W = c.W
        rhs = jnp.einsum("ij,bjn->bin", ti_matrix, F) - jnp.stack(
            [m_real[:, None] * W[:, 0], a * W[:, 1] - b * W[:, 2], a * W[:, 2] + b * W[:, 1]], axis=1)
        dW = solve_newton_systems(eigen, rhs, m_real, m_complex_re, m_complex_im)
        norm = _rms(dW / scale[:, None, :], (1, 2))
        new_rate = jnp.where(jnp.isnan(c.norm_old), jnp.nan, norm / c.norm_old)
        diverging = ~jnp.isnan(new_rate) & (new_rate >= 1)
        update = c.iterating & finite & ~diverging
        W = jnp.where(update[:, None, None], W + dW, W)
        Z = jnp.where(update[:, None, None], jnp.einsum("ij,bjn->bin", t_matrix, W), c.Z)
        contraction = jnp.where(update & ~jnp.isnan(new_rate), new_rate / (1 - new_rate), c.contraction)
        done = (norm == 0) | (contraction * norm < newton_tol)
        return NewtonCarry(
            iteration=c.iteration + 1, W=W, Z=Z, norm_old=jnp.where(update, norm, c.norm_old),
            rate=jnp.where(c.iterating, new_rate, c.rate), contraction=contraction, iterating=update & ~done,
            converged=c.converged | (update & done), n_iter=jnp.where(c.iterating, c.iteration + 1, c.n_iter),
            nfev=c.nfev + 3 * c.iterating,
        )

    batch = t.shape[0]
    nan = jnp.full(batch, jnp.nan)
    start = NewtonCarry(
        iteration=0, W=jnp.einsum("ij,bjn->bin", ti_matrix, Z0), Z=Z0, norm_old=nan, rate=nan,
        contraction=jnp.maximum(contraction, jnp.finfo(float).eps) ** 0.8, iterating=active,
        converged=jnp.zeros(batch, bool), n_iter=jnp.zeros(batch, jnp.int32), nfev=nfev,
    )
    carry = jax.lax.while_loop(lambda c: (c.iteration < NEWTON_MAXITER) & jnp.any(c.iterating), iterate, start)
    return NewtonResult(carry.converged, carry.n_iter, carry.Z, carry.rate, carry.contraction, carry.nfev)


def error_norm(problem: RadauProblem, eigen: Eigensystem, t, y, y_new, f, Z, h, refine_if, rtol, atol, loss):
    """The scaled RMS norm of the embedded error estimate (m_real - J)^-1 (f + Σ e_i Z_i / h).
    Where ``refine_if`` and the first estimate exceeds 1, it is refined with one more evaluation
    (Hairer's choice after a rejection). Returns (norm, evaluations spent per member)."""
    ZE = jnp.einsum("bsn,s->bn", Z, jnp.asarray(E)) / h[:, None]
    m_real = MU_REAL / h
    error = solve_real_system(eigen, f + ZE, m_real)
    scale = atol + jnp.maximum(jnp.abs(y), jnp.abs(y_new)) * rtol
    norm = _rms(error / scale, 1)
    refine = refine_if & (norm > 1)

    def refined(_):
        error2 = solve_real_system(eigen, problem.field_batch(t, y + error, loss) + ZE, m_real)
        return jnp.where(refine, _rms(error2 / scale, 1), norm)

    norm = jax.lax.cond(jnp.any(refine), refined, lambda _: norm, None)
    return jnp.where(jnp.isfinite(norm), norm, jnp.inf), refine


def predict_factor(h, h_old, error, error_old):
    """Step-size factor of Hairer's predictive (Gustafsson) controller, as in scipy."""
    multiplier = jnp.where(jnp.isnan(h_old) | jnp.isnan(error_old) | (error == 0), 1.0,
                           h / h_old * (error_old / jnp.where(error == 0, 1.0, error)) ** 0.25)
    # a zero error allows any growth (scipy: 0 ** -0.25 = inf); the step is then capped at MAX_FACTOR
    return jnp.minimum(1.0, multiplier) * jnp.where(error == 0, jnp.inf, jnp.where(error == 0, 1.0, error) ** -0.25)


def next_step_size(h, h_old, error, error_old, n_iter, accept, reject, halve, h_untouched, newton_rate,
                   rate_target: float):
    """The next step to try: grown or shrunk by the controller (with a safety factor that falls
    with the Newton iterations spent) after an accepted or rejected step, halved after a failed
    Newton solve on a current Jacobian, ``h_untouched`` otherwise.

    After an accepted step, growth is also capped so that the next Newton solve contracts at
    about ``rate_target``: with an approximate Jacobian (the low-rank eigensystem treats J as
    0 off its subspace) the contraction rate grows about linearly with h, so the cap is
    h · rate_target / rate (Gustafsson & Söderlind 1997). Without it the error
    controller grows h past the point where Newton converges, and each failed solve costs up
    to NEWTON_MAXITER iterations, a Jacobian and a retried step."""
    safety = 0.9 * (2 * NEWTON_MAXITER + 1) / (2 * NEWTON_MAXITER + n_iter)
    factor = predict_factor(h, h_old, error, error_old)
    h_rejected = h * jnp.maximum(MIN_FACTOR, safety * factor)
    measured = jnp.isfinite(newton_rate) & (newton_rate > 0)  # nan after a one-iteration solve
    newton_cap = jnp.where(measured, jnp.maximum(1.0, rate_target / jnp.where(measured, newton_rate, 1.0)), jnp.inf)
    h_accepted = h * jnp.minimum(jnp.minimum(MAX_FACTOR, safety * factor), newton_cap)
    return jnp.where(accept, h_accepted, jnp.where(reject, h_rejected, jnp.where(halve, 0.5 * h, h_untouched)))


def dense_output(saved, n_saved, accepted, t, y, h, t_new, Z, times):
    """Write the save times in (t, t_new] of the accepted members from the collocation polynomial
    y + Σ_i w_i((τ - t)/h) Z_i (the step's end exactly where τ = t_new). Returns (saved, n_saved)."""
    n_save = saved.shape[1]
    member = jnp.arange(saved.shape[0])

    def pending(carry):
        saved, n_saved = carry
        index = jnp.minimum(n_saved, n_save - 1)
        return accepted & (n_saved < n_save) & (times[index] <= t_new)

    def write_next(carry):
        saved, n_saved = carry
        write = pending(carry)
        index = jnp.minimum(n_saved, n_save - 1)
        x = (times[index] - t) / h
        value = y + jnp.einsum("bi,bin->bn", collocation_weights(x), Z)
        value = jnp.where((times[index] == t_new)[:, None], y + Z[:, 2], value)
        saved = saved.at[member, jnp.where(write, index, n_save)].set(value, mode="drop")
        return saved, n_saved + write

    return jax.lax.while_loop(lambda c: jnp.any(pending(c)), write_next, (saved, n_saved))


# ---------------------------------------------------------------------------------
# The loop


def init_state(problem: RadauProblem, y0, loss, times, t_end, rtol, atol) -> RadauState:
    """The state at t = 0 (status NON_FINITE where f(0, y0) is not finite), with each
    active member's first eigensystem."""
    batch, size = y0.shape
    t0 = jnp.full(batch, times[0])  # the first save time is the start
    f0 = problem.field_batch(t0, y0, loss)
    h = initial_step_size(problem, t0, y0, f0, loss, t_end, rtol, atol)
    # The eigensystem's shapes and dtypes (its rank, real or complex) as it returns them.
    member_loss = jax.tree_util.tree_map(lambda leaf: leaf[0], loss)
    shapes = jax.eval_shape(lambda y, loss: problem.eigensystem(t0[0], y, loss, None, True), y0[0], member_loss)
    nan = jnp.full(batch, jnp.nan)
    zeros = jnp.zeros(batch, dtype=jnp.int32)
    state = RadauState(
        t=t0, y=y0, f=f0, h=h, h_old=nan, error_old=nan, rejected=jnp.zeros(batch, bool), t_old=t0, y_old=y0,
        Z=jnp.zeros((batch, 3, size)),
        jacobian=Eigensystem(*(jnp.zeros((batch, *shape.shape), shape.dtype) for shape in shapes)),
        jacobian_is_current=jnp.zeros(batch, bool), contraction=jnp.ones(batch),
        saved=jnp.zeros((batch, len(times), size)).at[:, 0].set(y0), n_saved=jnp.ones(batch, jnp.int32),
        status=jnp.where(jnp.all(jnp.isfinite(f0), axis=1), RUNNING, NON_FINITE).astype(jnp.int32),
        n_steps=zeros, n_rejected=zeros, nfev=zeros + 2, njev=zeros,
    )
    return refresh_eigensystems(problem.eigensystem, state, state.status == RUNNING, loss, first=True)


def extrapolated_stages(state: RadauState, h):
    """Newton's first guess for the stages of a step of size h from state.t: the last step's collocation
    polynomial, extrapolated (zero before the first step). Cost: O(s² n) per member."""
    t, y = state.t, state.y
    h_prev = jnp.where(state.n_steps > 0, t - state.t_old, 1.0)
    x = (t[:, None] + h[:, None] * jnp.asarray(C)[None, :] - state.t_old[:, None]) / h_prev[:, None]
    Z0 = state.y_old[:, None, :] + jnp.einsum("bsi,bin->bsn", collocation_weights(x), state.Z) - y[:, None, :]
    return jnp.where((state.n_steps > 0)[:, None, None], Z0, 0.0)


def attempt_step(problem: RadauProblem, state: RadauState, loss, times, t_end, rtol, atol, max_attempts) -> RadauState:
    """One step attempt for every running member: accept, reject, or retry with a fresh J."""
    active = state.status == RUNNING
    t, y = state.t, state.y
    t_new = jnp.minimum(t + state.h, problem.next_stop(t, t_end))
    h = t_new - t
    min_step = 10 * jnp.abs(jnp.nextafter(t, jnp.inf) - t)
    too_small = active & (h < min_step)
    active = active & ~too_small
    h = jnp.where(active, h, 1.0)  # keeps the masked arithmetic finite

    Z0 = extrapolated_stages(state, h)
    scale = atol + jnp.abs(y) * rtol
    newton_tol = jnp.maximum(10 * jnp.finfo(float).eps / rtol, jnp.minimum(0.03, rtol**0.5))
    newton = newton_solve(problem, state.jacobian, t, y, h, Z0, scale, newton_tol, state.contraction, active,
                          state.nfev, loss)
    converged = newton.converged

    # Not converged: retry with a fresh Jacobian if it was stale, else halve h.
    failed = active & ~converged
    retry_with_jacobian = failed & ~state.jacobian_is_current
    halve = failed & state.jacobian_is_current

    y_new = y + newton.Z[:, 2]
    error, refined = error_norm(problem, state.jacobian, t, y, y_new, state.f, newton.Z, h, converged & state.rejected,
                                rtol, atol, loss)
    nfev = newton.nfev + refined
    accept = converged & (error <= 1)
    reject = converged & (error > 1)
    next_h = next_step_size(h, state.h_old, error, state.error_old, newton.n_iter, accept, reject, halve, state.h, newton.rate,
                            problem.newton.rate_target)

    f_new = problem.field_batch(t_new, y_new, loss)
    nfev = nfev + accept
    finite_new = jnp.all(jnp.isfinite(f_new), axis=1) & jnp.all(jnp.isfinite(y_new), axis=1)

    saved, n_saved = dense_output(state.saved, state.n_saved, accept, t, y, h, t_new, newton.Z, times)
    keep = lambda new, old: jnp.where(accept.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
    attempts = state.n_steps + state.n_rejected + 1
    status = jnp.where(too_small, SOLVER_FAILED, state.status)
    status = jnp.where(accept & ~finite_new, NON_FINITE, status)
    status = jnp.where(accept & finite_new & (t_new >= t_end), FINISHED, status)
    status = jnp.where((status == RUNNING) & (attempts >= max_attempts) & active, STEP_LIMIT, status)
    control = problem.newton
    recompute = accept & (newton.n_iter > control.recompute_after_iterations) & (newton.rate > control.recompute_above_rate)
    state = state._replace(
        t=keep(t_new, t), y=keep(y_new, y), f=keep(f_new, state.f), h=jnp.where(active, next_h, state.h),
        h_old=keep(h, state.h_old), error_old=keep(error, state.error_old),
        rejected=jnp.where(accept, False, jnp.where(reject | halve, True, state.rejected)),
        t_old=keep(t, state.t_old), y_old=keep(y, state.y_old), Z=keep(newton.Z, state.Z),
        jacobian_is_current=jnp.where(accept, False, state.jacobian_is_current),
        contraction=jnp.where(active, newton.contraction, state.contraction), saved=saved, n_saved=n_saved,
        status=status.astype(jnp.int32), n_steps=state.n_steps + accept,
        n_rejected=state.n_rejected + (reject | halve), nfev=nfev.astype(jnp.int32),
    )
    need = (retry_with_jacobian | recompute) & (state.status == RUNNING)
    return refresh_eigensystems(problem.eigensystem, state, need, loss)


def advance(problem: RadauProblem, state: RadauState, loss, times, t_end, t_stop, rtol, atol, max_attempts,
            chunk_attempts) -> RadauState:
    """Step until every member has stopped or reached ``t_stop``, or ``chunk_attempts`` step
    attempts have been made in this call (a caller bounds the wall-clock time of one call
    with it; the steps are the same however the loop is cut)."""

    def keep_going(carry):
        state, attempts = carry
        return jnp.any((state.status == RUNNING) & (state.t < t_stop)) & (attempts < chunk_attempts)

    def step(carry):
        state, attempts = carry
        return attempt_step(problem, state, loss, times, t_end, rtol, atol, max_attempts), attempts + 1

    return jax.lax.while_loop(keep_going, step, (state, jnp.zeros((), jnp.int32)))[0]


# XLA options for a small flow's compiled loop. Its matrix products are tiny (n x 3 by 3 x 3, k x n by n x 3, the
# model's d x m blocks); XLA's own loops run them faster than the YNNPACK library calls it would otherwise make.
# Above LIBRARY_CALLS_ABOVE_SIZE parameters the field's d x d by d x m products dominate and the library calls
# win (benchmarks/MEASUREMENTS.md, "YNNPACK in the compiled loops"), so a large flow compiles with XLA's defaults.
COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
LIBRARY_CALLS_ABOVE_SIZE = 1024


def compile_loop(lowered: jax.stages.Lowered, size: int) -> jax.stages.Compiled:
    """Compile a loop over flows of ``size`` parameters: with ``COMPILER_OPTIONS`` up to LIBRARY_CALLS_ABOVE_SIZE,
    where this XLA knows them (other versions and backends may not), with XLA's defaults above."""
    if size > LIBRARY_CALLS_ABOVE_SIZE:
        return lowered.compile()
    try:
        return lowered.compile(compiler_options=dict(COMPILER_OPTIONS))
    except Exception as error:  # XLA raises its runtime error type, which differs across jaxlib versions
        if "No such compile option" not in str(error):
            raise
        return lowered.compile()


class RadauFunctions(NamedTuple):
    """The compiled entry points for one flow structure, batch size and number of save times."""

    init: Callable
    advance: Callable
    compile_seconds: float


def build_radau(problem: RadauProblem, batch: int, n_save: int, size: int, loss_batch) -> RadauFunctions:
    """Compile ``init(y0, loss, times, t_end, rtol, atol)`` and ``advance(state, loss,
    times, t_end, t_stop, rtol, atol, max_attempts, chunk_attempts)`` for ``batch`` flows of ``size``
    parameters, saved at ``n_save`` times (ascending; entries after t_end are never
    reached). ``loss_batch`` is an example batched loss (its shapes)."""

    def init(y0, loss, times, t_end, rtol, atol):
        return init_state(problem, y0, loss, times, t_end, rtol, atol)

    def advance_problem(state, loss, times, t_end, t_stop, rtol, atol, max_attempts, chunk_attempts):
        return advance(problem, state, loss, times, t_end, t_stop, rtol, atol, max_attempts, chunk_attempts)

    started = time.perf_counter()
    y_example = jnp.zeros((batch, size))
    times_example = jnp.zeros(n_save)
    scalar = jnp.zeros(())
    init_compiled = compile_loop(jax.jit(init).lower(y_example, loss_batch, times_example, scalar, scalar, scalar), size)
    state_example = jax.eval_shape(init, y_example, loss_batch, times_example, scalar, scalar, scalar)
    # The state is donated: each call updates it in place instead of copying the save buffer.
    advance_compiled = compile_loop(jax.jit(advance_problem, donate_argnums=0).lower(
        state_example, loss_batch, times_example, scalar, scalar, scalar, scalar, jnp.zeros((), jnp.int32),
        jnp.zeros((), jnp.int32)), size)
    return RadauFunctions(init_compiled, advance_compiled, time.perf_counter() - started)
