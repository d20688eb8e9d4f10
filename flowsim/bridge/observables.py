"""Observables of a torch model at a checkpoint, in flowsim's column names, so the
flowsim stage detectors and specialisation probes read a bridge run like an ODE run.

Attention is measured on a fixed probe set: contexts whose last token is of each
(folded) type; for each query type I and key type J, A[I, J] is the mean over the
probe contexts ending in I of the attention mass the last position puts on positions
of type J. Token types are folded: the top-d tokens by frequency keep their own type,
every other token is type d ("other"); for a Markov chain of d states nothing is folded.

Columns (T = checkpoints): ``loss``, ``val_loss``, singular values ``sv_*`` and stable
ranks; for the paper model (one attention layer) ``attention``, ``attention_entropy``,
``attention_mass_top`` over folded types; for several layers the same with a suffix
``_L`` (L = 1, 2, ...), plus for the GPT family ``ffn_write_L`` (mean squared norm of
the FFN's residual write) and ``stream_L`` (the mean residual stream per type after
block L, from which ``basis_angle_L``, the largest principal angle to its span at the
last checkpoint, ``basis_drift_L``, the angle to the previous checkpoint, and
``basis_doubling_angle_L``, the angle to the first checkpoint at twice the time, follow);
``embedding_norm`` per folded type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.linalg import subspace_angles

from flowsim.bridge.models import GPT, OneLayerTorch, TwoLayerTorch
from flowsim.observe.families import KIND_CONSTANT
from flowsim.observe.observables import Observables, attention_entropy, doubling_angles, stable_rank


@dataclass(frozen=True)
class ProbeSet:
    """Fixed probe contexts (n, s), the folded type of every vocabulary id, and π over folded types."""

    contexts: torch.Tensor
    fold: np.ndarray
    pi: np.ndarray

    @property
    def n_types(self) -> int:
        return len(self.pi)


def build_probe_set(pool: torch.Tensor, fold: np.ndarray, frequencies: np.ndarray, per_type: int) -> ProbeSet:
    """Up to ``per_type`` contexts from ``pool`` (n, s) ending in each folded type."""
    n_types = int(fold.max()) + 1
    last = fold[pool[:, -1].numpy()]
    chosen = np.concatenate([np.flatnonzero(last == t)[:per_type] for t in range(n_types)])
    pi = np.bincount(fold, weights=frequencies, minlength=n_types)
    return ProbeSet(pool[np.sort(chosen)], fold, pi / pi.sum())


def folded_attention(weights: torch.Tensor, contexts: torch.Tensor, fold: np.ndarray, n_types: int) -> np.ndarray:
    """A[I, J] from last-position attention ``weights`` (n, s) over ``contexts`` (n, s)."""
    types = torch.as_tensor(fold, device=contexts.device)[contexts]  # (n, s)
    mass = torch.zeros(len(contexts), n_types, dtype=torch.float64, device=contexts.device)
    mass.scatter_add_(1, types, weights.to(torch.float64))
    query = types[:, -1]
    total = torch.zeros(n_types, n_types, dtype=torch.float64, device=contexts.device).index_add_(0, query, mass)
    count = torch.bincount(query, minlength=n_types).to(torch.float64).clamp_min(1)[:, None]
    attention = (total / count).cpu().numpy()
    attention[count.cpu().numpy()[:, 0] == 0] = np.nan  # never the case with a probe set per type
    return attention


def _factored_singular_values(left: torch.Tensor, middle: torch.Tensor, symmetric: bool = False) -> np.ndarray:
    """Singular values of left @ middle (@ left^T when ``symmetric``) through the R factor
    of left = Q R (Q has orthonormal columns): cheap for large vocabularies."""
    _, R = torch.linalg.qr(left.detach().to(torch.float64))
    middle = middle.detach().to(torch.float64)
    return torch.linalg.svdvals(R @ middle @ R.T if symmetric else R @ middle).cpu().numpy()


def _folded_norms(embedding: torch.Tensor, fold: np.ndarray, frequencies: np.ndarray, n_types: int) -> np.ndarray:
    """Per folded type the frequency-weighted RMS norm of its tokens' embeddings."""
    squared = (embedding.detach().to(torch.float64) ** 2).sum(dim=1).cpu().numpy()
    weights = np.bincount(fold, weights=frequencies + 1e-300, minlength=n_types)
    return np.sqrt(np.bincount(fold, weights=squared * (frequencies + 1e-300), minlength=n_types) / weights)


