"""The one-layer Transformer of the paper, as pure functions of a parameter mapping.

Parameters (a dict, a JAX pytree):

    W0  (d x m)  embedding          W_Q (m x k)  query
    W_K (m x k)  key                W1  (m x d)  output projection
    W_V (m x m)  value              (only with ``value_matrix=True``)

With one-hot tokens the model reduces to two d x d maps,

    Φ = W0 W_Q W_K^T W0^T   (token-to-token attention logits, times 1/sqrt(k) if asked)
    M = W0 W1               (token-to-logit map; W0 W_V W1 with a value matrix)

and for a context x_1..x_s (the query is x_s, whose own position is attended to)

    a_j = softmax_j Φ[x_s, x_j],     f(x_{1:s}) = Σ_j a_j M[x_j, :]  (+ W0 W1 [x_s, :] with a residual path).

The default is exactly the paper model: no value matrix, no residual, logit scale 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np

from flowsim.config import ConfigError, FFNKind, LogitScale, ModelConfig

Params = dict[str, jax.Array]


# With ``fused=True``, products of up to this many scalar terms are written as a broadcast
# product summed over the shared axis instead of a matrix product. XLA on the CPU calls a
# library routine for every matrix product (about a microsecond, however small), while the
# broadcast form fuses into the surrounding elementwise loops. Larger products (a finite-s
# loss over thousands of contexts) and a wide vmap (a full Hessian) make the fused loops
# recompute their inputs and run slower instead, so only JaxRadau's compiled loop asks for
# it (a model with ``fused_products=True``, losses.with_fused_products), and only for
# products this small (benchmarks/MEASUREMENTS.md).
SMALL_MATMUL_TERMS = 1 << 12


def small_matmul(a: jax.Array, b: jax.Array, fused: bool = False) -> jax.Array:
    """``a @ b`` (NumPy's broadcasting of leading axes); with ``fused``, in fusible form when small."""
    if not fused or a.ndim == 1 or b.ndim == 1:
        return jnp.matmul(a, b)
    terms = np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), dtype=int) * a.shape[-2] * a.shape[-1] * b.shape[-1]
    if terms > SMALL_MATMUL_TERMS:
        return jnp.matmul(a, b)
    return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)


def check_sizes(model, names: tuple[str, ...]) -> None:
    """Each named size of ``model`` a positive integer, and d >= 2: one ValueError naming the bad value."""
    for name in names:
        value = getattr(model, name)
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
    if model.d < 2:
        raise ValueError(f"model.d must be >= 2, got {model.d}")


