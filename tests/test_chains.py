import numpy as np
import pytest

from flowsim import MarkovChain
from flowsim.model.chains import bigram_counts, cross_entropy_rate, fit_unigram_weight, inverse_cdf_rows, stationary_distribution


def test_paper_family_matrix_and_stationarity():
    pi = np.array([0.6, 0.3, 0.1])
    chain = MarkovChain(pi=pi, lam=0.25)
    expected = 0.25 * np.eye(3) + 0.75 * np.outer(np.ones(3), pi)
    np.testing.assert_allclose(chain.P, expected, atol=1e-15)
    np.testing.assert_allclose(pi @ chain.P, pi, atol=1e-15)


def test_stationary_distribution_computed_from_P():
    P = np.array([[0.1, 0.6, 0.3], [0.4, 0.2, 0.4], [0.5, 0.25, 0.25]])
    chain = MarkovChain(P=P)
    # Independent route: the long-run average of P^n's rows.
    limit = np.linalg.matrix_power(P, 200)[0]
    np.testing.assert_allclose(chain.pi, limit, atol=1e-12)
    assert chain.lam is None


def test_sampling_frequencies_and_transitions_match_the_chain():
    chain = MarkovChain(P=[[0.1, 0.6, 0.3], [0.4, 0.2, 0.4], [0.5, 0.25, 0.25]])
    paths = chain.sample(4000, 30, seed=3)
    assert paths.shape == (4000, 30)
    frequency = np.bincount(paths.ravel(), minlength=3) / paths.size
    np.testing.assert_allclose(frequency, chain.pi, atol=0.01)
    pairs = np.zeros((3, 3))
    np.add.at(pairs, (paths[:, :-1].ravel(), paths[:, 1:].ravel()), 1)
    np.testing.assert_allclose(pairs / pairs.sum(1, keepdims=True), chain.P, atol=0.01)
    np.testing.assert_array_equal(paths, chain.sample(4000, 30, seed=3))  # seeded


def test_the_binary_search_draws_exactly_the_token_that_comparing_the_whole_row_draws():
    """inverse_cdf_rows against the count of entries <= u of the whole row, on rows with zeros (flat runs), a row
    whose round-off overshoots 1 before its last entry, and u on the row's own breakpoints."""
    rng = np.random.default_rng(0)
    for d in (2, 3, 7, 64, 201, 256, 257, 1001):
        P = rng.dirichlet(np.full(d, 0.3), size=d)
        P[:, rng.random(d) < 0.3] = 0.0  # flat runs in the cumulative sums
        P[:, 0] += 1e-3
        P /= P.sum(axis=1, keepdims=True)
        cumulative = np.cumsum(P, axis=1)
        cumulative[0, -3:-1] = 1.0 + 2e-16  # round-off above 1 before the last entry
        cumulative[:, -1] = 1.0
        rows = rng.integers(0, d, 4000)
        u = rng.random(4000)
        u[:1000] = np.minimum(cumulative[rows[:1000], rng.integers(0, d, 1000)], np.nextafter(1.0, 0.0))  # ties
        np.testing.assert_array_equal(inverse_cdf_rows(cumulative, rows, u), (u[:, None] >= cumulative[rows]).sum(axis=1))


def test_uniform_start():
    chain = MarkovChain(pi=[0.9, 0.1], lam=0.5, start="uniform")
    first = chain.sample(20000, 1, seed=0)[:, 0]
    assert abs(first.mean() - 0.5) < 0.02