@torch.no_grad()
def checkpoint_observables(model: torch.nn.Module, probe: ProbeSet, frequencies: np.ndarray) -> dict[str, np.ndarray]:
    """One checkpoint's observables (no time axis)."""
    n_types, columns = probe.n_types, {}
    contexts = probe.contexts.to(next(model.parameters()).device)
    if isinstance(model, OneLayerTorch):
        _, (weights,) = model(contexts, return_attention=True)
        layers = {"": folded_attention(weights, contexts, probe.fold, n_types)}
        matrices = {"W0": model.W0, "W1": model.W1, "W_Q": model.W_Q, "W_K": model.W_K}
        columns["sv_M"] = _factored_singular_values(model.W0, model.W_V @ model.W1 if model.spec.value_matrix else model.W1)
        columns["sv_Phi"] = _factored_singular_values(model.W0, model._scale * model.W_Q @ model.W_K.T, symmetric=True)
        embedding = model.W0
    elif isinstance(model, TwoLayerTorch):
        _, (first, second) = model(contexts, return_attention=True)
        layers = {f"_{layer}": folded_attention(w, contexts, probe.fold, n_types) for layer, w in ((1, first), (2, second))}
        matrices = {name: getattr(model, name) for name in ("W_E", "W_Q1", "W_K1", "W_Q2", "W_K2")}
        embedding = model.W_E
    elif isinstance(model, GPT):
        _, attentions, writes, streams = model(contexts, return_internals=True)
        layers = {f"_{layer + 1}": folded_attention(a[:, -1, :], contexts, probe.fold, n_types) for layer, a in enumerate(attentions)}
        matrices = {"embedding": model.embedding.weight}
        for layer, block in enumerate(model.blocks, start=1):
            matrices[f"W_Q{layer}"], matrices[f"W_K{layer}"] = block.attn.W_Q.weight, block.attn.W_K.weight
            columns[f"ffn_write_{layer}"] = np.asarray(writes[layer - 1].to(torch.float64).pow(2).sum(-1).mean().item())
            types = torch.as_tensor(probe.fold, device=contexts.device)[contexts].reshape(-1)
            stream = streams[layer - 1].reshape(-1, streams[layer - 1].shape[-1]).to(torch.float64)
            sums = torch.zeros(n_types, stream.shape[1], dtype=torch.float64, device=stream.device).index_add_(0, types, stream)
            columns[f"stream_{layer}"] = (sums / torch.bincount(types, minlength=n_types).clamp_min(1)[:, None]).cpu().numpy()
        embedding = model.embedding.weight
    else:
        raise TypeError(f"no observables for {type(model).__name__}")
    for name, matrix in matrices.items():
        sigma = torch.linalg.svdvals(matrix.detach().to(torch.float64)).cpu().numpy()
        columns[f"sv_{name}"] = sigma
    top = int(np.argmax(probe.pi))
    for suffix, attention in layers.items():
        columns[f"attention{suffix}"] = attention
        columns[f"attention_entropy{suffix}"] = attention_entropy(attention[None])[0]
        columns[f"attention_mass_top{suffix}"] = attention[:, top]
    columns["embedding_norm"] = _folded_norms(embedding, probe.fold, frequencies, n_types)
    return columns


def stack_observables(t: np.ndarray, rows: list[dict[str, np.ndarray]], pi: np.ndarray, kind: str) -> Observables:
    """Stack checkpoint rows into flowsim Observables (stable ranks and basis angles added) of a model of ``kind``
    (``model.kind``: a flowsim family's, or "gpt"), recorded among the constants as flowsim's runs record theirs."""
    columns = {name: np.stack([np.asarray(row[name]) for row in rows]) for name in rows[0]}
    for name in [n for n in columns if n.startswith("sv_")]:
        columns[f"stable_rank_{name[3:]}"] = stable_rank(columns[name])
    for name in [n for n in columns if n.startswith("stream_")]:
        layer, streams = name.split("_", 1)[1], columns[name]
        columns[f"basis_angle_{layer}"] = np.array([subspace_angles(s.T, streams[-1].T).max() for s in streams])
        columns[f"basis_drift_{layer}"] = np.array([0.0] + [subspace_angles(a.T, b.T).max() for a, b in zip(streams[:-1], streams[1:])])
        columns[f"basis_doubling_angle_{layer}"] = doubling_angles(t, [s.T for s in streams])
    return Observables(t=np.asarray(t, dtype=float), columns=columns, constants={"pi": np.asarray(pi), KIND_CONSTANT: np.asarray(kind)})
