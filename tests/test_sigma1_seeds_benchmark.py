"""benchmarks/sigma1_seeds.py: the seeds' summary, and both routes run per seed at a tiny size."""

import numpy as np
import pytest

import sigma1_seeds  # benchmarks/ is on the path (conftest)


def corpora_present() -> bool:
    try:
        from flowsim.bridge.data import default_data_dir  # the bridge extra (torch)
    except ImportError:
        return False
    return default_data_dir() is not None


def test_a_summary_gives_the_mean_and_sample_sd_and_no_mean_when_a_seed_never_reached_it():
    values = [700.0, 760.0, 910.0]
    shown, mean = sigma1_seeds.summary(values)
    assert mean == pytest.approx(790.0)
    assert shown == f"790 ± {np.std(values, ddof=1):.0f} (700-910)"
    assert sigma1_seeds.summary([1.25, 1.5])[0] == "1.375 ± 0.18 (1.25-1.5)"
    shown, mean = sigma1_seeds.summary([700.0, None, 910.0])
    assert mean is None and shown == "2 of 3 reached (700-910)"
    assert sigma1_seeds.summary([None, None]) == ("–", None)


def test_the_table_gives_each_seed_each_routes_summary_and_the_means_relative_difference():
    text, chain = sigma1_seeds.ROUTES
    events = {(text, 0): {"σ1 > 2 ×": 100.0, "σ1 > 5 ×": 400.0}, (text, 1): {"σ1 > 2 ×": 200.0, "σ1 > 5 ×": 500.0},
              (chain, 0): {"σ1 > 2 ×": 150.0, "σ1 > 5 ×": None}, (chain, 1): {"σ1 > 2 ×": 300.0, "σ1 > 5 ×": 700.0}}
    lines = sigma1_seeds.table("wikitext2", [0, 1], events, 1500.0).splitlines()
    assert f"| {chain} | 1 | 300 | 700 |" in lines
    assert lines[-1] == f"| {chain} vs {text} | means | +50.0% | – |"  # 225 against 150; a censored mean gives none
    assert f"| {chain} | mean ± SD (range) | 225 ± 106 (150-300) | 1 of 2 reached (700-700) |" in lines


@pytest.mark.slow
@pytest.mark.skipif(not corpora_present(), reason="needs the bridge extra and the shared corpora")
def test_each_seed_trains_on_the_text_and_on_its_chain_and_the_table_compares_their_means(tmp_path):
    """Two seeds at d = 16 to t = 40: the text and its bigram chain, two independent routes, condense within 10%
    of each other at each seed, and the seeds are different runs."""
    overrides = ("data.vocab_size=15", "log.track=[]")
    seeds = [0, 1]
    events = {(route, seed): sigma1_seeds.run_events("wikitext2", seed, route, 40.0, 30, tmp_path, overrides)
              for seed in seeds for route in sigma1_seeds.ROUTES}
    for seed in seeds:
        text, chain = (events[route, seed]["condensation"] for route in sigma1_seeds.ROUTES)
        assert text is not None and chain is not None and abs(chain - text) / text < 0.10, events
    assert events["text", 0]["σ1 at t_end"] != events["text", 1]["σ1 at t_end"]
    assert set(events["text", 0]) == {"condensation", "σ1 > 2 ×", "σ1 > 3 ×", "σ1 > 5 ×", "σ1 at t_end"}