BAD_CHAINS = [
    (dict(P=[[1.2, -0.2], [0.5, 0.5]]), "negative entry -0.2"),
    (dict(pi=[0.5, 0.7, -0.2], lam=0.5), "pi has a negative entry"),
    (dict(P=[[0.5, 0.4], [0.5, 0.5]]), "row 0 sums to 0.9"),
    (dict(pi=[0.5, 0.6], lam=0.3), "pi sums to 1.1"),
    (dict(P=[[0.9, 0.1], [0.5, 0.5]], pi=[0.5, 0.5]), "not stationary"),
    (dict(P=[[1.0, 0.0], [0.0, 1.0]]), "reducible"),
    (dict(P=[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]), "2 closed classes"),
    (dict(P=[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]), "periodic (period 2)"),
    (dict(pi=[0.5, 0.5], lam=1.0), "lam = 1.0"),
    (dict(P=[[0.0, 1.0], [1.0, 0.0]]), "periodic (period 2)"),
    (dict(P=[[0, 1, 0], [0, 0, 1], [1, 0, 0]]), "periodic (period 3)"),
    (dict(pi=[1.0], lam=0.5), "d >= 2"),
    (dict(P=[[1.0]]), "d >= 2"),
    (dict(pi=[float("nan"), 0.5, 0.5], lam=0.5), "non-finite entry nan"),
    (dict(P=[[float("inf"), 0.0], [0.5, 0.5]]), "non-finite entry inf"),
    (dict(pi=[0.5, 0.5], lam=float("nan")), "non-finite"),
    (dict(P=[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]), "square"),
    (dict(P=[[1.0, 0.0], [0.5]]), "rows of different lengths [2, 1]; expected a square matrix"),
    (dict(P="uniform"), "P must be numeric, got 'uniform'"),
    (dict(pi=[0.5, 0.5]), "either pi and lam"),
    (dict(pi=[0.5, 0.5], lam=0.1, P=[[0.5, 0.5], [0.5, 0.5]]), "not both"),
    (dict(pi=[0.5, 0.5], lam=0.1, start="first"), "start must be"),
]


@pytest.mark.parametrize("kwargs, message", BAD_CHAINS)
def test_bad_chain_input_raises_a_clear_error(kwargs, message):
    with pytest.raises(ValueError) as error:
        MarkovChain(**kwargs)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_transient_token_has_zero_frequency_and_is_accepted():
    """The δ = 0.2 chain of the asymmetric rare tokens (docs/model.md): π = (0.7, 0.2, 0.1, 0.0); token 3 is transient."""
    chain = MarkovChain(pi=[0.7, 0.2, 0.1, 0.0], lam=0.5)
    np.testing.assert_allclose(chain.pi @ chain.P, chain.pi, atol=1e-15)
    from_P = MarkovChain(P=chain.P)
    np.testing.assert_allclose(from_P.pi, [0.7, 0.2, 0.1, 0.0], atol=1e-12)
    assert np.all(chain.sample(500, 20, seed=0) != 3)


def _verdict_by_matrix_powers(P):
    """The reference verdict by brute force (Wielandt): reachability by repeated squaring,
    closed classes, primitivity of the closed block, its period from the return lengths."""
    d = len(P)
    adjacency = (P > 0).astype(np.int64)
    reach = (adjacency + np.eye(d, dtype=np.int64)) > 0
    for _ in range(d):
        reach = reach | ((reach.astype(np.int64) @ reach.astype(np.int64)) > 0)
    recurrent = [i for i in range(d) if np.all(reach[:, i][reach[i]])]
    classes = sorted({tuple(np.flatnonzero(reach[i])) for i in recurrent})
    if len(classes) > 1:
        return ("reducible", len(classes))
    members = list(classes[0])
    block = adjacency[np.ix_(members, members)]
    lengths = [n for n in range(1, 2 * len(members) ** 2 + 2) if np.linalg.matrix_power(block, n)[0, 0] > 0]
    period = int(np.gcd.reduce(lengths))
    return ("ok", members) if period == 1 else ("periodic", period)


