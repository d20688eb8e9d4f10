"""RKC: the stabilized explicit Runge-Kutta-Chebyshev method, as a scipy ``OdeSolver``, with its stiffest
direction taken out of the Chebyshev stages and integrated by exponential ones.

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
only the field and, every ``RADIUS_AGE`` steps, a few Jacobian-vector products for ρ.

**Deflation** (``deflate=True``, the default). The Hessians of attention's flows have one eigenvalue far above
the rest (the logits' scale: at d = 64, 10⁴ against 3·10²), and s follows √ρ of the largest. With v the
Jacobian's dominant eigenvector (eigenvalue -λ) and u the step's displacement along v, the field along v is
-λ u + g with g = v·f + λ u nearly constant; each stage integrates that scalar equation exactly for g linear
(exponential Runge-Kutta with g interpolated through the step's start and the last stage, order 2), and the Chebyshev
stages carry only the field's part orthogonal to v, so s follows ρ' = the spectral radius on v's complement.

Use: ``solve_ivp(None, span, y0, method=RKC, field=f, field_args=(a, b), rtol=..., atol=...)`` with
``f(y, a, b) -> dy/dt`` a JAX function (an autonomous system; its steps are compiled once per ``f``);
dense output is the cubic Hermite interpolant of each step. Cost per step: s + 1 field evaluations (s + 2 with
v taken out), O(n) besides; ρ (and v, λ, ρ'): ``POWER_ITERATIONS`` JVPs (2 POWER_ITERATIONS + 1 deflated), and
DIRECTION_ITERATIONS + 1 for v and λ every DIRECTION_AGE steps.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy.integrate import DenseOutput, OdeSolver
from scipy.interpolate import CubicHermiteSpline

DAMPING = 2.0 / 13.0  # the damped Chebyshev polynomial's ε: stability interval ≈ 0.65 s², robust to complex λ near the axis
RADIUS_SAFETY = 1.2  # ρ is the power iteration's estimate times this (it converges from below)
RADIUS_AGE = 25  # accepted steps between estimates of ρ (and after every rejected step)
POWER_ITERATIONS = 20  # JVPs per estimate, warm-started from the last dominant direction
DEFLATION_GAP = 10.0  # v is taken out only where its eigenvalue is this many times the rest's spectral radius
DIRECTION_AGE, DIRECTION_ITERATIONS = 5, 3  # deflated: v and λ refreshed this often (steps) by this many JVPs, as v turns
SAFETY, MIN_FACTOR, MAX_FACTOR = 0.8, 0.1, 10.0  # step-size controller for the O(h³) local error


def phi1(z):
    """φ1(z) = (e^z - 1)/z, 1 at z = 0."""
    small = jnp.abs(z) < 1e-8
    return jnp.where(small, 1.0 + z / 2, jnp.expm1(z) / jnp.where(small, 1.0, z))


def phi2(z):
    """φ2(z) = (e^z - 1 - z)/z², 1/2 at z = 0 (its series near 0, where the formula cancels)."""
    small = jnp.abs(z) < 1e-2
    safe = jnp.where(small, 1.0, z)
    return jnp.where(small, 0.5 + z * (1 / 6 + z * (1 / 24 + z * (1 / 120 + z / 720))), (jnp.expm1(safe) - safe) / safe**2)


@functools.lru_cache(maxsize=None)
def chebyshev_step(field: Callable, deflated: bool) -> Callable:
    """One RKC step (y, f(y), h, s, v, λ, args) -> (y_new, f(y_new)), compiled once per ``field``; s may vary.

    ``deflated``: the unit vector v is taken out of the Chebyshev stages (v = 0 and λ = 0 give plain RKC, as
    ``deflated=False`` does without the last evaluation). Along v the field is -λ u + g, u the displacement
    along v since the step's start and g = v·f + λ u; stage j (abscissa c_j) integrates it exactly with g
    linear through g_0 (at 0) and g_{j-1} (at c_{j-1}):

        u_j = c_j h (φ1(-λ c_j h) g_0 + φ2(-λ c_j h) (c_j / c_{j-1}) (g_{j-1} - g_0)),

    the last one with g through g_0 and g_{s-1}, then once more with g_0 and the new point's g (a second
    field evaluation, so the new point sits on the slow manifold along v). The other directions take the
    usual stages with f - (v·f) v."""

    @jax.jit
    def step(y, f0, h, s, v, lam, args):
        w0 = 1.0 + DAMPING / (s * s)
        square = w0 * w0 - 1.0
        root = jnp.sqrt(square)
        arg = s * jnp.log(w0 + root)
        w1 = jnp.sinh(arg) * square / (jnp.cosh(arg) * s * root - w0 * jnp.sinh(arg))
        b = 1.0 / (2.0 * w0) ** 2  # b_0 = b_1 = b_2
        g0 = v @ f0
        across0 = f0 - g0 * v

        def along(c, g, c_g):
            """u at abscissa c with g linear through (0, g0) and (c_g, g)."""
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
            g1 = v @ f1
            y_j = mu * y1 + nu * y2 + (1 - mu - nu) * y + h * (mu * w1 / w0) * (f1 - g1 * v - a1 * across0)
            c = mu * c1 + nu * c2 + (mu * w1 / w0) * (1 - a1)  # the stage's abscissa, by the same recurrence
            u = along(c, g1 + lam * u1, c1)
            return y_j + (u - mu * u1 - nu * u2) * v, y1, z, z1, dz, dz1, ddz, ddz1, bj, b1, u, u1, c, c1

        c_1 = w1 * b
        u_1 = c_1 * h * phi1(-lam * c_1 * h) * g0
        first = (y + h * c_1 * across0 + u_1 * v, y, w0, 1.0, 1.0, 0.0, 0.0, 0.0, b, b, u_1, 0.0, c_1, 0.0)
        stages = jax.lax.fori_loop(2, s + 1, stage, first)
        y_new, u = stages[0], stages[10]
        f_new = field(y_new, *args)
        if not deflated:
            return y_new, f_new
        y_new = y_new + (along(1.0, v @ f_new + lam * u, 1.0) - u) * v
        return y_new, field(y_new, *args)

    return step


@functools.lru_cache(maxsize=None)
def power_iteration(field: Callable) -> Callable:
    """(y, v, away, args[, iterations]) -> (direction, ρ estimate): ``iterations`` (POWER_ITERATIONS) products with
    the Jacobian of ``field`` at y (JVPs) restricted to the complement of the unit vector ``away`` (zero: the whole
    space), warm-started from v."""

    @jax.jit
    def iterate(y, v, away, args, iterations=POWER_ITERATIONS):
        def product(_, carry):
            v, _ = carry
            w = jax.jvp(lambda x: field(x, *args), (y,), (v - (away @ v) * away,))[1]
            w = w - (away @ w) * away
            norm = jnp.linalg.norm(w)
            return w / jnp.where(norm > 0, norm, 1.0), norm

        return jax.lax.fori_loop(0, iterations, product, (v / jnp.linalg.norm(v), jnp.zeros(())))

    return iterate


@functools.lru_cache(maxsize=None)
def rayleigh_quotient(field: Callable) -> Callable:
    """(y, v, args) -> v·J v for the field's Jacobian J at y: one JVP."""
    return jax.jit(lambda y, v, args: v @ jax.jvp(lambda x: field(x, *args), (y,), (v,))[1])


