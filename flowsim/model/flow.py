"""The gradient-flow ODE on the flat parameter vector.

    dθ_g/dt = - r_g(t) ∂L/∂θ_g          for each parameter group g (W0, W_Q, ...)

with per-group rates r_g(t) = c_g · w_g(t): a constant multiplier c_g (fast-slow
flows) times an optional schedule. The one schedule here is the Q/K slow window:
w(t) = ρ for t < t0, a linear ramp from ρ to 1 on [t0, t0 + tr], then 1. Time t is
learning rate × steps of gradient descent.

Depth smoothing (Window Smoothing) optionally preconditions the gradient: for each
stack of same-role tensors of repeated blocks (W_Q1, W_Q2, ...), ordered by depth,

    dθ_l/dt = -r(t) Σ_l' S[l, l'] ∂L/∂θ_l',   S = I - (a/2) L_path,

L_path the path-graph Laplacian, so u'_l = (1-a) u_l + (a/2)(u_{l-1} + u_{l+1}) inside and
(1-a/2) u_1 + (a/2) u_2 at the ends. S is symmetric, doubly stochastic and PSD for
a <= 1/2, so the smoothed flow still descends. The norm-preserving variant rescales each
smoothed tensor to the norm of the gradient it replaces.

The Jacobian of the vector field is exact: -diag(r(t)) · Hessian(L) by autodiff, or the
autodiff Jacobian of the smoothed field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.tree_util import Partial

from flowsim.config import ConfigError, FlowConfig, SmoothingVariant
from flowsim.model.losses import with_fused_products
from flowsim.model.models import Params


@dataclass(frozen=True)
class SlowWindow:
    """Rate multiplier ρ until t0, linear ramp back to 1 by t0 + tr, for ``groups``."""

    rho: float
    t0: float
    tr: float
    groups: tuple[str, ...] = ("W_Q", "W_K")

    def __post_init__(self) -> None:
        if not (np.isfinite(self.rho) and self.rho > 0):
            raise ValueError(f"flow.qk_rho must be a positive finite number, got {self.rho!r}")
        if not (np.isfinite(self.t0) and self.t0 >= 0):
            raise ValueError(f"flow.qk_t0 must be >= 0, got {self.t0!r}")
        if not (np.isfinite(self.tr) and self.tr >= 0):
            raise ValueError(f"flow.qk_tr must be >= 0, got {self.tr!r}")

    def multiplier(self, t):
        """w(t), traceable by JAX (t may be a tracer)."""
        ramp = jnp.clip((t - self.t0) / max(self.tr, 1e-300), 0.0, 1.0)
        ramp = jnp.where(t < self.t0, 0.0, ramp)
        return self.rho + (1.0 - self.rho) * ramp

    @property
    def kinks(self) -> tuple[float, ...]:
        """Times where w(t) is not smooth (solvers step exactly onto them)."""
        return (self.t0,) if self.tr == 0 else (self.t0, self.t0 + self.tr)


@dataclass(frozen=True)
class RateSchedule:
    """Per-group rates r_g(t) = constant[g] · (window multiplier if g is in the window)."""

    constant: Mapping[str, float] = field(default_factory=dict)
    window: SlowWindow | None = None

    def __post_init__(self) -> None:
        for group, rate in self.constant.items():
            if not (np.isfinite(rate) and rate >= 0):
                raise ValueError(f"flow rate for {group} must be a finite number >= 0, got {rate!r}")

    def __hash__(self) -> int:  # a static argument of compiled functions (FlowStructure)
        return hash((tuple(sorted(self.constant.items())), self.window))

    def check_groups(self, groups: Sequence[str]) -> None:
        """Every named group must be a parameter of the model."""
        named = set(self.constant) | (set(self.window.groups) if self.window else set())
        unknown = named - set(groups)
        if unknown:
            raise ValueError(f"flow rates name unknown parameter groups {sorted(unknown)}; the model has {list(groups)}")

    def rates(self, t, groups: Sequence[str]):
        """Rates of ``groups`` at time t as a JAX vector (traceable in t)."""
        values = []
        for group in groups:
            rate = jnp.asarray(self.constant.get(group, 1.0), dtype=jnp.float64)
            if self.window is not None and group in self.window.groups:
                rate = rate * self.window.multiplier(t)
            values.append(rate)
        return jnp.stack(values)

    @property
    def kinks(self) -> tuple[float, ...]:
        return self.window.kinks if self.window is not None else ()

    @classmethod
    def from_config(cls, flow: FlowConfig, slow_groups: Sequence[str]) -> "RateSchedule":
        """The rates of a [flow] section; the Q/K window slows ``slow_groups`` unless it names its own."""
        try:
            window = None
            if flow.qk_rho != 1.0:
                groups = tuple(slow_groups) if flow.qk_groups is None else tuple(flow.qk_groups)
                window = SlowWindow(flow.qk_rho, flow.qk_t0, flow.qk_tr, groups)
            return cls(constant=dict(flow.rates), window=window)
        except ValueError as error:
            raise ConfigError(str(error)) from None


SMOOTHING_VARIANTS: tuple[str, ...] = get_args(SmoothingVariant)


def path_smoothing_operator(n: int, a: float) -> np.ndarray:
    """S = I - (a/2) L_path for n blocks (L_path = degree - adjacency of the path graph)."""
    adjacency = np.eye(n, k=1) + np.eye(n, k=-1)
    laplacian = np.diag(adjacency.sum(axis=1)) - adjacency
    return np.eye(n) - 0.5 * a * laplacian


@dataclass(frozen=True)
class DepthSmoothing:
    """Window Smoothing of the gradient across ``stacks`` of same-role groups, ordered by depth."""

    a: float
    stacks: tuple[tuple[str, ...], ...]
    variant: str = "standard"

    def __post_init__(self) -> None:
        if not (np.isfinite(self.a) and 0.0 <= self.a <= 0.5):
            raise ValueError(f"flow.smoothing_a must be in [0, 1/2] (S is then PSD), got {self.a!r}")
        if self.variant not in SMOOTHING_VARIANTS:
            raise ValueError(f"flow.smoothing_variant must be one of {SMOOTHING_VARIANTS}, got {self.variant!r}")
        if not self.stacks or any(len(stack) < 2 for stack in self.stacks):
            raise ValueError(f"flow.smoothing_a = {self.a!r}: depth smoothing needs repeated blocks, stacks of at least "
                             "two same-role groups")

    @classmethod
    def from_config(cls, flow: FlowConfig, repeated_blocks: tuple[tuple[str, ...], ...], model_kind: str) -> "DepthSmoothing | None":
        """The smoothing of a [flow] section across ``repeated_blocks`` (None when it is off)."""
        if flow.smoothing_a == 0.0 and flow.smoothing_variant == "standard":
            return None
        try:
            return cls(flow.smoothing_a, repeated_blocks, flow.smoothing_variant)
        except ValueError as error:
            raise ConfigError(f"{error} (model.kind = {model_kind!r})") from None


class FlowStructure(NamedTuple):
    """What fixes a flow's compiled code, apart from the loss: the parameter names and shapes
    (in the model's order), the rates and the depth smoothing. Hashable, so it is a static
    argument of the compiled functions below: flows of equal structure share them."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    rates: RateSchedule
    smoothing: DepthSmoothing | None

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.shapes)

    @property
    def size(self) -> int:
        return int(sum(np.prod(shape, dtype=int) for _, shape in self.shapes))

    def group_of_entry(self) -> np.ndarray:
        """The group index of each flat entry (``ravel_pytree`` lays dict entries out by sorted key)."""
        shapes = dict(self.shapes)
        return np.repeat([self.groups.index(name) for name in sorted(shapes)],
                         [int(np.prod(shapes[name], dtype=int)) for name in sorted(shapes)])

    def entries_of(self, name: str) -> np.ndarray:
        """Indices of parameter ``name``'s entries (row-major) in the flat vector."""
        return np.flatnonzero(self.group_of_entry() == self.groups.index(name))

    def unravel(self, theta: jax.Array) -> Params:
        """The parameter dict of a flat vector (the inverse of ``ravel_pytree``)."""
        _, unravel = ravel_pytree({name: jnp.zeros(shape, theta.dtype) for name, shape in self.shapes})
        return unravel(theta)