def _random_pattern(rng, d):
    kind = rng.integers(4)
    if kind == 0:  # cyclic blocks: periodic with period = number of blocks (when each block reaches the next)
        period = rng.integers(2, min(d, 4) + 1)
        label = rng.permutation(np.arange(d) % period)
        pattern = (label[None, :] == (label[:, None] + 1) % period) & (rng.random((d, d)) < 0.7)
    elif kind == 1:  # two blocks that never meet: reducible
        label = rng.permutation(np.arange(d) % 2)
        pattern = (label[:, None] == label[None, :]) & (rng.random((d, d)) < 0.6)
    else:  # sparse random: transient states, self-loops or none
        pattern = rng.random((d, d)) < rng.uniform(0.15, 0.6)
    pattern[np.arange(d), rng.integers(0, d, d)] |= ~pattern.any(axis=1)  # every row leads somewhere
    P = pattern * rng.random((d, d))
    return P / P.sum(axis=1, keepdims=True)


def test_graph_validation_agrees_with_matrix_powers_on_random_chains():
    rng = np.random.default_rng(2024)
    seen = set()
    for _ in range(300):
        P = _random_pattern(rng, int(rng.integers(2, 8)))
        verdict = _verdict_by_matrix_powers(P)
        seen.add(verdict[0])
        if verdict[0] == "ok":
            chain = MarkovChain(P=P)
            np.testing.assert_allclose(chain.pi @ P, chain.pi, atol=1e-12)
            assert set(np.flatnonzero(chain.pi > 0)) <= set(verdict[1])  # transient states get no mass
        else:
            with pytest.raises(ValueError) as error:
                MarkovChain(P=P)
            expected = f"{verdict[1]} closed classes" if verdict[0] == "reducible" else f"periodic (period {verdict[1]})"
            assert expected in str(error.value), (P, verdict, str(error.value))
    assert seen == {"ok", "reducible", "periodic"}


def test_bigram_chain_of_a_text_against_a_hand_count():
    tokens = "the cat saw the dog and the cat ran".split()
    vocab = ["<unk>", "the", "cat", "dog"]  # saw, and, ran are <unk>
    chain = MarkovChain.from_text(tokens, vocab, smoothing=0.5)
    counts = np.zeros((4, 4))
    # the>cat, cat>unk(saw), unk>the, the>dog, dog>unk(and), unk>the, the>cat, cat>unk(ran)
    for a, b in [(1, 2), (2, 0), (0, 1), (1, 3), (3, 0), (0, 1), (1, 2), (2, 0)]:
        counts[a, b] += 1
    expected = (counts + 0.5) / (counts + 0.5).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(chain.P, expected, rtol=1e-15)
    np.testing.assert_allclose(chain.pi @ chain.P, chain.pi, atol=1e-14)
    with pytest.raises(ValueError, match="token 4 is never followed"):
        MarkovChain.from_text(tokens, vocab + ["bird"])  # a word that never occurs has no row without smoothing
    with pytest.raises(ValueError, match="'saw' is not in the vocabulary"):
        MarkovChain.from_text(tokens, vocab[1:], smoothing=1.0, unknown=None)


def test_a_vocabulary_of_a_thousand_words_builds():
    rng = np.random.default_rng(0)
    zipf = 1.0 / np.arange(1, 1001)
    tokens = rng.choice(1000, size=200_000, p=zipf / zipf.sum())
    chain = MarkovChain.from_text([str(t) for t in tokens], [str(i) for i in range(1000)])
    assert chain.d == 1000
    np.testing.assert_allclose(chain.pi @ chain.P, chain.pi, atol=1e-12)
    # the stationary law of a sequence's bigram chain is its word frequency, up to the ends
    frequency = np.bincount(tokens[:-1], minlength=1000) / (len(tokens) - 1)
    np.testing.assert_allclose(chain.pi, frequency, atol=1e-4)


def test_entropy_rate_is_the_mean_surprise_of_sampled_transitions():
    """Σ π_i H(P_i) against Monte Carlo: -log P(x2 | x1) over pairs drawn from the stationary chain."""
    P = np.random.default_rng(3).dirichlet(np.ones(5), size=5)
    chain = MarkovChain(P=P)
    pairs = chain.sample(200_000, 2, seed=1)
    surprise = -np.log(P[pairs[:, 0], pairs[:, 1]])
    assert abs(surprise.mean() - chain.entropy_rate) < 4 * surprise.std() / np.sqrt(len(surprise))


