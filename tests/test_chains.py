import numpy as np
import pytest

from flowsim import MarkovChain


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
    """DESIGN.md's δ = 0.2 chain: π = (0.7, 0.2, 0.1, 0.0); token 3 is transient."""
    chain = MarkovChain(pi=[0.7, 0.2, 0.1, 0.0], lam=0.5)
    np.testing.assert_allclose(chain.pi @ chain.P, chain.pi, atol=1e-15)
    from_P = MarkovChain(P=chain.P)
    np.testing.assert_allclose(from_P.pi, [0.7, 0.2, 0.1, 0.0], atol=1e-12)
    assert np.all(chain.sample(500, 20, seed=0) != 3)
