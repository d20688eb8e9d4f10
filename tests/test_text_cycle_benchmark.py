"""benchmarks/text_cycle.py: the table of the cycle, its flow-regime reference and its errors, on hand-made rows."""

import pytest

import text_cycle  # benchmarks/ is on the path (conftest)


def row(stage, query, sgd, ode=None, theory=None, vocabulary=None, direction=None, formula=None):
    return {"stage": stage, "query": query, "direction": direction, "occurrence": 1, "token": "-", "sgd": sgd,
            "ode": ode, "theory": theory, "ode_full_vocabulary": vocabulary, "formula": formula}


def test_an_event_halving_lr_moves_by_5_percent_or_more_is_compared_at_lr_half():
    full = {"rows": [row("focus", 1, 100.0, ode=103.0, theory=99.0, vocabulary=100.0, formula=98.0),
                     row("dilution", 1, 1000.0, ode=1500.0)]}
    half = {"rows": [row("focus", 1, 102.0), row("dilution", 1, 1200.0), row("restart", None, 2000.0, direction=2)]}
    rows = {(r["stage"], r["query"]): r for r in text_cycle.cycle_rows(full, half)}
    focus, dilution, restart = rows[("focus", 1)], rows[("dilution", 1)], rows[("restart", None)]
    assert focus["shift"] == pytest.approx(2 / 102) and focus["flow_regime_sgd"] == 100.0  # in the flow regime: lr
    assert focus["ode_vs_flow_regime_sgd"] == pytest.approx(0.03) and focus["theory_vs_ode"] == pytest.approx(0.01)
    assert dilution["shift"] == pytest.approx(200 / 1200) and dilution["flow_regime_sgd"] == 1200.0  # lr/2 instead
    assert dilution["ode_vs_flow_regime_sgd"] == pytest.approx(0.25)
    assert restart["sgd"] is None and restart["sgd_half"] == 2000.0 and restart["shift"] is None  # lr/2 alone
    text = text_cycle.table(list(rows.values()), {"corpus": "c", "d": 5, "lr": 0.5, "t_end": 10, "surrogate": "s"})
    assert "| focus q1 #1 | - | 98 | 99 | 100 | 103 | 100 | 102 | 2.0% | 3.0% | 1.0% |" in text
    assert "| dilution q1 #1 | - | – | – | – | 1500 | 1000 | 1200 | 16.7% | 25.0% | – |" in text


def test_with_lr_quarter_the_flow_regime_is_the_first_halving_that_moves_an_event_less_than_5_percent():
    full = {"rows": [row("restart", None, 1583.0, direction=1), row("focus", 4, 1619.0, ode=None),
                     row("condensation", None, 45.7, ode=42.8)]}
    half = {"rows": [row("restart", None, 1214.0, direction=1), row("focus", 4, 2230.0), row("condensation", None, 44.0)]}
    quarter = {"rows": [row("restart", None, 1180.0, direction=1), row("condensation", None, 43.9)]}
    rows = {(r["stage"], r["query"]): r for r in text_cycle.cycle_rows(full, half, quarter)}
    restart, focus, condensation = rows[("restart", None)], rows[("focus", 4)], rows[("condensation", None)]
    assert restart["flow_regime_sgd"] == 1214.0 and restart["regime_reached"]  # lr/2 -> lr/4 moved it 2.9%
    assert restart["shift_half"] == pytest.approx(34 / 1180)
    assert condensation["flow_regime_sgd"] == 45.7 and condensation["regime_reached"]  # lr -> lr/2 moved it 3.9%: lr's
    assert condensation["ode_vs_flow_regime_sgd"] == pytest.approx(2.9 / 45.7)
    assert focus["flow_regime_sgd"] is None and not focus["regime_reached"]  # lr/4 lacks it: no reference
    text = text_cycle.table(list(rows.values()), {"corpus": "c", "d": 5, "lr": 0.125, "t_end": 3000, "surrogate": "s"})
    assert "SGD lr = 0.125, 0.0625 and 0.03125 to t = 3000" in text
    assert "| restart σ1 #1 | - | – | – | – | – | 1583 | 1214 | 30.4% | 1180 | 2.9% | – | – |" in text


def test_the_seeds_table_gives_each_sides_mean_and_sd_and_their_distance_in_sgds_sds():
    payloads = {seed: {"rows": [row("restart", None, sgd, ode=ode, direction=1)]}
                for seed, (sgd, ode) in enumerate([(1000.0, 1500.0), (1200.0, 1550.0), (1400.0, 1600.0)])}
    payloads[3] = {"rows": []}  # a seed without the event
    text = text_cycle.seeds_table(payloads)
    # SGD 1200 ± 200, the ODE 1550 ± 50: 1.75 SDs apart
    assert "| restart σ1 #1 | - | 1200 ± 2e+02 (3/4) | 1550 ± 50 (3/4) | 1.8 |" in text