def test_interpolated_bigram_chain_against_a_hand_count_and_its_exact_stationary_law():
    ids = np.array([1, 2, 0, 1, 3, 0, 1, 2, 0])  # the cat <unk> the dog <unk> the cat <unk>
    cyclic = bigram_counts(ids, 4, cyclic=True)
    hand = np.zeros((4, 4))
    for a, b in zip(ids, np.r_[ids[1:], ids[:1]]):  # read as a cycle: the last token is followed by the first
        hand[a, b] += 1
    np.testing.assert_array_equal(cyclic, hand)
    np.testing.assert_array_equal(bigram_counts(ids, 4), hand - np.eye(4)[ids[-1]][:, None] * np.eye(4)[ids[0]][None, :])
    frequencies = np.bincount(ids, minlength=4) / len(ids)
    for weight in (0.3, 1.0):
        chain = MarkovChain.from_counts_interpolated(cyclic, weight)
        expected = (1 - weight) * hand / hand.sum(axis=1, keepdims=True) + weight * frequencies[None, :]
        np.testing.assert_allclose(chain.P, expected, rtol=1e-15, atol=1e-16)
        np.testing.assert_allclose(chain.pi, frequencies, atol=1e-15)
        np.testing.assert_allclose(stationary_distribution(chain.P), frequencies, atol=1e-12)  # the solve agrees
    with pytest.raises(ValueError, match="periodic"):  # unsmoothed, this text cycles the > cat/dog > <unk> > the
        MarkovChain.from_counts_interpolated(cyclic, 0.0)
    with pytest.raises(ValueError, match=r"unigram_weight must be a number in \[0, 1\], got 1.5"):
        MarkovChain.from_counts_interpolated(cyclic, 1.5)


def test_a_random_corpus_read_as_a_cycle_keeps_its_frequencies_and_the_fitted_weight_is_the_best_on_a_grid():
    rng = np.random.default_rng(7)
    d = 40
    truth = MarkovChain(P=rng.dirichlet(np.full(d, 0.3), size=d))
    train, held_out = truth.sample(1, 20_000, seed=1)[0], truth.sample(1, 5_000, seed=2)[0]
    counts = bigram_counts(train, d, cyclic=True)
    frequencies = np.bincount(train, minlength=d) / len(train)
    weight = fit_unigram_weight(counts, held_out)
    chain = MarkovChain.from_counts_interpolated(counts, weight)
    np.testing.assert_allclose(chain.pi, frequencies, atol=1e-14)
    np.testing.assert_allclose(stationary_distribution(chain.P), frequencies, atol=1e-12)
    surprise = -np.mean([np.log(chain.P[a, b]) for a, b in zip(held_out[:-1], held_out[1:])])  # a plain loop
    assert abs(cross_entropy_rate(chain.P, held_out) - surprise) < 1e-12
    grid = np.linspace(0, 1, 2001)[1:]
    on_grid = [cross_entropy_rate(MarkovChain.from_counts_interpolated(counts, w).P, held_out) for w in grid[::20]]
    best = grid[::20][int(np.argmin(on_grid))]
    assert abs(weight - best) <= 0.01 and cross_entropy_rate(chain.P, held_out) <= min(on_grid) + 1e-9
    unseen = np.array([0, 1, d - 1])
    with pytest.raises(ValueError, match=f"token {d - 1} occurs in the held-out sequence but never in the counts"):
        fit_unigram_weight(bigram_counts(np.array([0, 1, 0, 1]), d, cyclic=True), unseen)
    for held_out, message in (([], "needs at least 2 tokens"), ([0, d], f"must lie in 0 .. {d - 1}"), ([-1, 0], "got -1 .. 0")):
        with pytest.raises(ValueError, match=message):
            fit_unigram_weight(counts, np.array(held_out, dtype=int))
