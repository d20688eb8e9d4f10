"""The text's Markov surrogate: the bigram chain of a corpus's training split over its whole vocabulary.

It is the chain whose flow (mean-field, or at the run's s: ``compare.surrogate_loss``) ``flowsim bridge
compare`` puts beside a text run, and, with ``data.train_on = "surrogate"``, the chain a run's training
batches are drawn from instead of the text (so that SGD on the surrogate can be set beside SGD on the text).
"""

from __future__ import annotations

import numpy as np

from flowsim.bridge.config import CompareConfig
from flowsim.bridge.data import Corpus
from flowsim.model.chains import MarkovChain, bigram_counts, cross_entropy_rate, fit_unigram_weight


def text_surrogate(corpus: Corpus, settings: CompareConfig) -> tuple[MarkovChain, dict]:
    """The bigram chain of a corpus's training split over its whole vocabulary (d = vocab_size + 1,
    <unk> included, nothing folded), and a description of the estimator.

    ``compare.surrogate = "interpolated"`` (the default): the training split read as a cycle and
    P[i, j] = (1 - w) c_ij / n_i + w π_j, with π the training token frequencies, which is then
    exactly the chain's stationary law; w = ``compare.unigram_weight``, by default the weight of
    least bigram cross-entropy on the validation split. The criterion is fixed in advance and looks
    only at the corpus: the chain must keep the corpus's π (the condensation rate and every attention
    prior log π are read from it), and among such chains it must predict held-out text best.
    ``"additive"``: P[i, j] = (c_ij + α) / Σ_j' (c_ij' + α), α = ``compare.smoothing``.
    O(d²) to build (O(d³) for π under additive smoothing)."""
    d = len(corpus.vocabulary)
    if settings.surrogate == "additive":
        chain = MarkovChain.from_counts(bigram_counts(corpus.train, d), settings.smoothing)
        estimator = f"additive smoothing {settings.smoothing:g}"
        parameters = {"smoothing": settings.smoothing}
    else:
        counts = bigram_counts(corpus.train, d, cyclic=True)
        weight = settings.unigram_weight
        chosen = "set" if weight is not None else "chosen by validation cross-entropy"
        weight = fit_unigram_weight(counts, corpus.valid) if weight is None else weight
        chain = MarkovChain.from_counts_interpolated(counts, weight)
        estimator = f"interpolated with the unigram law, weight {weight:.4g} ({chosen})"
        parameters = {"unigram_weight": weight}
    frequencies = np.bincount(corpus.train, minlength=d) / len(corpus.train)
    return chain, {"surrogate": settings.surrogate, "estimator": estimator, **parameters, "surrogate_d": chain.d,
                   "validation_cross_entropy": cross_entropy_rate(chain.P, corpus.valid),
                   "pi_total_variation": float(0.5 * np.abs(chain.pi - frequencies).sum())}