def test_the_seeds_table_puts_the_flow_at_s_beside_the_mean_field_flow_where_it_was_read():
    """Seeds whose rows carry the flow at s (``ode_finite_s``) get its mean ± SD and its distance in SGD's SDs."""
    payloads = {seed: {"rows": [{**row("restart", None, sgd, ode=ode, direction=1), "ode_finite_s": at_s}]}
                for seed, (sgd, ode, at_s) in enumerate([(1000.0, 1500.0, 1100.0), (1200.0, 1550.0, 1100.0),
                                                         (1400.0, 1600.0, 1400.0)])}
    text = text_cycle.seeds_table(payloads)
    assert "ODE at s mean ± SD (seeds) | ODE at s vs SGD, in SGD's SDs |" in text
    # the flow at s: 1200 ± 173, 0 SDs from SGD's 1200
    assert text.splitlines()[-1] == "| restart σ1 #1 | - | 1200 ± 2e+02 (3/3) | 1550 ± 50 (3/3) | 1.8 | 1200 ± 1.7e+02 (3/3) | 0.0 |"


def test_the_held_out_verdict_scores_each_flows_mean_against_sgds_and_a_missing_event_as_a_full_miss():
    """Over events SGD shows at every held-out seed: the mean-field flow is 10% and 50% off, the flow at s 0% and
    lacks the second at one seed (100%): medians 30% and 50%, so the mean-field flow wins; condensation and the probe
    set's "other" are not scored."""
    def seed_rows(sgd_restart, at_s_focus):
        return {"rows": [{**row("restart", None, sgd_restart, ode=1.1 * sgd_restart, direction=1), "ode_finite_s": sgd_restart},
                         {**row("focus", 1, 100.0, ode=150.0), "ode_finite_s": at_s_focus},
                         {**row("condensation", None, 10.0, ode=50.0), "ode_finite_s": 50.0},
                         {**row("focus", 2, 100.0, ode=900.0), "token": "other", "ode_finite_s": 900.0}]}

    text = text_cycle.held_out_verdict({1: seed_rows(1000.0, 100.0), 2: seed_rows(1200.0, None)}, [1, 2])
    assert "| restart σ1 #1 | - | 1100 | 10.0% | 0.0% |" in text
    assert "| focus q1 #1 | - | 100 | 50.0% | 100.0% |" in text
    assert "condensation" not in text and "other" not in text.split("\n\n")[1]
    assert text.endswith("mean-field flow 30.0%, flow at s 50.0%: the mean-field flow is the better predictor on the "
                         "held-out seeds.")


def test_the_first_cycle_is_a_focus_then_a_later_dilution_then_a_later_restart():
    import cycle_horizon

    intervals = [{"stage": "restart", "t_start": 50.0}, {"stage": "focus", "t_start": 100.0},
                 {"stage": "restart", "t_start": 150.0}, {"stage": "dilution", "t_start": 300.0},
                 {"stage": "focus", "t_start": 350.0}, {"stage": "restart", "t_start": 4000.0}]
    assert cycle_horizon.first_cycle(intervals) == (100.0, 300.0, 4000.0)  # the restarts before the dilution do not count
    assert cycle_horizon.first_cycle(intervals[:4]) is None
    assert cycle_horizon.proposed_horizon((100.0, 300.0, 4000.0), lr=0.025) == 5200.0  # 1.3 x 4000, a multiple of 2.5


def test_the_flow_at_s_gets_its_own_columns_where_validate_read_it():
    """A full run whose rows carry the flow at the run's s (``ode_finite_s``) adds its time and its error against the
    flow-regime SGD time; without it the table keeps its columns."""
    finite_row = {**row("focus", 1, 100.0, ode=400.0), "ode_finite_s": 98.0}
    full, half = {"rows": [finite_row]}, {"rows": [row("focus", 1, 102.0)]}
    rows = text_cycle.cycle_rows(full, half)
    text = text_cycle.table(rows, {"corpus": "c", "d": 5, "lr": 0.5, "t_end": 10, "surrogate": "s"})
    assert "| ODE at s (probe set) | ODE at s vs flow-regime SGD |" in text
    assert text.splitlines()[-1].endswith("| 98 | 2.0% |")  # against lr's 100, in the flow regime
    plain = text_cycle.table(text_cycle.cycle_rows({"rows": [row("focus", 1, 100.0)]}, half),
                             {"corpus": "c", "d": 5, "lr": 0.5, "t_end": 10, "surrogate": "s"})
    assert "ODE at s" not in plain
