"""Markov chains over the vocabulary [d] = {0, ..., d-1}: the data of every flow.

A chain is a row-stochastic transition matrix P with its stationary distribution π
(π^T P = π^T) and a law for the first token (π, or uniform). The paper family is

    P = λ I + (1 - λ) 1 π^T      (stay with probability λ, else draw from π),

whose stationary distribution is π. Any other P is accepted too, with π computed.
Chains are validated on construction: a chain whose stationary distribution is not
unique (several closed classes) or whose closed class is periodic is rejected. A
token with π_j = 0 (a transient state, e.g. the paper family with π_j = 0) is
allowed: it never occurs in the stationary data and receives no attention.
"""

from __future__ import annotations

import functools
from typing import Sequence, get_args

import numpy as np
import scipy.sparse
import scipy.sparse.csgraph

from flowsim.config import ChainConfig, ConfigError, StartLaw

STOCHASTIC_TOL = 1e-9


def _as_finite_array(name: str, value, ndim: int) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError) as error:
        if isinstance(value, (list, tuple)) and all(isinstance(row, (list, tuple)) for row in value):
            lengths = [len(row) for row in value]
            if len(set(lengths)) > 1:
                raise ValueError(f"{name} has rows of different lengths {lengths}; expected a square matrix") from error
        raise ValueError(f"{name} must be numeric, got {value!r}") from error
    if array.ndim != ndim:
        shape = "a vector" if ndim == 1 else "a square matrix"
        raise ValueError(f"{name} must be {shape}, got an array of shape {array.shape}")
    if not np.all(np.isfinite(array)):
        bad = np.argwhere(~np.isfinite(array))[0]
        raise ValueError(f"{name} has a non-finite entry {array[tuple(bad)]} at index {tuple(int(i) for i in bad)}")
    return array


def _check_probabilities(name: str, array: np.ndarray) -> None:
    """Rows of `array` (or the vector itself) must be non-negative and sum to 1."""
    if np.any(array < 0):
        bad = np.argwhere(array < 0)[0]
        raise ValueError(
            f"{name} has a negative entry {array[tuple(bad)]:.6g} at index {tuple(int(i) for i in bad)}; "
            "probabilities must be >= 0"
        )
    sums = array.sum(axis=-1)
    off = np.abs(sums - 1.0) > STOCHASTIC_TOL
    if np.any(off):
        if array.ndim == 1:
            raise ValueError(f"{name} sums to {float(sums):.12g}, expected 1 (tolerance {STOCHASTIC_TOL:g})")
        row = int(np.argmax(off))
        raise ValueError(
            f"{name} row {row} sums to {sums[row]:.12g}, expected 1 (tolerance {STOCHASTIC_TOL:g})"
        )


def closed_class(P: np.ndarray) -> np.ndarray:
    """The states of P's single closed class, or a ValueError naming why the stationary law
    is not unique (several closed classes) or the context frequencies do not converge (a
    periodic closed class). Transient states are allowed: their frequency is 0.

    Cost O(d²) for a dense P: strongly connected components of the transition graph
    (a class is closed when no edge leaves it), then the period of the closed class from
    breadth-first levels, gcd over its edges u -> v of level(u) + 1 - level(v)."""
    graph = scipy.sparse.csr_matrix(P > 0)
    n_components, component = scipy.sparse.csgraph.connected_components(graph, directed=True, connection="strong")
    sources, targets = graph.nonzero()
    leaving = component[sources] != component[targets]
    closed = np.setdiff1d(np.arange(n_components), component[sources[leaving]])
    if len(closed) > 1:
        listed = " and ".join(str(np.flatnonzero(component == c).tolist()) for c in closed[:2])
        raise ValueError(
            f"P is reducible with {len(closed)} closed classes of states ({listed}...), so the "
            "stationary distribution is not unique; expected a single closed class"
        )
    members = np.flatnonzero(component == closed[0])
    block = graph[members][:, members]
    level = scipy.sparse.csgraph.shortest_path(block, unweighted=True, indices=0).astype(np.int64)  # BFS levels
    u, v = block.nonzero()
    period = int(np.gcd.reduce(np.abs(level[u] + 1 - level[v]))) if len(u) else 0
    if period != 1:
        raise ValueError(
            f"P is periodic (period {period}); expected an aperiodic chain so that the context "
            "frequencies converge to a unique stationary distribution"
        )
    return members


