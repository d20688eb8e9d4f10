"""RKC: the stabilized explicit Runge-Kutta-Chebyshev method, as a scipy ``OdeSolver``, with its stiffest
directions taken out of the Chebyshev stages and integrated by exponential ones.

Sommeijer, Shampine & Verwer (1997), "RKC: an explicit solver for parabolic PDEs". A step of
size h takes s stages, each one evaluation of the field, arranged by the three-term recurrence
of the damped Chebyshev polynomial T_s(w0 + w1 z) so that the method is second order and stable
on the real interval [-β(s), 0] of h λ, β(s) ≈ 0.65 s² (damping 2/13). The stage count is chosen
per step from an estimate ρ of the Jacobian's spectral radius, s = 1 + ⌈√(1 + 1.54 h ρ)⌉, so h is
limited by accuracy alone and a step costs O(√(h ρ)) evaluations instead of the O(h ρ) of an
explicit method.

It suits stiff systems whose Jacobian has a (nearly) real spectrum that changes quickly along the
path: gradient flows, whose Jacobian is minus a Hessian. There an implicit method must refresh
and factor an n × n Jacobian (n Hessian-vector products, O(n³)) every few steps, while RKC needs
only the field and, every ``RADIUS_AGE`` steps, a few Jacobian-vector products for ρ. Those are forward
differences of the field, J u ≈ (f(y + δ u) - f(y)) / δ with f(y) known from the step: one evaluation each,
where JAX's forward-over-reverse product cost 5-6 evaluations of a gradient flow's field (d = 1001), and ρ, the
directions taken out and their rates need only a few digits (the step's error is controlled by its own estimate).

**Deflation** (``deflate=True``, the default). The Hessians of attention's flows have one or a few eigenvalues far
above the rest (the logits' scale: at d = 64, 10⁴ against 3·10²), and s follows √ρ of the largest. With v one of
the Jacobian's dominant eigenvectors (eigenvalue -λ) and u the step's displacement along v, the field along v is
-λ u + g with g = v·f + λ u nearly constant; each stage integrates that scalar equation exactly for g linear
(exponential Runge-Kutta with g interpolated through the step's start and the last stage, order 2), and the Chebyshev
stages carry only the field's part orthogonal to the directions taken out (the columns of V, at most
``MAX_DIRECTIONS``), so s follows ρ' = the spectral radius on their complement. Direction j is taken out while its
eigenvalue is ``DEFLATION_GAP`` times the spectral radius on the complement of the first j (a power iteration each)
and the stages it saves outnumber the evaluations its refreshes cost; V is refreshed by a few more products every
``DIRECTION_AGE`` steps and made the Ritz vectors of J on its span (V^T J V diagonal: J symmetric, as a gradient
flow's is), from the products the iterations end with.

Use: ``solve_ivp(None, span, y0, method=RKC, field=f, field_args=(a, b), rtol=..., atol=...)`` with
``f(y, a, b) -> dy/dt`` a JAX function (an autonomous system; its steps are compiled once per ``f``);
dense output is the cubic Hermite interpolant of each step. Cost per step: s + 1 field evaluations (s + 2 with
V taken out), O(n MAX_DIRECTIONS) besides; ρ: at most ``POWER_ITERATIONS`` products (at most (p + 2) POWER_ITERATIONS
with p directions taken out; fewer once the estimate settles to RADIUS_TOLERANCE), and p DIRECTION_ITERATIONS for V
and λ every DIRECTION_AGE steps.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy.integrate import DenseOutput, OdeSolver

DAMPING = 2.0 / 13.0  # the damped Chebyshev polynomial's ε: stability interval ≈ 0.65 s², robust to complex λ near the axis
RADIUS_SAFETY = 1.2  # ρ is the power iteration's estimate times this (it converges from below)
RADIUS_AGE = 25  # accepted steps between estimates of ρ (and after a rejected step, unless it was made at that point)
POWER_ITERATIONS = 20  # at most this many products per estimate, warm-started from the last dominant direction ...
# ... until the estimate moves less than this (relative) in one product: RKC.f stops at 1e-2; a direction taken out
# needs more (the estimate's error is about the square of the direction's)
RADIUS_TOLERANCE = 1e-3
# the first j dominant directions are taken out where the j-th eigenvalue is this many times the spectral radius on their
# complement: at that gap a power iteration's direction converges to 1e-8 in 20 products, and a refresh's 3 products
# from the last one shrink its error 16-fold. At d = 64 the full-rank Hessian's top eigenvalues are 15 600, 5400, 1800,
# 1200: 10 took none of them out
DEFLATION_GAP = 2.5
# at most this many: at d = 64 a gap of 2.5 never took out a third, and each column costs every stage ~1.5 µs on a CPU
MAX_DIRECTIONS = 2
DIRECTION_AGE, DIRECTION_ITERATIONS = 5, 3  # deflated: V and λ refreshed this often (steps) by this many products each, as V turns
# a product J u is the forward difference (f(y + δ u) - f(y)) / δ, δ = DIFFERENCE_STEP (1 + ‖y‖): its error is about
# √(machine ε) relative, far below what ρ and the directions need (RADIUS_TOLERANCE)
DIFFERENCE_STEP = float(np.sqrt(np.finfo(float).eps))
PRODUCT_COST = 1  # field evaluations per product, as counted in ``nfev``
REFRESH_COST = PRODUCT_COST * DIRECTION_ITERATIONS / DIRECTION_AGE  # ... so the refreshes' cost per step per direction
SAFETY, MIN_FACTOR, MAX_FACTOR = 0.8, 0.1, 10.0  # step-size controller for the O(h³) local error


def stage_count(h: float, radius: float) -> int:
    """s = 1 + ⌈√(1 + 1.54 h ρ)⌉: the fewest stages stable for a step h where the spectral radius is ρ."""
    return int(1 + np.ceil(np.sqrt(1.0 + 1.54 * abs(h) * radius)))


def phi1(z):
    """φ1(z) = (e^z - 1)/z, 1 at z = 0."""
    small = jnp.abs(z) < 1e-8
    return jnp.where(small, 1.0 + z / 2, jnp.expm1(z) / jnp.where(small, 1.0, z))


def phi2(z):
    """φ2(z) = (e^z - 1 - z)/z², 1/2 at z = 0 (its series near 0, where the formula cancels)."""
    small = jnp.abs(z) < 1e-2
    safe = jnp.where(small, 1.0, z)
    return jnp.where(small, 0.5 + z * (1 / 6 + z * (1 / 24 + z * (1 / 120 + z / 720))), (jnp.expm1(safe) - safe) / safe**2)


def coordinates(V, f):
    """V^T f for V's few columns, one sum each, unrolled so that XLA fuses them with the stage's other vector
    operations (a dot with a few columns is a library call of its own, 10-20 µs a stage on a CPU)."""
    return jnp.stack([jnp.sum(V[:, j] * f) for j in range(V.shape[1])])


def combination(V, u):
    """V u, unrolled likewise."""
    return sum(V[:, j] * u[j] for j in range(V.shape[1]))


@functools.lru_cache(maxsize=None)
def chebyshev_step(field: Callable) -> Callable:
    """One RKC step (y, f(y), h, s, V, λ, args) -> (y_new, f(y_new)), compiled once per ``field``; s may vary.

    The orthonormal columns v of V (n × MAX_DIRECTIONS; zero columns with λ = 0 are unused, and V = 0 gives plain
    RKC) are taken out of the Chebyshev stages.
    Along each v the field is -λ u + g, u the displacement along v since the step's start and g = v·f + λ u; stage j
    (abscissa c_j) integrates it exactly with g linear through g_0 (at 0) and g_{j-1} (at c_{j-1}):

        u_j = c_j h (φ1(-λ c_j h) g_0 + φ2(-λ c_j h) (c_j / c_{j-1}) (g_{j-1} - g_0)),

    the last one with g through g_0 and g_{s-1}, then, where λ ≠ 0, once more with g_0 and the new point's g (a
    second field evaluation, so the new point sits on the slow manifold along V). The other directions take the
    usual stages with f - V (V^T f)."""

    @jax.jit
    def step(y, f0, h, s, V, lam, args):
        w0 = 1.0 + DAMPING / (s * s)
        square = w0 * w0 - 1.0
        root = jnp.sqrt(square)
        arg = s * jnp.log(w0 + root)
        w1 = jnp.sinh(arg) * square / (jnp.cosh(arg) * s * root - w0 * jnp.sinh(arg))
        b = 1.0 / (2.0 * w0) ** 2  # b_0 = b_1 = b_2
        g0 = coordinates(V, f0)
        across0 = f0 - combination(V, g0)

        def along(c, g, c_g):
            """u (one per column of V) at abscissa c with g linear through (0, g0) and (c_g, g)."""
            z = -lam * c * h
            return c * h * (phi1(z) * g0 + phi2(z) * (c / c_g) * (g - g0))

        def stage(j, carry):
            # T_j, T_j', T_j'' at w0 by their recurrences give the stage coefficients μ, ν, μ̃, γ̃ of stage j
            y1, y2, z1, z2, dz1, dz2, ddz1, ddz2, b1, b2, u1, u2, c1, c2 = carry
            z = 2 * w0 * z1 - z2
            dz = 2 * w0 * dz1 - dz2 + 2 * z1
            ddz = 2 * w0 * ddz1 - ddz2 + 4 * dz1
            bj = ddz / dz**2
            a1 = 1 - z1 * b1
            mu, nu = 2 * w0 * bj / b1, -bj / b2
            f1 = field(y1, *args)
            g1 = coordinates(V, f1)
            y_j = mu * y1 + nu * y2 + (1 - mu - nu) * y + h * (mu * w1 / w0) * (f1 - combination(V, g1) - a1 * across0)
            c = mu * c1 + nu * c2 + (mu * w1 / w0) * (1 - a1)  # the stage's abscissa, by the same recurrence
            u = along(c, g1 + lam * u1, c1)
            return y_j + combination(V, u - mu * u1 - nu * u2), y1, z, z1, dz, dz1, ddz, ddz1, bj, b1, u, u1, c, c1

        c_1 = w1 * b
        u_1 = c_1 * h * phi1(-lam * c_1 * h) * g0
        first = (y + h * c_1 * across0 + combination(V, u_1), y, w0, 1.0, 1.0, 0.0, 0.0, 0.0, b, b, u_1, jnp.zeros_like(u_1), c_1, 0.0)
        stages = jax.lax.fori_loop(2, s + 1, stage, first)
        y_new, u = stages[0], stages[10]
        f_new = field(y_new, *args)

        def settled():
            corrected = y_new + combination(V, along(1.0, coordinates(V, f_new) + lam * u, 1.0) - u)
            return corrected, field(corrected, *args)

        return jax.lax.cond(jnp.any(lam != 0.0), settled, lambda: (y_new, f_new))

    return step


@functools.lru_cache(maxsize=None)
def power_iteration(field: Callable) -> Callable:
    """(y, f(y), v, args, away=None, iterations=POWER_ITERATIONS, tolerance=0) -> (u, P J u, products): up to
    ``iterations`` products with the Jacobian J of ``field`` at y (forward differences from f(y), one evaluation each)
    restricted to the complement of the orthonormal columns of
    ``away`` (P the projection on it; away is n × MAX_DIRECTIONS, zero columns are ignored; None: the whole space),
    warm-started from v, stopping after two or more once the estimate ‖P J u‖ of ρ moved less than ``tolerance``
    (relative) in the last. u is the unit vector of the last product, which is returned with it (no further one is
    needed for J u). Compiled once per ``field``: every call gives the compiled loop arguments of the same shapes and
    types."""

    @jax.jit
    def iterate(y, f0, v, away, args, iterations, tolerance):
        delta = DIFFERENCE_STEP * (1.0 + jnp.linalg.norm(y))

        def unit(w):
            w = w - away @ (away.T @ w)
            norm = jnp.linalg.norm(w)
            return w / jnp.where(norm > 0, norm, 1.0)

        def product(carry):
            count, _, w, norm, _ = carry
            u = unit(w)
            Ju = (field(y + delta * u, *args) - f0) / delta
            Ju = Ju - away @ (away.T @ Ju)
            new = jnp.linalg.norm(Ju)
            return count + 1, u, Ju, new, jnp.abs(new - norm)

        def going(carry):
            count, _, _, norm, moved = carry
            return (count < iterations) & ((count < 2) | (moved >= tolerance * norm))  # tolerance 0: every product

        count, u, Ju, _, _ = jax.lax.while_loop(going, product, (0, jnp.zeros_like(v), v, 0.0, jnp.inf))
        return u, Ju, count

    def run(y, f0, v, args, away=None, iterations: int = POWER_ITERATIONS, tolerance: float = 0.0):
        away = np.zeros((len(y), MAX_DIRECTIONS)) if away is None else away
        return iterate(y, f0, v, away, args, np.int64(iterations), np.float64(tolerance))

    return run


class HermiteOutput(DenseOutput):
    """The cubic through (y0, f0) at t_old and (y1, f1) at t: third-order accurate, as the method is second. Its
    Hermite basis in s = (t - t_old)/h is evaluated when called: solve_ivp makes one per step, most never called (a
    scipy spline built per step was a measurable part of a prediction: benchmarks/MEASUREMENTS.md)."""

    def __init__(self, t_old: float, t: float, y0, y1, f0, f1):
        super().__init__(t_old, t)
        self.nodes = (y0, y1, f0, f1)

    def _call_impl(self, t):
        y0, y1, f0, f1 = self.nodes
        h = self.t - self.t_old
        s = (np.asarray(t, dtype=float) - self.t_old) / h
        basis = (2 * s**3 - 3 * s**2 + 1, h * (s**3 - 2 * s**2 + s), -2 * s**3 + 3 * s**2, h * (s**3 - s**2))
        return sum(np.multiply.outer(node, weight) for node, weight in zip((y0, f0, y1, f1), basis))


class RKC(OdeSolver):
    """Runge-Kutta-Chebyshev of order 2 with variable stages. ``field(y, *field_args)`` (a JAX function giving dy/dt)
    is required and ``fun`` is not used. ``nfev`` counts field evaluations, Jacobian-vector products included."""

    def __init__(self, fun, t0, y0, t_bound, rtol=1e-6, atol=1e-12, vectorized=False, field=None, field_args: tuple = (),
                 seed: int = 0, deflate: bool = True, **extraneous):
        if field is None:
            raise ValueError("RKC needs field=, a JAX function (y, *args) -> dy/dt")
        self.args = tuple(jnp.asarray(a) for a in field_args)
        super().__init__(lambda t, y: np.asarray(field(jnp.asarray(y), *self.args)), t0, y0, t_bound, vectorized)
        self.rtol, self.atol = float(rtol), float(atol)
        self._step, self._power = chebyshev_step(field), power_iteration(field)
        self.f = np.asarray(field(jnp.asarray(self.y), *self.args))
        self.nfev = 1
        # warm starts of the power iterations: the whole space's, then each complement's
        self.estimates = np.random.default_rng(seed).standard_normal((MAX_DIRECTIONS + 1, self.n))
        self.deflate = deflate
        self._take_out(np.zeros((self.n, 0)), np.zeros((self.n, 0)))  # V and λ: nothing taken out yet
        self.slope, self._previous = self.f, None  # the dense output's slope at the last node; the node before it
        self.radius, self.radius_age, self.h_abs = 0.0, RADIUS_AGE, None
        self.rejected = 0
        self._last = None

    def _estimate_radius(self) -> None:
        """ρ by a power iteration; deflated, then ρ' on the complement of the first j dominant directions for
        j = 1, 2, ..., each direction taken out while its eigenvalue exceeds DEFLATION_GAP × the next ρ' and, at the
        step size the controller proposes, the stages it saves outnumber the evaluations it costs (its refreshes,
        and the first one's extra evaluation per step): where steps are short, s is small with or without it."""
        # numpy arrays go to the compiled functions as they are
        away, products = np.zeros((self.n, MAX_DIRECTIONS)), np.zeros((self.n, MAX_DIRECTIONS))
        u, Ju = self._dominant(away, 0)
        radius, taken = float(np.linalg.norm(Ju)), 0
        while self.deflate and taken < MAX_DIRECTIONS:
            away[:, taken], products[:, taken] = u, Ju  # the next direction to take out, and J times it
            u, Ju = self._dominant(away, taken + 1)
            rest = float(np.linalg.norm(Ju))
            if radius <= DEFLATION_GAP * rest:
                break
            if self.h_abs is not None:
                saved = (stage_count(self.h_abs, RADIUS_SAFETY * radius) - stage_count(self.h_abs, RADIUS_SAFETY * rest)
                         - (taken == 0))  # the first direction also costs an evaluation a step
                if saved <= REFRESH_COST:
                    break
            taken, radius = taken + 1, rest
        self.radius, self.radius_age = RADIUS_SAFETY * radius, 0
        self._take_out(away[:, :taken], products[:, :taken])

    def _dominant(self, away: np.ndarray, level: int) -> tuple[np.ndarray, np.ndarray]:
        """(u, P J u): the power iteration on the complement of ``away``, warm-started from its last result there."""
        u, Ju, count = (np.asarray(a) for a in self._power(self.y, self.f, self.estimates[level], self.args, away,
                                                             tolerance=RADIUS_TOLERANCE))
        self.estimates[level] = Ju  # where the iteration leads on: the next warm start
        self.nfev += PRODUCT_COST * int(count)
        return u, Ju

    def _refresh_directions(self) -> None:
        """V and λ again: each column by DIRECTION_ITERATIONS products from its last value, on the complement of the
        columns before it (the gap to the rest makes them converge at once)."""
        away, products = np.zeros((self.n, MAX_DIRECTIONS)), np.zeros((self.n, MAX_DIRECTIONS))
        for j in range(self.taken):
            u, Ju, _ = self._power(self.y, self.f, self.stiff_directions[:, j], self.args, away, DIRECTION_ITERATIONS)
            away[:, j], products[:, j] = np.asarray(u), np.asarray(Ju)
        self.nfev += PRODUCT_COST * DIRECTION_ITERATIONS * self.taken
        self._take_out(away[:, :self.taken], products[:, :self.taken])

    def _take_out(self, V: np.ndarray, JV: np.ndarray) -> None:
        """The p orthonormal columns of V, turned into the Ritz vectors of J on their span (V^T J V diagonal, -λ on
        its diagonal), become the directions the stages integrate exponentially. Column j of JV is P_j J v_j, P_j the
        projection off the columns before it: V^T J V's lower triangle and diagonal, its upper triangle by symmetry
        (J is symmetric), with no product of its own."""
        self.taken = V.shape[1]
        self.stiff_directions, self.stiff_rates = np.zeros((self.n, MAX_DIRECTIONS)), np.zeros(MAX_DIRECTIONS)
        if self.taken:
            lower = np.tril(V.T @ JV)
            values, rotation = np.linalg.eigh(lower + np.tril(lower, -1).T)
            self.stiff_directions[:, :self.taken], self.stiff_rates[:self.taken] = V @ rotation, -values

    def _error(self, y_new, f_new, h) -> float:
        """RKC's estimate of the local error, (4/5)(y - y_new) + (2/5) h (f + f_new), in the RMS norm."""
        estimate = 0.8 * (self.y - y_new) + 0.4 * h * (self.f + f_new)
        scale = self.atol + self.rtol * np.maximum(np.abs(self.y), np.abs(y_new))
        return float(np.sqrt(np.mean((estimate / scale) ** 2)))

    def _step_impl(self):
        if self.radius_age >= RADIUS_AGE:
            self._estimate_radius()
        elif self.taken and self.radius_age % DIRECTION_AGE == 0:
            self._refresh_directions()
        if self.h_abs is None:  # a step the fastest mode and the field's scale both allow
            scale = self.atol + self.rtol * np.abs(self.y)
            speed = np.sqrt(np.mean((self.f / scale) ** 2))
            self.h_abs = min(1.0 / max(self.radius, 1e-300), 1e-2 / speed if speed > 0 else np.inf, abs(self.t_bound - self.t))
        while True:
            # accepted steps can shrink too, where the error estimate stalls near 1: stop before t + h == t
            if self.h_abs < 10 * np.abs(np.nextafter(self.t, self.direction * np.inf) - self.t):
                return False, "the step size fell below the spacing of floating-point numbers"
            h = float(min(self.h_abs, abs(self.t_bound - self.t)) * self.direction)  # one type for the compiled step
            stages = stage_count(h, self.radius)
            y_new, f_new = (np.asarray(a) for a in self._step(self.y, self.f, h, stages, self.stiff_directions,
                                                                 self.stiff_rates, self.args))
            self.nfev += stages + (self.taken > 0)
            error = self._error(y_new, f_new, h) if np.all(np.isfinite(y_new)) else np.inf
            factor = SAFETY * error ** (-1.0 / 3.0) if error > 0 else MAX_FACTOR
            if error <= 1.0:
                # the dense output's slope along V at the new node is the path's, from its last three nodes: the field
                # there is λ times the node's tiny offset from the slow manifold, a kink the transverse equation would see
                V = self.stiff_directions
                secant = V.T @ (y_new - self.y) / h
                if self._previous is not None:  # the quadratic through the last three nodes: second order
                    t_prev, y_prev = self._previous
                    secant += h * (secant - V.T @ (self.y - y_prev) / (self.t - t_prev)) / (h + self.t - t_prev)
                slope = f_new + V @ (secant - V.T @ f_new)
                self._last = (self.t, self.y, y_new, self.slope, slope)
                self._previous = (self.t, self.y)
                self.t, self.y, self.f, self.slope = self.t + h, y_new, f_new, slope
                self.h_abs = abs(h) * min(MAX_FACTOR, max(MIN_FACTOR, factor))
                self.radius_age += 1
                return True, None
            self.rejected += 1
            self.h_abs = abs(h) * max(MIN_FACTOR, min(factor, 1.0))
            if self.radius_age > 0:  # made at this point already, it would come out the same
                self._estimate_radius()

    def _dense_output_impl(self):
        t_old, y0, y1, f0, f1 = self._last
        return HermiteOutput(t_old, self.t, y0, y1, f0, f1)
