"""flowsim's models in PyTorch, and a small GPT family for multi-layer studies.

``OneLayerTorch`` and ``TwoLayerTorch`` have flowsim's parameter names and forward pass
(see flowsim.model.models): ``load_flowsim_params`` / ``flowsim_params`` move a parameter set
between the two, and the loss and gradient agree. Both predict the token after the last
position of a context (batch, s) -> logits (batch, d).

``GPT`` is a pre-norm decoder: token and position embeddings, L blocks of causal
multi-head attention (W_Q, W_K, W_V, W_O) and an FFN, a final norm and an unembedding.
The FFN (``mlp``: GELU; ``glu``: SwiGLU), the norm (``layernorm``, ``rmsnorm`` or
``none``) and biases are switched separately; the defaults pair mlp + LayerNorm +
biases and glu + RMSNorm without biases. It predicts every position (causal LM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from flowsim.model.models import OneLayerTransformer, TwoLayerTransformer


class FlowsimTorchModel(nn.Module):
    """A torch module whose parameters are flowsim's (same names and shapes)."""

    spec: OneLayerTransformer | TwoLayerTransformer

    def __init__(self, spec) -> None:
        super().__init__()
        self.spec = spec
        for name, shape in spec.shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=torch.float64)))

    def load_flowsim_params(self, params) -> FlowsimTorchModel:
        """Copy a flowsim parameter dict (numpy or JAX arrays) into this model."""
        self.spec.check_params(params)
        with torch.no_grad():
            for name in self.spec.shapes:
                target = getattr(self, name)
                target.copy_(torch.as_tensor(np.array(params[name]), dtype=target.dtype, device=target.device))
        return self

    def flowsim_params(self) -> dict[str, np.ndarray]:
        """This model's parameters as a flowsim dict of float64 numpy arrays."""
        return {name: getattr(self, name).detach().to("cpu", torch.float64).numpy().copy() for name in self.spec.shapes}

    @property
    def slow_groups(self) -> tuple[str, ...]:
        return self.spec.slow_groups

    @property
    def repeated_blocks(self) -> tuple[tuple[str, ...], ...]:
        return self.spec.repeated_blocks


class OneLayerTorch(FlowsimTorchModel):
    """The paper's one-layer model: logits = Σ_j a_j M[x_j] (+ W0 W1[x_s]), a = softmax_j Φ[x_s, x_j].

    Computed through the embeddings (Φ[x_s, x_j] = (W0[x_s] W_Q)·(W0[x_j] W_K) and
    Σ_j a_j M[x_j] = (Σ_j a_j W0[x_j]) (W_V) W1), never forming the d x d maps."""

    @property
    def _scale(self) -> float:
        return 1.0 if self.spec.logit_scale == "one" else 1.0 / math.sqrt(self.spec.k)

    def forward(self, tokens: torch.Tensor, return_attention: bool = False):
        embedded = self.W0[tokens]  # (batch, s, m)
        query = embedded[:, -1, :]
        scores = self._scale * torch.einsum("bk,bsk->bs", query @ self.W_Q, embedded @ self.W_K)
        weights = torch.softmax(scores, dim=-1)
        value = torch.einsum("bs,bsm->bm", weights, embedded)
        if self.spec.value_matrix:
            value = value @ self.W_V
        logits = value @ self.W1
        if self.spec.residual:
            logits = logits + query @ self.W1
        return (logits, [weights]) if return_attention else logits


class TwoLayerTorch(FlowsimTorchModel):
    """The hierarchical model: attention (over the whole context), FFN, attention of the last position."""

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.spec.ffn == "mlp":
            return F.gelu(h @ self.W_in) @ self.W_out
        if self.spec.ffn == "glu":
            return (F.silu(h @ self.W_gate) * (h @ self.W_up)) @ self.W_down
        return torch.zeros_like(h)

    def forward(self, tokens: torch.Tensor, return_attention: bool = False):
        h0 = self.W_E[tokens]
        A1 = torch.softmax((h0 @ self.W_Q1) @ (h0 @ self.W_K1).transpose(-1, -2), dim=-1)  # every position sees all
        h1 = h0 + A1 @ (h0 @ self.W_V1 @ self.W_O1)
        h2 = h1 + self.feed_forward(h1)
        query = h2[:, -1, :]
        A2 = torch.softmax(torch.einsum("bk,bjk->bj", query @ self.W_Q2, h2 @ self.W_K2), dim=-1)
        h3 = query + torch.einsum("bj,bjm->bm", A2, h2 @ self.W_V2 @ self.W_O2)
        logits = h3 @ self.W_U
        return (logits, [A1[:, -1, :], A2]) if return_attention else logits