def entropy_rate(pi: np.ndarray, P: np.ndarray) -> float:
    """Σ_i π_i H(P_i), in nats (0 log 0 = 0), O(d²)."""
    safe = np.where(P > 0, P, 1.0)
    return float(-np.asarray(pi) @ np.sum(P * np.log(safe), axis=1))


def stationary_distribution(P: np.ndarray, members: np.ndarray | None = None) -> np.ndarray:
    """π with π^T P = π^T, Σ π = 1, for P with one closed class (``members``; zero off it).
    One linear solve on the closed block, O(c³) for a class of c states."""
    members = closed_class(P) if members is None else members
    block = P[np.ix_(members, members)]
    system = block.T - np.eye(len(members))
    system[-1] = 1.0  # one balance equation is redundant: replace it by the normalisation
    rhs = np.zeros(len(members))
    rhs[-1] = 1.0
    pi = np.zeros(P.shape[0])
    pi[members] = np.clip(np.linalg.solve(system, rhs), 0.0, None)
    return pi / pi.sum()


def _as_counts(counts) -> np.ndarray:
    """Bigram counts as a float (d, d) array, or a ValueError naming the problem."""
    counts = _as_finite_array("counts", counts, 2)
    if counts.shape[0] != counts.shape[1]:
        raise ValueError(f"counts must be square (d x d), got shape {counts.shape}")
    if np.any(counts < 0):
        raise ValueError(f"counts must be >= 0, got {counts.min():g}")
    return counts


