"""Composition tasks: sequence laws whose Bayes predictor needs two attention steps.

A first-order chain lets a one-layer model reach the Bayes loss from the query alone. The
**induction task** (d tokens, contexts of length s, noise η) does not:

    g ~ uniform over the d! permutations of [d]            (one per sequence, never shown)
    x_1 ~ uniform on [d],   x_{t+1} = g(x_t) with probability 1 - η, else uniform on [d].

Averaged over g every transition is uniform, P(x_{t+1} = y | x_t) = 1/d, so a predictor that
reads only the query token x_s does no better than log d. The Bayes predictor reads the
successors of the earlier occurrences of x_s: P(x_{s+1} = y | x_{1:s}) = Σ_g p(g | x_{1:s})
[(1-η) 1{g(x_s) = y} + η/d]. A two-layer Transformer implements it as an induction circuit:
layer 1 (a previous-token head, by positions) writes x_{j-1} into position j's residual
stream; layer 2's query at s matches x_s against that written feature and copies x_j.

The law is exact by enumeration over the d^(s+1) sequences and the d! permutations,

    p(x_{1:s+1}) = (1/d!) Σ_g (1/d) Π_{t=1}^{s} [(1-η) 1{x_{t+1} = g(x_t)} + η/d],

O(d! · d^(s+1) · s) once per task (d = 4, s = 8: 5e7); ``SequenceLaw`` keeps the contexts
of positive probability, their probabilities and the law of the next token given each.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

# d! · d^(s+1): the (permutation, sequence) pairs the enumeration visits
ENUMERATION_LIMIT = 60_000_000


@dataclass(frozen=True)
class SequenceLaw:
    """The exact law of (context, next token): ``contexts`` (N, s) of positive probability,
    ``probability`` (N,) summing to 1, ``next_law`` (N, d) rows summing to 1."""

    contexts: np.ndarray
    probability: np.ndarray
    next_law: np.ndarray

    @property
    def bayes_loss(self) -> float:
        """E[-log P(x_{s+1} | x_{1:s})]: the least population loss of any predictor."""
        q = self.next_law
        entropy = -np.sum(np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0), axis=1)
        return float(self.probability @ entropy)

    @property
    def query_law(self) -> np.ndarray:
        """The law of the query token x_s (the last of the context)."""
        return np.bincount(self.contexts[:, -1], weights=self.probability, minlength=self.next_law.shape[1])


@dataclass(frozen=True)
class InductionTask:
    """The induction task over d tokens with contexts of length s and noise η (module docstring)."""

    d: int = 3
    s: int = 6
    noise: float = 0.1

    def __post_init__(self) -> None:
        for name in ("d", "s"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 2:
                raise ValueError(f"task.{name} must be an integer >= 2, got {value!r}")
        if not (isinstance(self.noise, (int, float)) and 0 <= self.noise < 1):
            raise ValueError(f"task.noise must be in [0, 1) (the chance of a uniform next token), got {self.noise!r}")
        log10_work = (math.lgamma(self.d + 1) + (self.s + 1) * math.log(self.d)) / math.log(10)  # no d! built
        if log10_work > math.log10(ENUMERATION_LIMIT):
            raise ValueError(f"the exact law of task d = {self.d}, s = {self.s} enumerates d!·d^(s+1) = 10^{log10_work:.1f} "
                             f"(permutation, sequence) pairs, over the limit {ENUMERATION_LIMIT:.3g}; lower task.s or task.d")

    def permutations(self) -> np.ndarray:
        return np.array(list(itertools.permutations(range(self.d))), dtype=np.int64)  # (d!, d)

    def transition_matrices(self) -> np.ndarray:
        """(d!, d, d): P_g[x, y] = (1-η) 1{y = g(x)} + η/d for each permutation g."""
        d, perms = self.d, self.permutations()
        return (1 - self.noise) * np.eye(d)[perms] + self.noise / d

    @functools.cached_property
    def law(self) -> SequenceLaw:
        d, s = self.d, self.s
        sequences = np.array(list(itertools.product(range(d), repeat=s + 1)), dtype=np.int64)
        P = self.transition_matrices()
        likelihood = np.ones((len(P), len(sequences))) / d
        for t in range(s):
            likelihood *= P[:, sequences[:, t], sequences[:, t + 1]]
        joint = likelihood.mean(axis=0).reshape(d**s, d)  # rows: contexts in lexicographic order; columns: x_{s+1}
        probability = joint.sum(axis=1)
        keep = probability > 0
        contexts = sequences[:: d, :s][keep]
        return SequenceLaw(contexts, probability[keep] / probability[keep].sum(), joint[keep] / probability[keep, None])

    @property
    def bayes_loss(self) -> float:
        return self.law.bayes_loss

    @property
    def pi(self) -> np.ndarray:
        """The law of the query token (uniform), the weights of per-query observables."""
        return self.law.query_law

    def sample(self, n_sequences: int, seed: int) -> np.ndarray:
        """``n_sequences`` sequences of length s + 1 (contexts and their next token), seeded."""
        rng = np.random.default_rng(seed)
        perms = self.permutations()[rng.integers(0, math.factorial(self.d), n_sequences)]
        x = np.empty((n_sequences, self.s + 1), dtype=np.int64)
        x[:, 0] = rng.integers(0, self.d, n_sequences)
        rows = np.arange(n_sequences)
        for t in range(self.s):
            uniform = rng.integers(0, self.d, n_sequences)
            follow = rng.random(n_sequences) >= self.noise
            x[:, t + 1] = np.where(follow, perms[rows, x[:, t]], uniform)
        return x

    def describe(self) -> str:
        return f"induction task d={self.d}, s={self.s}, noise={self.noise:g} (Bayes loss {self.bayes_loss:.6g})"

    def cache_key(self) -> bytes:
        return repr((self.d, self.s, float(self.noise))).encode()
