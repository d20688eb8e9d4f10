"""Observables along a trajectory: one container of named columns over time.

Per saved time t (leading axis of every column):

    loss                          the trajectory's loss
    sv_X, stable_rank_X           singular values (descending) and stable rank ‖X‖_F² / σ1²
                                  of X in W0, W1, W_Q, W_K, M (token-to-logit map), Phi (logits); for M and Φ
                                  their min(d, m) non-zero ones, through W0's R factor (no d x d SVD)
    attention                     mean-field attention A = softmax(Φ + log π), rows = queries: (d, d) up to
                                  d = FULL_ATTENTION_MAX_D, else folded to the most frequent types and "other"
                                  (``observables.fold_d``; the constant ``attention_fold`` maps tokens to rows)
    attention_entropy             -Σ_j A[i, j] log A[i, j] per query i (nats), over the whole A, every query
    attention_mass_top            A[i, j*] per query, j* the most frequent token (largest π)
    embedding_norm                ‖W0[i, :]‖ per token
    embedding_pc                  projections of W0(t) - mean_t W0 on the principal directions
                                  of the embedding trajectory (the directions are a constant)
    grad_norm_G                   ‖∂L/∂G‖ per parameter group G (when a flow is given)

For the two-layer model (``two_layer_observables``): sv_X for X in W_E, W_Q1, W_K1, W_Q2,
W_K2 and h2; attention_L, attention_entropy_L, attention_mass_top_L per layer L = 1, 2;
embedding_norm (rows of W_E); basis_angle (largest principal angle between span h2(t)
and span h2 at the last time) and basis_doubling_angle (the same angle between t and the
first saved time >= 2t: how far the basis still turns over one doubling of time, a
measure that does not refer to the run's end; ``doubling_angles``); grad_norm_G.

For the two-layer model over positions on a sequence task (``positional_observables``),
averaged over the task's contexts with their exact probabilities: attention_entropy_1 per
token type (the lower layer's rows at positions 2..s, by the token there),
attention_entropy_2 per query type x_s; prev_token_mass (the lower layer's mean attention
on the previous position), induction_mass (the upper layer's attention on positions j whose
previous token equals the query, the circuit the task rewards); sv_h2 (square roots of the
eigenvalues of the residual stream's second moment E Σ_i h2_i^T h2_i) and basis_angle (its
top-min(2d, m-1) eigenspace at t against the last time) and basis_doubling_angle (against
2t); sv_X for the weights; grad_norm_G.

Saved as ``observables.npz`` (every column and constant) and ``observables.csv`` (every
column flattened to scalar columns: ``attention_entropy[0]``, ``attention[1,2]``, ...).

The one-layer observables are computed save by save: nothing d x d is kept, and the memory they need beyond the
trajectory (``observables_memory_bytes``) is O(T (d + f²)) for the kept columns plus O(d²) for one save's work (its
cost at d = 1000: benchmarks/MEASUREMENTS.md, "Observables and labels at the real vocabulary").
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy.linalg import subspace_angles

from flowsim.model.flow import GradientFlow
from flowsim.common.io import REMEDY, DamagedFileError, read_npz, write_atomic_bytes, write_atomic_npz
from flowsim.model.models import Model, OneLayerTransformer, PositionalTwoLayerTransformer, TwoLayerTransformer
from flowsim.model.tasks import SequenceLaw
from flowsim.solve.trajectory import Trajectory

OBSERVABLES_NPZ, OBSERVABLES_CSV = "observables.npz", "observables.csv"
# Constants that say where observables.npz came from: the digest of the trajectory.npz it was
# computed from (a cache, recomputed when that changes), or what measured it (primary data).
TRAJECTORY_DIGEST, MEASURED_BY = "trajectory_sha256", "measured_by"
N_PRINCIPAL_DIRECTIONS = 3


@dataclass(frozen=True)
class Observables:
    """``columns[name]`` has leading axis len(t); ``constants`` are not indexed by time."""

    t: np.ndarray
    columns: dict[str, np.ndarray]
    constants: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, column in self.columns.items():
            if len(column) != len(self.t):
                raise ValueError(f"observable {name} has {len(column)} rows, expected {len(self.t)} (one per time)")

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def until(self, end: float) -> "Observables":
        """The observables of the trajectory cut at ``end``: each column is a function of its own time alone, so the
        cut's are the whole's first rows."""
        keep = self.t <= end
        return Observables(self.t[keep], {name: column[keep] for name, column in self.columns.items()}, self.constants)

    def scalar_columns(self) -> dict[str, np.ndarray]:
        """Every column split into 1-d series named ``name`` or ``name[i]`` / ``name[i,j]``."""
        table = {"t": self.t}
        for name, column in self.columns.items():
            if column.ndim == 1:
                table[name] = column
                continue
            for index in np.ndindex(column.shape[1:]):
                table[f"{name}[{','.join(str(i) for i in index)}]"] = column[(slice(None), *index)]
        return table

    def save(self, run_dir: Path) -> None:
        """Write observables.npz and observables.csv atomically; the CSV costs about 0.5 µs a value (seconds for a
        d = 256 run's millions of attention entries)."""
        run_dir = Path(run_dir)
        constants = {f"constant:{name}": value for name, value in self.constants.items()}
        write_atomic_npz(run_dir / OBSERVABLES_NPZ, {"t": self.t, **self.columns, **constants})
        table = self.scalar_columns()
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(table)
        # formatted in a Python loop, not numpy's: a KeyboardInterrupt raised inside np.char.mod's C loop is dropped
        writer.writerows(zip(*(["%.17g" % value for value in column.tolist()] for column in table.values())))
        write_atomic_bytes(run_dir / OBSERVABLES_CSV, text.getvalue().encode())

    @classmethod
    def load(cls, run_dir: Path) -> "Observables":
        """Read observables.npz; a damaged file raises ``flowsim.common.io.DamagedFileError``."""
        path = Path(run_dir) / OBSERVABLES_NPZ
        arrays = read_npz(path, required=("t",))
        t = arrays.pop("t")
        constants = {name.split(":", 1)[1]: arrays.pop(name) for name in list(arrays) if name.startswith("constant:")}
        try:
            return cls(t=t, columns=arrays, constants=constants)
        except ValueError as error:
            raise DamagedFileError(path, str(error), REMEDY) from None


def singular_values(matrices: np.ndarray) -> np.ndarray:
    """Singular values, descending, of each matrix in a stack of shape (T, a, b)."""
    return np.linalg.svd(np.asarray(matrices), compute_uv=False)


def stable_rank(sigma: np.ndarray) -> np.ndarray:
    """‖X‖_F² / ‖X‖_2² from singular values (T, r); NaN where X = 0."""
    top = sigma[:, 0] ** 2
    return np.divide(np.sum(sigma**2, axis=1), top, out=np.full(len(sigma), np.nan), where=top > 0)


def attention_entropy(attention: np.ndarray) -> np.ndarray:
    """Entropy (nats) of each query's attention row: -Σ_j A[i, j] log A[i, j], shape (..., d)."""
    safe = np.where(attention > 0, attention, 1.0)
    return -np.sum(attention * np.log(safe), axis=-1)


def doubling_angles(t: np.ndarray, spans: list[np.ndarray] | np.ndarray) -> np.ndarray:
    """The largest principal angle between span(spans[i]) and the span at the first saved
    time >= 2 t_i (spans[i]: a basis as columns). Over one doubling of time, so a subspace
    that settles on a logarithmic clock reads as settled whatever the horizon. NaN where
    t_i <= 0 or 2 t_i is past the last saved time. O(T m r²) for T bases of shape (m, r)."""
    t = np.asarray(t, dtype=float)
    partner = np.searchsorted(t, 2.0 * t, side="left")
    angles = np.full(len(t), np.nan)
    for i in np.flatnonzero((t > 0) & (partner < len(t))):
        angles[i] = subspace_angles(spans[i], spans[partner[i]]).max()
    return angles


def principal_directions(embeddings: np.ndarray, n_directions: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PCA of the embedding trajectory: flattened W0(t) (T, d·m), centred over time.

    Returns (directions (n, d·m), explained variance fractions (n,), projections (T, n)). Through the T x T Gram
    matrix C Cᵀ of the centred rows C (its eigenvectors are C's left singular vectors): O(T² d m) time and no
    copy beyond C, where an SVD of C would hold two more T x d·m arrays.
    """
    flat = embeddings.reshape(len(embeddings), -1)
    centred = flat - flat.mean(axis=0)
    eigenvalues, vectors = np.linalg.eigh(centred @ centred.T)  # ascending
    order = np.argsort(eigenvalues)[::-1]
    variance = np.clip(eigenvalues[order], 0.0, None)
    total = variance.sum()
    n = min(n_directions, len(variance))
    scales = np.sqrt(variance[:n])
    live = scales > np.sqrt(total) * 1e-7  # below this the Gram matrix's rounding decides the direction: none is kept
    directions = np.zeros((n, flat.shape[1]))
    directions[live] = (vectors[:, order[:n][live]].T @ centred) / scales[live, None]
    explained = variance[:n] / total if total > 0 else np.zeros(n)
    return directions, explained, centred @ directions.T


# Attention is kept whole up to this many types (16 x 16 = 256 entries per save); above it, folded to the
# FOLDED_ATTENTION_TYPES most frequent types and "other", as the bridge folds its runs (a d = 1000 run kept whole
# would hold T x 8 MB of attention and write it to observables.csv as text).
FULL_ATTENTION_MAX_D = 16
FOLDED_ATTENTION_TYPES = 16


def folded_types(frequencies: np.ndarray, d: int, tracked: tuple[int, ...] = ()) -> np.ndarray:
    """Map each vocabulary id to a folded type: the top-d ids by frequency keep 0..d-1
    (in order of frequency), the ``tracked`` ids follow, every other id is the last
    type ("other")."""
    if not isinstance(d, (int, np.integer)) or not 2 <= d < len(frequencies):
        raise ValueError(f"fold_d must be an integer in [2, {len(frequencies) - 1}], got {d!r}")
    order = [int(i) for i in np.argsort(-np.asarray(frequencies), kind="stable")[:d]]
    keep = order + [i for i in tracked if i not in order]
    fold = np.full(len(frequencies), len(keep), dtype=np.int64)
    fold[keep] = np.arange(len(keep))
    return fold


def kept_attention_types(d: int, fold_d: int | None = None) -> int:
    """The rows (and columns) of the attention kept for d types: d when kept whole, else fold_d + 1 (the last
    is "other"). ``fold_d`` (``observables.fold_d``): the number of most frequent types kept apart; None: whole
    up to FULL_ATTENTION_MAX_D types, else FOLDED_ATTENTION_TYPES. Folding d - 1 or more types keeps it whole."""
    if fold_d is None:
        fold_d = d if d <= FULL_ATTENTION_MAX_D else FOLDED_ATTENTION_TYPES
    return d if fold_d >= d - 1 else fold_d + 1


def attention_fold(pi: np.ndarray, fold_d: int | None = None) -> np.ndarray | None:
    """The folded type of each token for the kept attention (``kept_attention_types``), or None to keep it whole."""
    kept = kept_attention_types(len(pi), fold_d)
    return None if kept == len(pi) else folded_types(np.asarray(pi, dtype=float), kept - 1)


def folding_matrices(pi: np.ndarray, fold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys (d, f), queries (f, d)) with A_folded = queries @ A @ keys: a folded key type's mass is the sum of its
    types' masses; a folded query type's row is the π-weighted mean of its types' rows (as the bridge's probe set
    averages a folded query's contexts)."""
    n_types = int(fold.max()) + 1
    keys = np.eye(n_types)[fold]
    queries = (keys * np.asarray(pi, dtype=float)[:, None]).T
    return keys, queries / queries.sum(axis=1, keepdims=True)


def observables_memory_bytes(d: int, m: int, n_saves: int, fold_d: int | None = None) -> float:
    """Peak memory of ``one_layer_observables`` beyond the trajectory itself: the columns kept (per save: three
    d-vectors, the kept attention and a few singular values) with observables.csv's text of them (about 25 bytes
    a number), and one save's d x d working arrays (logits, attention and their products: 4 d² numbers), which
    do not grow with the number of saves."""
    per_save = 4 * d + kept_attention_types(d, fold_d) ** 2 + 8 * min(d, m) + 16
    return n_saves * per_save * (8.0 + 25.0) + 4 * 8.0 * d * d


def _attention_probe(model: Model, params: dict, pi: jax.Array, top: int, keys: jax.Array | None,
                     queries: jax.Array | None) -> dict[str, jax.Array]:
    """One saved time of a one-layer model: each query's attention entropy and mass on the frequent token, and the
    kept attention (``queries @ A @ keys``, or A whole when they are None). O(d² (k + f)) time for f kept types,
    O(d²) memory: nothing d x d outlives the call."""
    logits = model.attention_logits(params) + jnp.log(pi)[None, :]
    logits = logits - logits.max(axis=1, keepdims=True)
    weights = jnp.exp(logits)
    total = weights.sum(axis=1)
    attention = weights / total[:, None]  # mean_field_attention, with the entropy from the same pass:
    entropy = jnp.log(total) - jnp.sum(attention * logits, axis=1)  # H = log Σ e^l - Σ a l, one exponential per entry
    return {"attention_entropy": entropy, "attention_mass_top": attention[:, top],
            "attention": attention if keys is None else queries @ (attention @ keys)}


def _factored_singular_values(model: Model, params: dict) -> dict[str, jax.Array]:
    """The non-zero singular values of M and Φ at one saved time, through W0 = Q R: sv(M) = sv(R W1) (R W_V W1
    with a value matrix), sv(Φ) = sv(κ R W_Q W_K^T R^T). O(d m² + m³), where a d x d SVD costs O(d³)."""
    R = jnp.linalg.qr(params["W0"], mode="r")
    factored = {**params, "W0": R}
    return {"sv_M": jnp.linalg.svd(model.value_map(factored), compute_uv=False),
            "sv_Phi": jnp.linalg.svd(model.attention_logits(factored), compute_uv=False)}


# Two compiled calls per save: one program holding both ran slower (benchmarks/MEASUREMENTS.md, "Observables and
# labels at the real vocabulary").
_attention_probe_jit = jax.jit(_attention_probe, static_argnums=(0, 3))
_factored_singular_values_jit = jax.jit(_factored_singular_values, static_argnums=0)


def attention_probes(trajectory: Trajectory, model: Model, pi: np.ndarray, fold: np.ndarray | None,
                     keep_attention: bool = True) -> dict[str, np.ndarray]:
    """``_attention_probe`` (and, with ``keep_attention``, ``_factored_singular_values``) at every saved time, one
    save at a time (each compiled once per model shape), stacked. Peak memory: the stacked columns
    (O(T (d + f²))) and one save's O(d²) working arrays, whatever T is."""
    top = int(np.argmax(pi))
    keys, queries = (None, None) if fold is None else (jnp.asarray(m) for m in folding_matrices(pi, fold))
    pi = jnp.asarray(pi, dtype=float)
    rows = []
    for index in range(len(trajectory)):
        params = trajectory.at(index)
        row = _attention_probe_jit(model, params, pi, top, keys, queries)
        if keep_attention:
            row.update(_factored_singular_values_jit(model, params))
        else:
            row.pop("attention")
        rows.append({name: np.asarray(value) for name, value in row.items()})
    return {name: np.stack([row[name] for row in rows]) for name in rows[0]}


def weight_spectra(params: dict, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """sv_X and stable_rank_X per saved time for the weight stacks ``params[X]`` (leading axis = time)."""
    columns = {}
    for name in names:
        sigma = singular_values(params[name])
        columns[f"sv_{name}"], columns[f"stable_rank_{name}"] = sigma, stable_rank(sigma)
    return columns


def one_layer_observables(trajectory: Trajectory, model: Model, pi: np.ndarray, flow: GradientFlow | None = None,
                          fold_d: int | None = None) -> Observables:
    """All observables of a one-layer trajectory on a chain with frequencies ``pi`` (gradient norms when ``flow``
    is given), save by save: the attention is kept whole, or folded to the ``fold_d`` most frequent types and
    "other" (``attention_fold``; the constant ``attention_fold`` maps each token to its row), and M and Φ (d x d)
    are never stored. Memory beyond the trajectory: ``observables_memory_bytes``. Time O(T d² (k + f) + T d m²)."""
    fold = attention_fold(pi, fold_d)
    columns = {"loss": np.asarray(trajectory.loss), **weight_spectra(trajectory.params, ("W0", "W1", "W_Q", "W_K"))}
    probes = attention_probes(trajectory, model, pi, fold)
    for name in ("M", "Phi"):
        columns[f"sv_{name}"] = probes[f"sv_{name}"]
        columns[f"stable_rank_{name}"] = stable_rank(probes[f"sv_{name}"])
    for name in ("attention", "attention_entropy", "attention_mass_top"):
        columns[name] = probes[name]
    columns["embedding_norm"] = np.linalg.norm(trajectory.params["W0"], axis=2)
    directions, explained, projections = principal_directions(trajectory.params["W0"], N_PRINCIPAL_DIRECTIONS)
    columns["embedding_pc"] = projections
    if flow is not None:
        for name, norms in gradient_norms(trajectory, flow).items():
            columns[f"grad_norm_{name}"] = norms
    constants = {"embedding_pc_directions": directions, "embedding_pc_explained": explained, "pi": np.asarray(pi)}
    if fold is not None:
        constants["attention_fold"] = fold
    return Observables(t=np.asarray(trajectory.t), columns=columns, constants=constants)


def stage_observables(trajectory: Trajectory, pi: np.ndarray) -> Observables:
    """What the stage detectors read of a one-layer trajectory (paper model), at any vocabulary size:
    loss, singular values of W0, W1, W_Q, W_K, per-query attention entropy and mass on the frequent
    token, embedding norms. Nothing d x d is kept: O(T d² k) time, O(T d + d²) memory."""
    params = trajectory.params
    model = OneLayerTransformer(d=params["W0"].shape[1], m=params["W0"].shape[2], k=params["W_Q"].shape[2])
    probes = attention_probes(trajectory, model, pi, fold=None, keep_attention=False)
    columns = {"loss": np.asarray(trajectory.loss), **weight_spectra(params, ("W0", "W1", "W_Q", "W_K"))}
    columns["attention_entropy"] = probes["attention_entropy"]
    columns["attention_mass_top"] = probes["attention_mass_top"]
    columns["embedding_norm"] = np.linalg.norm(params["W0"], axis=2)
    return Observables(t=np.asarray(trajectory.t), columns=columns, constants={"pi": np.asarray(pi)})


@functools.partial(jax.jit, static_argnums=0)
def _two_layer_maps(model: TwoLayerTransformer, params: dict, pi: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(A1, A2, h2)(t) along a trajectory (``TwoLayerTransformer.attention_maps``)."""
    return jax.vmap(model.attention_maps, in_axes=(0, None))(params, pi)


def two_layer_observables(
    trajectory: Trajectory, model: TwoLayerTransformer, pi: np.ndarray, flow: GradientFlow | None = None
) -> Observables:
    """The hierarchical model's probes: per layer (1: lower, 2: upper) the attention, its
    entropy per query and its mass on the most frequent token; singular values of W_E and
    of the Q/K matrices; embedding norms; the residual basis h2 and its maturity: the
    largest principal angle between span(h2(t)) and span(h2 at the last time)."""
    A1, A2, h2 = (np.asarray(x) for x in _two_layer_maps(model, dict(trajectory.params), jnp.asarray(pi)))
    columns = {"loss": np.asarray(trajectory.loss), **weight_spectra(trajectory.params, ("W_E", "W_Q1", "W_K1", "W_Q2", "W_K2"))}
    columns["sv_h2"] = singular_values(h2)
    top = int(np.argmax(pi))
    for layer, attention in ((1, A1), (2, A2)):
        columns[f"attention_{layer}"] = attention
        columns[f"attention_entropy_{layer}"] = attention_entropy(attention)
        columns[f"attention_mass_top_{layer}"] = attention[:, :, top]
    columns["embedding_norm"] = np.linalg.norm(trajectory.params["W_E"], axis=2)
    columns["basis_angle"] = np.array([subspace_angles(h.T, h2[-1].T).max() for h in h2])  # spans of the rows
    columns["basis_doubling_angle"] = doubling_angles(trajectory.t, [h.T for h in h2])
    if flow is not None:
        for name, norms in gradient_norms(trajectory, flow).items():
            columns[f"grad_norm_{name}"] = norms
    return Observables(t=np.asarray(trajectory.t), columns=columns, constants={"pi": np.asarray(pi)})


def _positional_probe(model: PositionalTwoLayerTransformer, params: dict, contexts: jax.Array, probability: jax.Array,
                      previous_matches: jax.Array, by_type: jax.Array) -> dict[str, jax.Array]:
    """The reduced probes at one time (see ``positional_observables``)."""
    A1, A2, h2 = model.streams(params, contexts)
    entropy = lambda a: -jnp.sum(jnp.where(a > 0, a * jnp.log(jnp.where(a > 0, a, 1.0)), 0.0), axis=-1)  # noqa: E731
    lower, upper = entropy(A1)[:, 1:], entropy(A2)  # (N, s-1), (N,)
    weight1 = probability[:, None, None] * by_type[:, 1:, :]  # (N, s-1, d): position i of type q
    weight2 = probability[:, None] * by_type[:, -1, :]
    previous = jnp.diagonal(A1, offset=-1, axis1=-2, axis2=-1)  # A1[i, i-1], (N, s-1)
    moment = jnp.einsum("n,nim,nil->ml", probability, h2, h2)
    return {"attention_entropy_1": jnp.einsum("ni,niq->q", lower, weight1) / weight1.sum(axis=(0, 1)),
            "attention_entropy_2": upper @ weight2 / weight2.sum(axis=0),
            "prev_token_mass": probability @ previous.mean(axis=1),
            "induction_mass": probability @ jnp.sum(A2 * previous_matches, axis=1),
            "moment": moment}


@functools.partial(jax.jit, static_argnums=0)
def _positional_probes(model: PositionalTwoLayerTransformer, params: dict, contexts, probability, previous_matches, by_type):
    return jax.lax.map(lambda p: _positional_probe(model, p, contexts, probability, previous_matches, by_type), params)


def positional_observables(
    trajectory: Trajectory, model: PositionalTwoLayerTransformer, law: SequenceLaw, flow: GradientFlow | None = None
) -> Observables:
    """Probes of the positional two-layer model on a sequence task, exact averages over the
    law's N contexts (module docstring). O(T N s (s + m) m) for T saved times."""
    contexts = np.asarray(law.contexts)
    # position j (>= 2) follows an occurrence of the query token: where the induction head should look
    previous_matches = np.zeros(contexts.shape, dtype=float)
    previous_matches[:, 1:] = contexts[:, :-1] == contexts[:, -1:]
    by_type = np.eye(model.d)[contexts]
    probes = {name: np.asarray(value) for name, value in _positional_probes(
        model, dict(trajectory.params), jnp.asarray(contexts), jnp.asarray(law.probability),
        jnp.asarray(previous_matches), jnp.asarray(by_type)).items()}
    moment = probes.pop("moment")
    eigenvalues, eigenvectors = np.linalg.eigh(moment)  # ascending
    rank = min(2 * model.d, model.m - 1)  # the token and previous-token features, a proper subspace
    top = eigenvectors[:, :, ::-1][:, :, :rank]
    columns: dict[str, np.ndarray] = {"loss": np.asarray(trajectory.loss), **probes}
    columns.update(weight_spectra(trajectory.params, ("W_E", "W_P", "W_Q1", "W_K1", "W_Q2", "W_K2")))
    columns["sv_h2"] = np.sqrt(np.clip(eigenvalues[:, ::-1], 0, None))
    columns["embedding_norm"] = np.linalg.norm(trajectory.params["W_E"], axis=2)
    columns["basis_angle"] = np.array([subspace_angles(basis, top[-1]).max() for basis in top])
    columns["basis_doubling_angle"] = doubling_angles(trajectory.t, top)
    if flow is not None:
        for name, norms in gradient_norms(trajectory, flow).items():
            columns[f"grad_norm_{name}"] = norms
    return Observables(t=np.asarray(trajectory.t), columns=columns, constants={"pi": law.query_law})


GRADIENT_NORM_ROWS = 64  # saves per chunk of gradients: O(64 n) numbers held, whatever T is


def gradient_norms(trajectory: Trajectory, flow: GradientFlow) -> dict[str, np.ndarray]:
    """‖∂L/∂G‖ (Frobenius) per parameter group G at each saved time (rates not applied), GRADIENT_NORM_ROWS saves
    at a time."""
    norms: dict[str, list[np.ndarray]] = {name: [] for name in flow.groups}
    for first in range(0, len(trajectory), GRADIENT_NORM_ROWS):
        rows = {name: value[first:first + GRADIENT_NORM_ROWS] for name, value in trajectory.params.items()}
        gradients = flow.gradient_along(flow.flatten_batch(rows))
        for name in flow.groups:
            norms[name].append(np.linalg.norm(gradients[:, flow.entries_of(name)], axis=1))
    return {name: np.concatenate(parts) for name, parts in norms.items()}