def torch_model_for(spec) -> FlowsimTorchModel:
    """The torch twin of a flowsim model spec."""
    if isinstance(spec, OneLayerTransformer):
        return OneLayerTorch(spec)
    if isinstance(spec, TwoLayerTransformer):
        return TwoLayerTorch(spec)
    raise TypeError(f"no torch twin for {type(spec).__name__}")


# ---------------------------------------------------------------------------------
# The GPT family


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int = 4
    d_model: int = 64
    n_head: int = 4
    seq_len: int = 64
    ffn: str = "mlp"  # mlp (GELU) | glu (SwiGLU)
    norm: str | None = None  # layernorm | rmsnorm | none; default: layernorm for mlp, rmsnorm for glu
    bias: bool | None = None  # default: True for mlp, False for glu
    ffn_mult: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "seq_len", "ffn_mult"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model = {self.d_model} is not divisible by model.n_head = {self.n_head}")
        if self.ffn not in ("mlp", "glu"):
            raise ValueError(f"model.ffn must be 'mlp' or 'glu' for the GPT family, got {self.ffn!r}")
        if self.resolved_norm not in ("layernorm", "rmsnorm", "none"):
            raise ValueError(f"model.norm must be 'layernorm', 'rmsnorm' or 'none', got {self.norm!r}")

    @property
    def resolved_norm(self) -> str:
        return self.norm if self.norm is not None else ("layernorm" if self.ffn == "mlp" else "rmsnorm")

    @property
    def resolved_bias(self) -> bool:
        return self.bias if self.bias is not None else self.ffn == "mlp"


def _norm(config: GPTConfig) -> nn.Module:
    if config.resolved_norm == "layernorm":
        return nn.LayerNorm(config.d_model, bias=config.resolved_bias)
    if config.resolved_norm == "rmsnorm":
        return nn.RMSNorm(config.d_model)
    return nn.Identity()


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            setattr(self, name, nn.Linear(config.d_model, config.d_model, bias=config.resolved_bias))

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        batch, length, width = x.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(x).view(batch, length, self.n_head, width // self.n_head).transpose(1, 2)

        q, k, v = heads(self.W_Q), heads(self.W_K), heads(self.W_V)
        if return_attention:  # explicit weights (probes); training uses the fused kernel
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out = weights @ v
        else:
            weights, out = None, F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.W_O(out.transpose(1, 2).reshape(batch, length, width))
        return out, weights


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind, hidden, bias = config.ffn, config.ffn_mult * config.d_model, config.resolved_bias
        if self.kind == "glu":
            hidden = 2 * hidden // 3  # the usual SwiGLU width: the same parameter count as the MLP
            self.W_gate = nn.Linear(config.d_model, hidden, bias=bias)
        self.W_in = nn.Linear(config.d_model, hidden, bias=bias)
        self.W_out = nn.Linear(hidden, config.d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "glu":
            return self.W_out(F.silu(self.W_gate(x)) * self.W_in(x))
        return self.W_out(F.gelu(self.W_in(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm_attn, self.attn, self.norm_ffn, self.ffn = _norm(config), Attention(config), _norm(config), FeedForward(config)

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        update, weights = self.attn(self.norm_attn(x), return_attention)
        x = x + update
        write = self.ffn(self.norm_ffn(x))
        return x + write, weights, write


class GPT(nn.Module):
    """A small pre-norm decoder; ``forward(tokens)`` gives logits at every position."""

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_final = _norm(config)
        self.unembedding = nn.Linear(config.d_model, config.vocab_size, bias=False)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                nn.init.normal_(parameter, std=0.02 / (math.sqrt(2 * config.n_layer) if name.endswith(("W_O.weight", "W_out.weight")) else 1.0))
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)
        torch.random.set_rng_state(generator_state)

    @property
    def slow_groups(self) -> tuple[str, ...]:
        """The query and key weights of the upper half of the layers."""
        upper = range(self.config.n_layer // 2, self.config.n_layer)
        return tuple(f"blocks.{layer}.attn.{role}.weight" for layer in upper for role in ("W_Q", "W_K"))

    @property
    def repeated_blocks(self) -> tuple[tuple[str, ...], ...]:
        """Same-role, same-shape tensors of the blocks, ordered by depth (embeddings and head excluded)."""
        roles = [name.split(".", 2)[2] for name, _ in self.named_parameters() if name.startswith("blocks.0.")]
        return tuple(tuple(f"blocks.{layer}.{role}" for layer in range(self.config.n_layer)) for role in roles)

    def forward(self, tokens: torch.Tensor, return_internals: bool = False):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) + self.position(positions)
        attentions, writes, streams = [], [], []
        for block in self.blocks:
            x, weights, write = block(x, return_internals)
            if return_internals:
                attentions.append(weights.mean(dim=1))  # averaged over heads: (batch, s, s)
                writes.append(write)
                streams.append(x)
        logits = self.unembedding(self.norm_final(x))
        return (logits, attentions, writes, streams) if return_internals else logits