# ---------------------------------------------------------------------------------
# The flow as pure functions of (structure, t, θ, loss). The structure is static; the
# loss is a pytree whose leaves (the chain's data) are traced, not baked into the code.


def flat_loss(structure: FlowStructure, theta: jax.Array, loss: Callable) -> jax.Array:
    """L(θ) on the flat parameter vector."""
    return loss(structure.unravel(theta))


def rate_vector(structure: FlowStructure, t) -> jax.Array:
    """r(t) on every flat entry (traceable in t)."""
    return structure.rates.rates(t, structure.groups)[structure.group_of_entry()]


def loss_gradient(structure: FlowStructure, theta: jax.Array, loss: Callable) -> jax.Array:
    """∇L(θ), without the rates."""
    return jax.grad(flat_loss, argnums=1)(structure, theta, loss)


def loss_hessian(structure: FlowStructure, theta: jax.Array, loss: Callable) -> jax.Array:
    """∇²L(θ) (n x n, dense: O(n²) memory)."""
    return jax.hessian(flat_loss, argnums=1)(structure, theta, loss)


def smoothing_weights(structure: FlowStructure, gradient: jax.Array) -> list[tuple[np.ndarray, jax.Array]]:
    """Per smoothed stack, its (blocks, entries) index array and the coefficient matrix W with
    smoothed_l = Σ_l' W[l, l'] g_l' (W = S; for the norm-preserving variant row l is scaled by
    ‖g_l‖ / ‖(S g)_l‖)."""
    smoothing, weights_of_stacks = structure.smoothing, []
    for stack in smoothing.stacks:
        entries = np.stack([structure.entries_of(name) for name in stack])
        weights = jnp.asarray(path_smoothing_operator(len(stack), smoothing.a))
        if smoothing.variant == "norm_preserving":
            blocks = gradient[entries]
            old, new = jnp.linalg.norm(blocks, axis=1), jnp.linalg.norm(weights @ blocks, axis=1)
            weights = weights * jnp.where(new > 0, old / jnp.where(new > 0, new, 1.0), 0.0)[:, None]
        weights_of_stacks.append((entries, weights))
    return weights_of_stacks