@dataclass(frozen=True)
class OneLayerTransformer:
    """Shapes and options of the one-layer model (static: the parameters live in a dict)."""

    d: int
    m: int = 8
    k: int = 8
    value_matrix: bool = False
    residual: bool = False
    logit_scale: LogitScale = "one"
    # Evaluation strategy, not a model option: small products in fusible form (``small_matmul``).
    fused_products: bool = False

    def __post_init__(self) -> None:
        check_sizes(self, ("d", "m", "k"))
        if self.logit_scale not in get_args(LogitScale):
            raise ValueError(f"model.logit_scale must be 'one' or 'inv_sqrt_k', got {self.logit_scale!r}")

    slow_groups = ("W_Q", "W_K")  # what the Q/K slow window slows by default

    def _matmul(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return small_matmul(a, b, self.fused_products)
    repeated_blocks = ()  # one block: nothing to smooth across depth

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """Parameter names and shapes, in the canonical order."""
        shapes = {"W0": (self.d, self.m), "W_Q": (self.m, self.k), "W_K": (self.m, self.k), "W1": (self.m, self.d)}
        if self.value_matrix:
            shapes["W_V"] = (self.m, self.m)
        return shapes

    def init(self, eps: float, seed: int) -> Params:
        """I.i.d. N(0, eps^2) entries, drawn in the order of ``shapes`` from numpy's PCG64(seed)."""
        if not (np.isfinite(eps) and eps > 0):
            raise ValueError(f"init.eps must be a positive finite number, got {eps!r}")
        rng = np.random.default_rng(seed)
        return {name: jnp.asarray(eps * rng.standard_normal(shape)) for name, shape in self.shapes.items()}

    def check_params(self, params: Params) -> None:
        """Raise a clear error when ``params`` do not have this model's names and shapes."""
        if set(params) != set(self.shapes):
            raise ValueError(f"parameters {sorted(params)} do not match the model's {sorted(self.shapes)}")
        for name, shape in self.shapes.items():
            if tuple(np.shape(params[name])) != shape:
                raise ValueError(f"parameter {name} has shape {tuple(np.shape(params[name]))}, expected {shape}")

    @property
    def logit_scale_factor(self) -> float:
        """κ in Φ = κ W0 W_Q W_K^T W0^T: 1, or 1/sqrt(k)."""
        return 1.0 if self.logit_scale == "one" else 1.0 / np.sqrt(self.k)

    def attention_logits(self, params: Params) -> jax.Array:
        """Φ = W0 W_Q W_K^T W0^T (d x d), scaled by 1/sqrt(k) when asked."""
        query = self._matmul(params["W0"], params["W_Q"])
        key = self._matmul(params["W0"], params["W_K"])
        return self.logit_scale_factor * self._matmul(query, key.T)

    def value_map(self, params: Params) -> jax.Array:
        """The token-to-logit map carried by attention: W0 W1, or W0 W_V W1."""
        if self.value_matrix:
            return self._matmul(self._matmul(params["W0"], params["W_V"]), params["W1"])
        return self._matmul(params["W0"], params["W1"])

    def logits_from_attention(self, params: Params, attention: jax.Array, query: jax.Array) -> jax.Array:
        """Logits f = attention @ M (+ (W0 W1)[query] with the residual path), for attention
        weights over token types: ``attention`` has shape (..., d) (summing to 1), ``query``
        the matching shape (...) of query tokens.

        M = W0 W1 (d x d) is never formed: f = ((attention W0) [W_V]) W1 costs O(N d m) for
        N rows instead of the O(N d²) of attention @ M (O(d² m) for the mean field, not d³).
        """
        return self.logits_from_mixed(params, self._matmul(attention, params["W0"]), query)

    def logits_from_mixed(self, params: Params, mixed: jax.Array, query: jax.Array) -> jax.Array:
        """Logits from the attention-weighted embedding ``mixed`` (..., m) of each query: O(N d m) for N rows."""
        if self.value_matrix:
            mixed = self._matmul(mixed, params["W_V"])
        logits = self._matmul(mixed, params["W1"])
        if self.residual:
            logits = logits + self._matmul(params["W0"][query], params["W1"])
        return logits

    def logits_over_types(self, params: Params, log_weights: jax.Array, query: jax.Array) -> jax.Array:
        """Logits for contexts given by type weights: attention of ``query`` (shape (...)) is
        softmax(Φ[query, j] + log_weights[..., j]) (log π as s → ∞, log c_j for counts c)."""
        attention = jax.nn.softmax(self.attention_logits(params)[query] + log_weights, axis=-1)
        return self.logits_from_attention(params, attention, query)

    def mean_field_logits(self, params: Params, pi: jax.Array) -> jax.Array:
        """Logits (d x d) of every query type as s → ∞ (type weights π): ``logits_over_types`` for the queries
        0..d-1, with Φ used whole rather than gathered row by row: the same numbers, without the gather's gradient,
        a d x d scatter (benchmarks/MEASUREMENTS.md, "JaxBDF: products by difference")."""
        attention = jax.nn.softmax(self.attention_logits(params) + jnp.log(pi)[None, :], axis=-1)
        return self.logits_from_attention(params, attention, jnp.arange(self.d))

    def forward(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Logits over the vocabulary for a batch of contexts ``tokens`` (shape (batch, s)). Cost: O(d² k) for Φ,
        O(batch s min(d, m)) for the attention-weighted embedding and O(batch d m) for the logits."""
        tokens = jnp.asarray(tokens)
        query = tokens[:, -1]
        phi = self.attention_logits(params)
        scores = phi[query[:, None], tokens]  # (batch, s): Φ[x_s, x_j]
        weights = jax.nn.softmax(scores, axis=-1)
        return self.logits_from_mixed(params, self.context_mixture(params, weights, tokens), query)

    def context_mixture(self, params: Params, weights: jax.Array, tokens: jax.Array) -> jax.Array:
        """Σ_j a_j W0[x_j] for attention weights a over each context's positions, by the cheaper of two exact
        routes: through the d token types where d <= m, else from the context's embedding rows."""
        if self.d <= self.m:
            return self.mixture_over_types(params, weights, tokens)
        return self.mixture_over_rows(params, weights, tokens)

    def mixture_over_types(self, params: Params, weights: jax.Array, tokens: jax.Array) -> jax.Array:
        """``context_mixture`` through the attention over token types (a one-hot context): O(batch s d)."""
        attention_over_types = jnp.einsum("bs,bsd->bd", weights, jax.nn.one_hot(tokens, self.d, dtype=weights.dtype))
        return self._matmul(attention_over_types, params["W0"])

    def mixture_over_rows(self, params: Params, weights: jax.Array, tokens: jax.Array) -> jax.Array:
        """``context_mixture`` from the context's embedding rows: O(batch s m)."""
        return jnp.einsum("bs,bsm->bm", weights, params["W0"][tokens])




@dataclass(frozen=True)
class TwoLayerTransformer:
    """The hierarchical two-layer model: attention, FFN, attention, on a residual stream.

    Parameters: embedding W_E (d x m); per attention block l = 1, 2: W_Q{l}, W_K{l}
    (m x k), W_V{l}, W_O{l} (m x m); unembedding W_U (m x d); the FFN between the blocks:

        none: FFN(h) = 0
        mlp:  FFN(h) = GELU(h W_in) W_out                    (W_in m x f, W_out f x m)
        glu:  FFN(h) = (SiLU(h W_gate) * (h W_up)) W_down     (SwiGLU; W_gate, W_up m x f)

    With token-type weights w over the context (π as s → ∞, the counts c for a context
    of length s), every position of type i carries the same vectors:

        h0_i = W_E[i],   h1 = h0 + A1 h0 W_V1 W_O1,   A1 = softmax(Φ1 + log w), Φ1 = h0 W_Q1 W_K1^T h0^T
        h2 = h1 + FFN(h1),   h3_q = h2_q + A2_q h2 W_V2 W_O2,   A2_q = softmax(Φ2_q + log w),
        logits = h3_q W_U    for the query type q (the last token).

    Layer-1 attention runs over the whole context at every position (each position sees
    the same type counts), so the loss depends on a context only through (c, x_s).
    """

    d: int
    m: int = 8
    k: int = 8
    ffn: FFNKind = "none"
    ffn_width: int = 16
    fused_products: bool = False  # as for the one-layer model

    def __post_init__(self) -> None:
        check_sizes(self, ("d", "m", "k", "ffn_width"))
        if self.ffn not in get_args(FFNKind):
            raise ValueError(f"model.ffn must be 'none', 'mlp' or 'glu', got {self.ffn!r}")

    slow_groups = ("W_Q2", "W_K2")  # the upper layer's query and key
    # same-role tensors of the two attention blocks, ordered by depth (for depth smoothing)
    repeated_blocks = (("W_Q1", "W_Q2"), ("W_K1", "W_K2"), ("W_V1", "W_V2"), ("W_O1", "W_O2"))

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        d, m, k, f = self.d, self.m, self.k, self.ffn_width
        shapes = {"W_E": (d, m), "W_Q1": (m, k), "W_K1": (m, k), "W_V1": (m, m), "W_O1": (m, m)}
        shapes.update({"none": {}, "mlp": {"W_in": (m, f), "W_out": (f, m)},
                       "glu": {"W_gate": (m, f), "W_up": (m, f), "W_down": (f, m)}}[self.ffn])
        shapes.update({"W_Q2": (m, k), "W_K2": (m, k), "W_V2": (m, m), "W_O2": (m, m), "W_U": (m, d)})
        return shapes

    init = OneLayerTransformer.init
    check_params = OneLayerTransformer.check_params
    _matmul = OneLayerTransformer._matmul

    def feed_forward(self, params: Params, h: jax.Array) -> jax.Array:
        if self.ffn == "mlp":
            return self._matmul(jax.nn.gelu(self._matmul(h, params["W_in"]), approximate=False), params["W_out"])
        if self.ffn == "glu":
            return self._matmul(jax.nn.silu(self._matmul(h, params["W_gate"])) * self._matmul(h, params["W_up"]), params["W_down"])
        return jnp.zeros_like(h)

    def residual_streams(self, params: Params, log_weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(h1, h2, A1) per type for type weights ``log_weights`` (shape (..., d))."""
        h0 = params["W_E"]
        phi1 = self._matmul(self._matmul(self._matmul(h0, params["W_Q1"]), params["W_K1"].T), h0.T)
        A1 = jax.nn.softmax(phi1 + log_weights[..., None, :], axis=-1)  # (..., d, d)
        h1 = h0 + self._matmul(A1, self._matmul(self._matmul(h0, params["W_V1"]), params["W_O1"]))
        return h1, h1 + self.feed_forward(params, h1), A1

    def attention_maps(self, params: Params, pi: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Mean-field (A1, A2, h2): both layers' attention of every query type over key types
        (d x d) and the residual stream after the FFN (d x m)."""
        log_pi = jnp.log(pi)
        _, h2, A1 = self.residual_streams(params, log_pi)
        A2 = jax.nn.softmax(self._matmul(self._matmul(self._matmul(h2, params["W_Q2"]), params["W_K2"].T), h2.T) + log_pi, axis=-1)
        return A1, A2, h2

    def mean_field_logits(self, params: Params, pi: jax.Array) -> jax.Array:
        """Logits (d x d) of every query type as s → ∞: one residual stream for all queries,
        since every context carries the type weights π."""
        _, A2, h2 = self.attention_maps(params, pi)
        return self._matmul(h2 + self._matmul(A2, self._matmul(self._matmul(h2, params["W_V2"]), params["W_O2"])), params["W_U"])

    def logits_over_types(self, params: Params, log_weights: jax.Array, query: jax.Array,
                          upper_logit_shift: jax.Array | float = 0.0) -> jax.Array:
        """Logits for the query types ``query`` (shape (...)) given type weights (shape (..., d)).

        ``upper_logit_shift`` (shape (..., d)) is added to the upper layer's logits Φ2[q, :]:
        differentiating at 0 gives ∂L/∂Φ2, the upper attention-logit gradient."""
        _, h2, _ = self.residual_streams(params, log_weights)
        h2_query = jnp.take_along_axis(h2, query[..., None, None], axis=-2)[..., 0, :]  # (..., m)
        phi2 = jnp.einsum("...m,...jm->...j", h2_query @ params["W_Q2"] @ params["W_K2"].T, h2)
        A2 = jax.nn.softmax(phi2 + upper_logit_shift + log_weights, axis=-1)
        h3 = h2_query + jnp.einsum("...j,...jm->...m", A2, h2 @ params["W_V2"] @ params["W_O2"])
        return h3 @ params["W_U"]

    def forward(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Logits for a batch of contexts ``tokens`` (batch, s), position by position."""
        h0 = params["W_E"][jnp.asarray(tokens)]  # (batch, s, m)
        A1 = jax.nn.softmax(h0 @ params["W_Q1"] @ params["W_K1"].T @ jnp.swapaxes(h0, -1, -2), axis=-1)
        h1 = h0 + A1 @ (h0 @ params["W_V1"] @ params["W_O1"])
        h2 = h1 + self.feed_forward(params, h1)
        query = h2[:, -1, :]
        A2 = jax.nn.softmax(jnp.einsum("bm,bjm->bj", query @ params["W_Q2"] @ params["W_K2"].T, h2), axis=-1)
        h3 = query + jnp.einsum("bj,bjm->bm", A2, h2 @ params["W_V2"] @ params["W_O2"])
        return h3 @ params["W_U"]


@dataclass(frozen=True)
class PositionalTwoLayerTransformer:
    """The two-layer model over positions, for sequence tasks (``flowsim.model.tasks``): every
    position has its own residual stream, attention is causal, and a learned positional
    embedding W_P (s x m) is added to the token embedding. The other parameters are the
    ``TwoLayerTransformer``'s (same names, same FFN options). For a context x_1..x_s:

        h0_j = W_E[x_j] + W_P[j]
        h1_i = h0_i + Σ_{j ≤ i} A1[i, j] h0_j W_V1 W_O1,   A1[i, :] = softmax_{j ≤ i}(h0_i W_Q1 W_K1^T h0_j^T)
        h2   = h1 + FFN(h1)
        h3   = h2_s + Σ_j A2[j] h2_j W_V2 W_O2,           A2 = softmax_j(h2_s W_Q2 W_K2^T h2_j^T)
        logits = h3 W_U

    Cost per context: O(s² m + s m (m + k + f)); a population loss over N contexts is N times that.
    """

    d: int
    s: int = 6
    m: int = 8
    k: int = 8
    ffn: FFNKind = "none"
    ffn_width: int = 16
    fused_products: bool = False

    def __post_init__(self) -> None:
        TwoLayerTransformer.__post_init__(self)
        if not isinstance(self.s, (int, np.integer)) or self.s < 1:
            raise ValueError(f"the positional model needs a positive integer context length s, got {self.s!r}")

    slow_groups = TwoLayerTransformer.slow_groups
    repeated_blocks = TwoLayerTransformer.repeated_blocks
    init = OneLayerTransformer.init
    check_params = OneLayerTransformer.check_params
    _matmul = OneLayerTransformer._matmul
    feed_forward = TwoLayerTransformer.feed_forward

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {**TwoLayerTransformer.shapes.fget(self), "W_P": (self.s, self.m)}

    def lower_block(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(A1 (batch, s, s), h1 (batch, s, m)): the lower attention and the stream after it."""
        tokens = jnp.asarray(tokens)
        if tokens.shape[-1] != self.s:
            raise ValueError(f"the positional model has s = {self.s} positions, got contexts of length {tokens.shape[-1]}")
        h0 = params["W_E"][tokens] + params["W_P"]
        logits1 = (h0 @ params["W_Q1"]) @ jnp.swapaxes(h0 @ params["W_K1"], -1, -2)
        causal = jnp.tril(jnp.ones((self.s, self.s), dtype=bool))
        A1 = jax.nn.softmax(jnp.where(causal, logits1, -jnp.inf), axis=-1)
        return A1, h0 + A1 @ (h0 @ params["W_V1"] @ params["W_O1"])

    def streams(self, params: Params, tokens: jax.Array, upper_shift: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(A1 (batch, s, s), A2 (batch, s), h2 (batch, s, m)) for contexts ``tokens`` (batch, s).
        ``upper_shift`` (batch, s) is added to the upper logits (its gradient is ∂L/∂Φ2)."""
        A1, h1 = self.lower_block(params, tokens)
        h2 = h1 + self.feed_forward(params, h1)
        query = h2[:, -1, :]
        logits2 = jnp.einsum("bk,bjk->bj", query @ params["W_Q2"], h2 @ params["W_K2"])
        A2 = jax.nn.softmax(logits2 if upper_shift is None else logits2 + upper_shift, axis=-1)
        return A1, A2, h2

    def forward(self, params: Params, tokens: jax.Array, upper_shift: jax.Array | None = None) -> jax.Array:
        """Logits (batch, d) of the next token after each context ``tokens`` (batch, s)."""
        _, A2, h2 = self.streams(params, tokens, upper_shift)
        h3 = h2[:, -1, :] + jnp.einsum("bj,bjm->bm", A2, h2 @ params["W_V2"] @ params["W_O2"])
        return h3 @ params["W_U"]


Model = OneLayerTransformer | TwoLayerTransformer | PositionalTwoLayerTransformer


MODEL_CLASSES = {"one_layer": OneLayerTransformer, "two_layer": TwoLayerTransformer}


def model_from_config(model: ModelConfig, d: int) -> Model:
    """The model of a [model] section over d tokens: the options its class has, the rest ignored
    (a one-layer model has no ``ffn``); a bad option is a ConfigError."""
    if model.kind not in MODEL_CLASSES:
        raise ConfigError(f"model.kind = {model.kind!r} is not a flowsim model; expected one of {sorted(MODEL_CLASSES)}")
    cls = MODEL_CLASSES[model.kind]
    options = {f.name: getattr(model, f.name) for f in dataclasses.fields(cls) if f.name not in ("d", "fused_products")}
    try:
        return cls(d=d, **options)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def model_for_params(params: Params, **options) -> OneLayerTransformer:
    """The model whose shapes match ``params`` (value matrix if W_V is present)."""
    d, m = np.shape(params["W0"])
    k = np.shape(params["W_Q"])[1]
    return OneLayerTransformer(d=int(d), m=int(m), k=int(k), value_matrix="W_V" in params, **options)