class HermiteOutput(DenseOutput):
    """The cubic through (y0, f0) at t_old and (y1, f1) at t: third-order accurate, as the method is second."""

    def __init__(self, t_old: float, t: float, y0, y1, f0, f1):
        super().__init__(t_old, t)
        self.spline = CubicHermiteSpline([t_old, t], np.stack([y0, y1], axis=1), np.stack([f0, f1], axis=1), axis=1)

    def _call_impl(self, t):
        return self.spline(t)


class RKC(OdeSolver):
    """Runge-Kutta-Chebyshev of order 2 with variable stages. ``field(y, *field_args)`` (a JAX function giving dy/dt)
    is required and ``fun`` is not used. ``nfev`` counts field evaluations and Jacobian-vector products (as two)."""

    def __init__(self, fun, t0, y0, t_bound, rtol=1e-6, atol=1e-12, vectorized=False, field=None, field_args: tuple = (),
                 seed: int = 0, deflate: bool = True, **extraneous):
        if field is None:
            raise ValueError("RKC needs field=, a JAX function (y, *args) -> dy/dt")
        self.args = tuple(jnp.asarray(a) for a in field_args)
        super().__init__(lambda t, y: np.asarray(field(jnp.asarray(y), *self.args)), t0, y0, t_bound, vectorized)
        self.rtol, self.atol = float(rtol), float(atol)
        self._steps = {deflated: chebyshev_step(field, deflated) for deflated in (False, deflate)}
        self._power, self._rayleigh = power_iteration(field), rayleigh_quotient(field)
        self.f = np.asarray(field(jnp.asarray(self.y), *self.args))
        self.nfev = 1
        rng = np.random.default_rng(seed)
        self.direction_estimate, self.rest_estimate = rng.standard_normal(self.n), rng.standard_normal(self.n)
        self.deflate = deflate
        self.stiff_direction, self.stiff_rate = np.zeros(self.n), 0.0  # v and λ (zero: nothing taken out)
        self.slope, self._previous = self.f, None  # the dense output's slope at the last node; the node before it
        self.radius, self.radius_age, self.h_abs = 0.0, RADIUS_AGE, None
        self.rejected = 0
        self._last = None

    def _estimate_radius(self) -> None:
        """ρ by a power iteration; deflated, also v, λ = -v·J v and ρ' by a second iteration on v's complement."""
        y, zero = self.y, np.zeros(self.n)  # numpy arrays go to the compiled functions as they are (jnp.asarray costs more)
        v, norm = self._power(y, self.direction_estimate, zero, self.args)
        self.direction_estimate, self.radius, self.radius_age = np.asarray(v), RADIUS_SAFETY * float(norm), 0
        self.nfev += 2 * POWER_ITERATIONS  # a JVP costs about two field evaluations
        if self.deflate:
            rest, rest_norm = self._power(y, self.rest_estimate, v, self.args)
            self.rest_estimate = np.asarray(rest)
            self.nfev += 2 * POWER_ITERATIONS
            if float(norm) > DEFLATION_GAP * float(rest_norm):
                self._take_out(y, v)
                self.radius = RADIUS_SAFETY * float(rest_norm)
            else:  # no outlier: plain stages
                self.stiff_direction, self.stiff_rate = np.zeros(self.n), 0.0

    def _refresh_direction(self) -> None:
        """v and λ again, by DIRECTION_ITERATIONS products from the last v (the gap to ρ' makes them converge at once)."""
        v, _ = self._power(self.y, self.stiff_direction, np.zeros(self.n), self.args, DIRECTION_ITERATIONS)
        self.nfev += 2 * DIRECTION_ITERATIONS
        self._take_out(self.y, v)

    def _take_out(self, y, v) -> None:
        """v becomes the direction the stages integrate exponentially, with λ = -v·J v (one product)."""
        self.stiff_direction, self.stiff_rate = np.asarray(v), -float(self._rayleigh(y, v, self.args))
        self.nfev += 2

    def _error(self, y_new, f_new, h) -> float:
        """RKC's estimate of the local error, (4/5)(y - y_new) + (2/5) h (f + f_new), in the RMS norm."""
        estimate = 0.8 * (self.y - y_new) + 0.4 * h * (self.f + f_new)
        scale = self.atol + self.rtol * np.maximum(np.abs(self.y), np.abs(y_new))
        return float(np.sqrt(np.mean((estimate / scale) ** 2)))

    def _step_impl(self):
        if self.radius_age >= RADIUS_AGE:
            self._estimate_radius()
        elif self.stiff_rate != 0.0 and self.radius_age % DIRECTION_AGE == 0:
            self._refresh_direction()
        if self.h_abs is None:  # a step the fastest mode and the field's scale both allow
            scale = self.atol + self.rtol * np.abs(self.y)
            speed = np.sqrt(np.mean((self.f / scale) ** 2))
            self.h_abs = min(1.0 / max(self.radius, 1e-300), 1e-2 / speed if speed > 0 else np.inf, abs(self.t_bound - self.t))
        while True:
            h = min(self.h_abs, abs(self.t_bound - self.t)) * self.direction
            stages = int(1 + np.ceil(np.sqrt(1.0 + 1.54 * abs(h) * self.radius)))
            deflated = self.stiff_rate != 0.0
            y_new, f_new = (np.asarray(a) for a in self._steps[deflated](self.y, self.f, h, stages, self.stiff_direction,
                                                                            self.stiff_rate, self.args))
            self.nfev += stages + deflated
            error = self._error(y_new, f_new, h) if np.all(np.isfinite(y_new)) else np.inf
            factor = SAFETY * error ** (-1.0 / 3.0) if error > 0 else MAX_FACTOR
            if error <= 1.0:
                # the dense output's slope along v at the new node is the path's, from its last three nodes: the field
                # there is λ times the node's tiny offset from the slow manifold, a kink the transverse equation would see
                v = self.stiff_direction
                secant = v @ (y_new - self.y) / h
                if self._previous is not None:  # the quadratic through the last three nodes: second order
                    t_prev, y_prev = self._previous
                    secant += h * (secant - v @ (self.y - y_prev) / (self.t - t_prev)) / (h + self.t - t_prev)
                slope = f_new + (secant - v @ f_new) * v
                self._last = (self.t, self.y, y_new, self.slope, slope)
                self._previous = (self.t, self.y)
                self.t, self.y, self.f, self.slope = self.t + h, y_new, f_new, slope
                self.h_abs = abs(h) * min(MAX_FACTOR, max(MIN_FACTOR, factor))
                self.radius_age += 1
                return True, None
            self.rejected += 1
            self.h_abs = abs(h) * max(MIN_FACTOR, min(factor, 1.0))
            if self.h_abs < 10 * np.abs(np.nextafter(self.t, self.direction * np.inf) - self.t):
                return False, "the step size fell below the spacing of floating-point numbers"
            self._estimate_radius()

    def _dense_output_impl(self):
        t_old, y0, y1, f0, f1 = self._last
        return HermiteOutput(t_old, self.t, y0, y1, f0, f1)