def smooth_gradient(structure: FlowStructure, gradient: jax.Array) -> jax.Array:
    """(S ⊗ I) g on flat gradients (the identity without smoothing)."""
    if structure.smoothing is None:
        return gradient
    for entries, weights in smoothing_weights(structure, gradient):
        gradient = gradient.at[entries].set(weights @ gradient[entries])
    return gradient


def vector_field(structure: FlowStructure, t, theta: jax.Array, loss: Callable) -> jax.Array:
    """f(t, θ) = -r(t) ⊙ (S ⊗ I) ∇L(θ). Cost: one gradient."""
    return -rate_vector(structure, t) * smooth_gradient(structure, loss_gradient(structure, theta, loss))


def jacobian(structure: FlowStructure, t, theta: jax.Array, loss: Callable) -> jax.Array:
    """∂f/∂θ (n x n, dense): -diag(r) ∇²L, or the autodiff Jacobian of the smoothed field."""
    if structure.smoothing is not None:
        return jax.jacfwd(vector_field, argnums=2)(structure, t, theta, loss)
    return -rate_vector(structure, t)[:, None] * loss_hessian(structure, theta, loss)


def gradient_descent_steps(structure: FlowStructure, theta, first, last, lr, loss) -> jax.Array:
    """Steps n = first, ..., last-1 of θ_{n+1} = θ_n + η f(nη, θ_n)."""
    step = lambda n, theta: theta + lr * vector_field(structure, n * lr, theta, loss)  # noqa: E731
    return jax.lax.fori_loop(first, last, step, theta)


