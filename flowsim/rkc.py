"""RKC: the stabilized explicit Runge-Kutta-Chebyshev method, as a scipy ``OdeSolver``.

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

Use: ``solve_ivp(None, span, y0, method=RKC, field=f, field_args=(a, b), rtol=..., atol=...)`` with
``f(y, a, b) -> dy/dt`` a JAX function (an autonomous system; its steps are compiled once per ``f``);
dense output is the cubic Hermite interpolant of each step. Cost per step: s + 1 field evaluations, O(n) besides; ρ: ``POWER_ITERATIONS`` JVPs.
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
SAFETY, MIN_FACTOR, MAX_FACTOR = 0.8, 0.1, 10.0  # step-size controller for the O(h³) local error


@functools.lru_cache(maxsize=None)
def chebyshev_step(field: Callable) -> Callable:
    """One RKC step (y, f(y), h, s, args) -> (y_new, f(y_new)), compiled once per ``field``; s may vary."""

    @jax.jit
    def step(y, f0, h, s, args):
        w0 = 1.0 + DAMPING / (s * s)
        square = w0 * w0 - 1.0
        root = jnp.sqrt(square)
        arg = s * jnp.log(w0 + root)
        w1 = jnp.sinh(arg) * square / (jnp.cosh(arg) * s * root - w0 * jnp.sinh(arg))
        b = 1.0 / (2.0 * w0) ** 2  # b_0 = b_1 = b_2

        def stage(j, carry):
            # T_j, T_j', T_j'' at w0 by their recurrences give the stage coefficients μ, ν, μ̃, γ̃ of stage j
            y1, y2, z1, z2, dz1, dz2, ddz1, ddz2, b1, b2 = carry
            z = 2 * w0 * z1 - z2
            dz = 2 * w0 * dz1 - dz2 + 2 * z1
            ddz = 2 * w0 * ddz1 - ddz2 + 4 * dz1
            bj = ddz / dz**2
            a1 = 1 - z1 * b1
            mu, nu = 2 * w0 * bj / b1, -bj / b2
            y_j = mu * y1 + nu * y2 + (1 - mu - nu) * y + h * (mu * w1 / w0) * (field(y1, *args) - a1 * f0)
            return y_j, y1, z, z1, dz, dz1, ddz, ddz1, bj, b1

        first = (y + h * w1 * b * f0, y, w0, 1.0, 1.0, 0.0, 0.0, 0.0, b, b)
        y_new = jax.lax.fori_loop(2, s + 1, stage, first)[0]
        return y_new, field(y_new, *args)

    return step


@functools.lru_cache(maxsize=None)
def power_iteration(field: Callable) -> Callable:
    """(y, v, args) -> (direction, ρ estimate): POWER_ITERATIONS products with the Jacobian of ``field`` at y
    (JVPs), warm-started from v."""

    @jax.jit
    def iterate(y, v, args):
        def product(_, carry):
            v, _ = carry
            w = jax.jvp(lambda x: field(x, *args), (y,), (v,))[1]
            norm = jnp.linalg.norm(w)
            return w / jnp.where(norm > 0, norm, 1.0), norm

        return jax.lax.fori_loop(0, POWER_ITERATIONS, product, (v / jnp.linalg.norm(v), jnp.zeros(())))

    return iterate


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
                 seed: int = 0, **extraneous):
        if field is None:
            raise ValueError("RKC needs field=, a JAX function (y, *args) -> dy/dt")
        self.args = tuple(jnp.asarray(a) for a in field_args)
        super().__init__(lambda t, y: np.asarray(field(jnp.asarray(y), *self.args)), t0, y0, t_bound, vectorized)
        self.rtol, self.atol = float(rtol), float(atol)
        self._step, self._power = chebyshev_step(field), power_iteration(field)
        self.f = np.asarray(field(jnp.asarray(self.y), *self.args))
        self.nfev = 1
        self.direction_estimate = np.random.default_rng(seed).standard_normal(self.n)
        self.radius, self.radius_age, self.h_abs = 0.0, RADIUS_AGE, None
        self.rejected = 0
        self._last = None

    def _estimate_radius(self) -> None:
        v, norm = self._power(jnp.asarray(self.y), jnp.asarray(self.direction_estimate), self.args)
        self.direction_estimate, self.radius, self.radius_age = np.asarray(v), RADIUS_SAFETY * float(norm), 0
        self.nfev += 2 * POWER_ITERATIONS  # a JVP costs about two field evaluations

    def _error(self, y_new, f_new, h) -> float:
        """RKC's estimate of the local error, (4/5)(y - y_new) + (2/5) h (f + f_new), in the RMS norm."""
        estimate = 0.8 * (self.y - y_new) + 0.4 * h * (self.f + f_new)
        scale = self.atol + self.rtol * np.maximum(np.abs(self.y), np.abs(y_new))
        return float(np.sqrt(np.mean((estimate / scale) ** 2)))

    def _step_impl(self):
        if self.radius_age >= RADIUS_AGE:
            self._estimate_radius()
        if self.h_abs is None:  # a step the fastest mode and the field's scale both allow
            scale = self.atol + self.rtol * np.abs(self.y)
            speed = np.sqrt(np.mean((self.f / scale) ** 2))
            self.h_abs = min(1.0 / max(self.radius, 1e-300), 1e-2 / speed if speed > 0 else np.inf, abs(self.t_bound - self.t))
        while True:
            h = min(self.h_abs, abs(self.t_bound - self.t)) * self.direction
            stages = int(1 + np.ceil(np.sqrt(1.0 + 1.54 * abs(h) * self.radius)))
            y_new, f_new = (np.asarray(a) for a in self._step(jnp.asarray(self.y), jnp.asarray(self.f), h, stages, self.args))
            self.nfev += stages
            error = self._error(y_new, f_new, h) if np.all(np.isfinite(y_new)) else np.inf
            factor = SAFETY * error ** (-1.0 / 3.0) if error > 0 else MAX_FACTOR
            if error <= 1.0:
                self._last = (self.t, self.y, y_new, self.f, f_new)
                self.t, self.y, self.f = self.t + h, y_new, f_new
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