def bigram_counts(ids: np.ndarray, d: int, cyclic: bool = False) -> np.ndarray:
    """c[i, j] = the number of positions where token i is followed by token j, as a float (d, d) array.

    ``cyclic`` reads the sequence as a cycle (its last token followed by its first), so each
    token's row and column sums both equal its count: a closed walk, whose bigram chain has
    exactly the token frequencies as its stationary law. O(len(ids) + d²)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) < 2:
        raise ValueError(f"need a 1-d sequence of at least 2 token ids to count bigrams, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= d:
        raise ValueError(f"token ids must lie in [0, {d - 1}], got ids from {ids.min()} to {ids.max()}")
    following = np.roll(ids, -1) if cyclic else ids[1:]
    preceding = ids if cyclic else ids[:-1]
    return np.bincount(preceding * d + following, minlength=d * d).reshape(d, d).astype(float)


def cross_entropy_rate(P: np.ndarray, ids: np.ndarray) -> float:
    """The held-out bigram cross-entropy -mean_t log P[x_t, x_{t+1}] of a sequence, in nats (inf when a
    pair has probability 0). O(len(ids))."""
    ids = np.asarray(ids, dtype=np.int64)
    probabilities = np.asarray(P)[ids[:-1], ids[1:]]
    with np.errstate(divide="ignore"):
        return float(-np.mean(np.log(probabilities)))


BINARY_SEARCH_FROM_SIZE = 200  # tokens; below it the whole-row comparison is faster (benchmarks/MEASUREMENTS.md)


def inverse_cdf_rows(cumulative: np.ndarray, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """For each i, the number of entries of ``cumulative[rows[i]]`` that are <= u[i] (u in [0, 1)): the token that
    inverse-transform sampling draws from row ``rows[i]`` of a transition matrix whose row-wise cumulative sums
    are ``cumulative``. Those rows are non-decreasing below 1, so the entries <= u are a prefix, whose length
    is found by binary lifting: ⌊log2 d⌋ + 1 rounds of one gather per draw, O(n log d). Comparing whole rows,
    O(n d), is the faster route at small d."""
    d = cumulative.shape[1]
    if d <= BINARY_SEARCH_FROM_SIZE:
        return (u[:, None] >= cumulative[rows]).sum(axis=1)
    count = np.zeros(len(u), dtype=np.int64)
    step = 1 << (d.bit_length() - 1)  # the largest power of two <= d
    while step:
        candidate = np.minimum(count + step, d)
        count = np.where(cumulative[rows, candidate - 1] <= u, candidate, count)
        step >>= 1
    return count


def fit_unigram_weight(counts: np.ndarray, held_out: np.ndarray, tolerance: float = 1e-5) -> float:
    """The unigram weight w of ``MarkovChain.from_counts_interpolated`` that minimises the cross-entropy
    of a held-out sequence. The cross-entropy -mean log((1 - w) a_t + w b_t) is convex in w, so a
    bounded scalar search on [0, 1] finds its minimum (to ``tolerance``). O(len(held_out) log(1/tol))."""
    import scipy.optimize

    counts = np.asarray(counts, dtype=float)
    held_out = np.asarray(held_out, dtype=np.int64)
    d = len(counts)
    if held_out.ndim != 1 or len(held_out) < 2:
        raise ValueError(f"the held-out sequence needs at least 2 tokens (one transition), got shape {held_out.shape}")
    if held_out.min() < 0 or held_out.max() >= d:
        raise ValueError(f"held-out tokens must lie in 0 .. {d - 1} (the counts' d = {d}), got {held_out.min()} .. {held_out.max()}")
    n = counts.sum(axis=1)
    unigram = n / n.sum()
    pairs = held_out[:-1], held_out[1:]
    observed = np.divide(counts[pairs], n[pairs[0]], out=np.zeros(len(held_out) - 1), where=n[pairs[0]] > 0)
    background = unigram[pairs[1]]
    if np.any(background == 0):
        token = int(pairs[1][np.argmax(background == 0)])
        raise ValueError(f"token {token} occurs in the held-out sequence but never in the counts: no weight gives it "
                         "probability > 0")
    objective = lambda w: -np.mean(np.log((1.0 - w) * observed + w * background))  # noqa: E731
    return float(scipy.optimize.minimize_scalar(objective, bounds=(0.0, 1.0), method="bounded",
                                                options={"xatol": tolerance}).x)


class MarkovChain:
    """A validated Markov chain (π, P) over d tokens, with the law of the first token.

    Build it from the paper family, ``MarkovChain(pi=..., lam=...)``, or from any
    transition matrix, ``MarkovChain(P=...)`` (π computed; π may be given as well,
    and is then checked to be stationary). ``start`` is the law of x_1: "stationary"
    (x_1 ~ π, the default) or "uniform". Arrays are read-only.
    """

    def __init__(
        self,
        *,
        pi: Sequence[float] | np.ndarray | None = None,
        lam: float | None = None,
        P: Sequence[Sequence[float]] | np.ndarray | None = None,
        start: StartLaw = "stationary",
    ) -> None:
        if start not in get_args(StartLaw):
            raise ValueError(f"start must be 'stationary' or 'uniform', got {start!r}")
        if P is None and (pi is None or lam is None):
            raise ValueError("a chain needs either pi and lam (the paper family) or a transition matrix P")
        if P is not None and lam is not None:
            raise ValueError(f"give either lam (paper family) or P, not both (got lam={lam!r} and a P)")

        if P is None:
            pi_arr = _as_finite_array("pi", pi, 1)
            self._check_size(pi_arr.shape[0])
            _check_probabilities("pi", pi_arr)
            lam = float(_as_finite_array("lam", [lam], 1)[0])
            if lam == 1.0:
                raise ValueError(f"lam = {lam} makes P the identity (reducible); expected lam < 1")
            if lam > 1.0:
                raise ValueError(f"lam = {lam} gives P = lam I + (1 - lam) 1 pi^T negative off-diagonal entries; "
                                 "expected lam < 1")
            d = pi_arr.shape[0]
            P_arr = lam * np.eye(d) + (1.0 - lam) * np.outer(np.ones(d), pi_arr)
            _check_probabilities("P (from pi and lam)", P_arr)
            closed_class(P_arr)
        else:
            P_arr = _as_finite_array("P", P, 2)
            if P_arr.shape[0] != P_arr.shape[1]:
                raise ValueError(f"P must be square, got shape {P_arr.shape}")
            self._check_size(P_arr.shape[0])
            _check_probabilities("P", P_arr)
            members = closed_class(P_arr)
            if pi is None:
                pi_arr = stationary_distribution(P_arr, members)
            else:
                pi_arr = _as_finite_array("pi", pi, 1)
                if pi_arr.shape[0] != P_arr.shape[0]:
                    raise ValueError(f"pi has {pi_arr.shape[0]} entries but P is {P_arr.shape[0]}x{P_arr.shape[0]}")
                _check_probabilities("pi", pi_arr)
                residual = np.max(np.abs(pi_arr @ P_arr - pi_arr))
                if residual > STOCHASTIC_TOL:
                    raise ValueError(
                        f"pi is not stationary for P: max |pi^T P - pi^T| = {residual:.3g} "
                        f"(tolerance {STOCHASTIC_TOL:g})"
                    )

        pi_arr.flags.writeable = False
        P_arr.flags.writeable = False
        self.pi: np.ndarray = pi_arr
        self.P: np.ndarray = P_arr
        self.lam: float | None = lam
        self.start: StartLaw = start

    @classmethod
    def from_counts(cls, counts, smoothing: float = 0.0, start: StartLaw = "stationary") -> "MarkovChain":
        """The chain P[i, j] = (c_ij + α) / Σ_j' (c_ij' + α) of bigram counts c (d x d) with
        additive smoothing α >= 0; π its stationary law. O(d²) to build, O(d³) for π."""
        counts = _as_counts(counts)
        if not (np.isfinite(smoothing) and smoothing >= 0):
            raise ValueError(f"smoothing must be a number >= 0, got {smoothing!r}")
        totals = counts.sum(axis=1) + smoothing * counts.shape[1]
        if np.any(totals == 0):
            row = int(np.argmax(totals == 0))
            raise ValueError(f"token {row} is never followed by another token; use smoothing > 0")
        return cls(P=(counts + smoothing) / totals[:, None], start=start)

    @classmethod
    def from_text(cls, tokens: Sequence[str], vocab: Sequence[str], smoothing: float = 0.0,
                  unknown: str | None = "<unk>", start: StartLaw = "stationary") -> "MarkovChain":
        """The bigram chain of a token sequence over ``vocab`` (token i is vocab[i]): counts of
        consecutive pairs, then ``from_counts(counts, smoothing)``. A token outside the
        vocabulary counts as ``unknown`` (an error when that is None or not in vocab)."""
        index = {word: i for i, word in enumerate(vocab)}
        if len(index) != len(vocab):
            raise ValueError("vocab has repeated words")
        fallback = index.get(unknown) if unknown is not None else None
        ids = np.fromiter((index.get(word, -1) for word in tokens), dtype=np.int64)
        if np.any(ids < 0):
            if fallback is None:
                missing = next(word for word in tokens if word not in index)
                raise ValueError(f"token {missing!r} is not in the vocabulary and no unknown word is given")
            ids[ids < 0] = fallback
        if len(ids) < 2:
            raise ValueError(f"need at least 2 tokens to count bigrams, got {len(ids)}")
        return cls.from_counts(bigram_counts(ids, len(vocab)), smoothing, start)

    @classmethod
    def from_counts_interpolated(cls, counts, unigram_weight: float, start: StartLaw = "stationary") -> "MarkovChain":
        """The bigram frequencies interpolated with the unigram law (Jelinek-Mercer):

            P[i, j] = (1 - w) c_ij / n_i + w n_j / N,    n_i = Σ_j c_ij,  N = Σ_i n_i,

        with w = ``unigram_weight`` in [0, 1]. Every row keeps weight 1 - w on its own counts, however
        rare the token, and the pseudo-mass w follows the token frequencies, not the uniform law.
        When the counts are a closed walk (each token's row sum equals its column sum, as
        ``bigram_counts(ids, d, cyclic=True)`` gives) π is exactly the frequencies n / N for every w:
        Σ_i (n_i/N) P[i, j] = (1 - w) Σ_i c_ij / N + w n_j / N = n_j / N. A token that never occurs
        (n_i = 0) gets the unigram row and π_i = 0. O(d²), no linear solve on closed-walk counts."""
        counts = _as_counts(counts)
        if not (np.isfinite(unigram_weight) and 0 <= unigram_weight <= 1):
            raise ValueError(f"unigram_weight must be a number in [0, 1], got {unigram_weight!r}")
        n = counts.sum(axis=1)
        if n.sum() == 0:
            raise ValueError("counts are all zero: no bigram to estimate from")
        unigram = n / n.sum()
        observed = np.divide(counts, n[:, None], out=np.tile(unigram, (len(n), 1)), where=n[:, None] > 0)
        P = (1.0 - unigram_weight) * observed + unigram_weight * unigram[None, :]
        P /= P.sum(axis=1, keepdims=True)  # exact row sums against round-off
        closed_walk = np.allclose(n, counts.sum(axis=0), rtol=0, atol=0.5)
        return cls(P=P, pi=unigram if closed_walk else None, start=start)

    @classmethod
    def from_config(cls, chain: ChainConfig) -> "MarkovChain":
        """The chain of a [chain] section; a bad chain is a ConfigError naming the problem."""
        try:
            return cls(pi=chain.pi, lam=chain.lam, P=chain.P, start=chain.start)
        except ValueError as error:
            raise ConfigError(f"chain: {error}") from None

    def __repr__(self) -> str:
        return f"MarkovChain({self.describe()}, start={self.start!r})"

    @staticmethod
    def _check_size(d: int) -> None:
        if d < 2:
            raise ValueError(f"the vocabulary needs d >= 2 tokens, got d = {d}")

    @property
    def d(self) -> int:
        """Vocabulary size."""
        return self.P.shape[0]

    @property
    def start_distribution(self) -> np.ndarray:
        """The law of the first token x_1."""
        return self.pi if self.start == "stationary" else np.full(self.d, 1.0 / self.d)

    @property
    def entropy_rate(self) -> float:
        """The least next-token loss any predictor reaches on the stationary chain (``entropy_rate``): the
        Bayes loss of the mean-field loss, and of the finite-s losses from the stationary start."""
        return entropy_rate(self.pi, self.P)

    def sample(self, n_sequences: int, length: int, seed: int) -> np.ndarray:
        """Sample ``n_sequences`` paths x_1..x_length (int array, shape (n, length))."""
        if n_sequences < 1 or length < 1:
            raise ValueError(f"need n_sequences >= 1 and length >= 1, got {n_sequences} and {length}")
        rng = np.random.default_rng(seed)
        paths = np.empty((n_sequences, length), dtype=np.int64)
        start_cdf = np.cumsum(self.start_distribution)
        start_cdf[-1] = 1.0
        paths[:, 0] = np.searchsorted(start_cdf, rng.random(n_sequences), side="right")
        for position in range(1, length):
            paths[:, position] = inverse_cdf_rows(self._cumulative_P, paths[:, position - 1], rng.random(n_sequences))
        return paths

    @functools.cached_property
    def _cumulative_P(self) -> np.ndarray:
        cumulative = np.cumsum(self.P, axis=1)
        cumulative[:, -1] = 1.0  # guard against round-off leaving a gap at the top
        cumulative.flags.writeable = False
        return cumulative

    def cache_key(self) -> bytes:
        """Bytes that identify (P, π, start): used to cache exact context laws."""
        return self.P.tobytes() + self.pi.tobytes() + self.start.encode()

    def describe(self) -> str:
        if self.lam is not None:
            return f"paper chain pi={np.round(self.pi, 6).tolist()} lam={self.lam}"
        return f"chain with P (d={self.d}), pi={np.round(self.pi, 6).tolist()}"