# Compiled once per structure (and loss treedef and shapes): the structure is a static argument.
# loss_along / gradient_along: numbers per chunk of rows (tens of MB of temporaries; larger chunks ran slower:
# benchmarks/MEASUREMENTS.md, "JaxBDF: products by difference")
ALONG_CHUNK_ENTRIES = 1 << 20
_vector_field_jit = jax.jit(vector_field, static_argnums=0)
_jacobian_jit = jax.jit(jacobian, static_argnums=0)
_descend_jit = jax.jit(gradient_descent_steps, static_argnums=0)
_loss_batch_jit = jax.jit(jax.vmap(flat_loss, in_axes=(None, 0, None)), static_argnums=0)
_gradient_batch_jit = jax.jit(jax.vmap(loss_gradient, in_axes=(None, 0, None)), static_argnums=0)


class GradientFlow:
    """dθ/dt = -r(t) ⊙ ∇L(θ) on the flat vector θ, with its exact Jacobian.

    ``loss`` maps a parameter dict to a scalar (a ``jax.tree_util.Partial`` from
    ``make_loss_function``, or any traceable function); ``params_like`` fixes the
    names, shapes and flattening order. ``vector_field`` and ``jacobian`` are the entry
    points (compiled, shared by every flow of one ``structure``, and traceable inside
    other JAX code); the module-level functions of the same names are their pure forms.
    """

    def __init__(self, loss: Callable[[Params], jax.Array], params_like: Params, rates: RateSchedule | None = None,
                 smoothing: DepthSmoothing | None = None):
        rates = RateSchedule() if rates is None else rates
        groups = tuple(params_like)
        rates.check_groups(groups)
        self.structure = FlowStructure(tuple((name, tuple(np.shape(params_like[name]))) for name in groups), rates, smoothing)
        if smoothing is not None:
            _check_smoothing(self.structure)
        self.size = self.structure.size
        # A Partial is a pytree: its data leaves are traced, not baked into compiled code.
        self.loss = loss if isinstance(loss, Partial) else Partial(loss)

    @property
    def loop_loss(self) -> Partial:
        """The loss as the compiled integration loops evaluate it: the model's small matrix products in fusible form
        (``losses.with_fused_products``; faster inside a loop: benchmarks/MEASUREMENTS.md)."""
        return with_fused_products(self.loss)

    @property
    def rates(self) -> RateSchedule:
        return self.structure.rates

    @property
    def smoothing(self) -> DepthSmoothing | None:
        return self.structure.smoothing

    @property
    def groups(self) -> tuple[str, ...]:
        return self.structure.groups

    @property
    def eigensystem_is_real(self) -> bool:
        """J = -diag(r) H = -D^½ (D^½ H D^½) D^-½ is similar to a symmetric matrix when every
        rate is positive and the gradient is not smoothed; otherwise J has no such form."""
        return self.smoothing is None and all(rate > 0 for rate in self.rates.constant.values())

    @property
    def structure_key(self) -> tuple:
        """Equal for flows that differ only in the loss's data (the chain) and the start:
        such flows share compiled solvers and can be batched together."""
        shapes = tuple((leaf.shape, str(leaf.dtype)) for leaf in jax.tree_util.tree_leaves(self.loss))
        return (self.structure, jax.tree_util.tree_structure(self.loss), shapes)

    def vector_field(self, t, theta) -> jax.Array:
        """f(t, θ) = -r(t) ⊙ (S ⊗ I) ∇L(θ)."""
        return _vector_field_jit(self.structure, t, theta, self.loss)

    def jacobian(self, t, theta) -> jax.Array:
        """∂f/∂θ, dense (n x n)."""
        return _jacobian_jit(self.structure, t, theta, self.loss)

    def gradient_descent(self, theta: jax.Array, first: int, last: int, lr: float) -> jax.Array:
        """Steps n = first, ..., last-1 of θ_{n+1} = θ_n + η f(nη, θ_n) (compiled once)."""
        return _descend_jit(self.structure, theta, first, last, lr, self.loss)

    def depth_coupling(self, theta: np.ndarray) -> dict[str, dict[str, float]]:
        """For each smoothed group g, the weights W[g][g'] with dθ_g/dt = -r_g(t) Σ_g' W[g][g'] ∂L/∂θ_g'
        at θ (empty without smoothing): the depth-coupling preconditioner read off."""
        if self.smoothing is None:
            return {}
        gradient = jnp.asarray(self.gradient_along(np.asarray(theta)[None])[0])
        coefficients = [weights for _, weights in smoothing_weights(self.structure, gradient)]
        return {group: {source: float(weights[row, col]) for col, source in enumerate(stack)}
                for stack, weights in zip(self.smoothing.stacks, coefficients) for row, group in enumerate(stack)}

    def entries_of(self, name: str) -> np.ndarray:
        """Indices of parameter ``name``'s entries (row-major) in the flat vector."""
        return self.structure.entries_of(name)

    def flatten(self, params: Params) -> np.ndarray:
        flat, _ = ravel_pytree({name: jnp.asarray(params[name]) for name in self.groups})
        return np.asarray(flat)

    def unravel(self, theta) -> Params:
        return self.structure.unravel(jnp.asarray(theta))

    def loss_along(self, thetas: np.ndarray) -> np.ndarray:
        """Loss at each row of ``thetas`` (shape (T, size))."""
        return self._along(_loss_batch_jit, thetas, ())

    def gradient_along(self, thetas: np.ndarray) -> np.ndarray:
        """∇L at each row of ``thetas`` (shape (T, size)), without the rates."""
        return self._along(_gradient_batch_jit, thetas, (self.size,))

    def _along(self, batched: Callable, thetas: np.ndarray, shape: tuple) -> np.ndarray:
        """``batched`` over the rows in chunks of equal size (one compilation), small enough that
        a chunk's intermediates (about a loss's data per row: d² for the mean field) stay near
        ALONG_CHUNK_ENTRIES numbers."""
        thetas = np.asarray(thetas).reshape(-1, self.size)
        data = sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(self.loss))
        rows = int(np.clip(ALONG_CHUNK_ENTRIES // max(data, self.size, 1), 1, max(len(thetas), 1)))
        out = np.empty((len(thetas), *shape))
        for first in range(0, len(thetas), rows):
            chunk = thetas[first:first + rows]
            padded = np.concatenate([chunk, np.repeat(chunk[-1:], rows - len(chunk), axis=0)])
            out[first:first + len(chunk)] = np.asarray(batched(self.structure, jnp.asarray(padded), self.loss))[:len(chunk)]
        return out

    def flatten_batch(self, params: dict[str, np.ndarray]) -> np.ndarray:
        """Rows of flat vectors from a dict of arrays with a leading time axis (``unflatten_batch``'s inverse)."""
        length = len(next(iter(params.values())))
        thetas = np.empty((length, self.size))
        for name in self.groups:
            thetas[:, self.entries_of(name)] = np.asarray(params[name]).reshape(length, -1)
        return thetas

    def unflatten_batch(self, thetas: np.ndarray) -> dict[str, np.ndarray]:
        """Split rows of flat vectors into a dict of arrays with a leading time axis."""
        thetas = np.asarray(thetas).reshape(-1, self.size)
        shapes = dict(self.structure.shapes)
        return {name: thetas[:, self.entries_of(name)].reshape(len(thetas), *shapes[name]) for name in self.groups}


def _check_smoothing(structure: FlowStructure) -> None:
    """Every smoothed stack names parameters of the model that share one shape."""
    shapes = dict(structure.shapes)
    for stack in structure.smoothing.stacks:
        missing = [name for name in stack if name not in shapes]
        if missing:
            raise ValueError(f"depth smoothing: groups {missing} are not parameters of this model")
        if len({shapes[name] for name in stack}) != 1:
            raise ValueError(f"depth smoothing: the groups {stack} do not share one shape")
