"""benchmarks/sgd_noise.py: variants, and how far each moved an event, on hand-made rows."""

import argparse

import pytest

import sgd_noise  # benchmarks/ is on the path (conftest)


def row(stage, query, sgd, ode=None, direction=None):
    return {"stage": stage, "query": query, "direction": direction, "occurrence": 1, "token": "-", "sgd": sgd, "ode": ode}


def test_variants_parse_and_name_themselves():
    assert sgd_noise.parse_variant("lr/8") == (8, 1)
    assert sgd_noise.parse_variant("2B") == (1, 2)
    assert sgd_noise.parse_variant("lr/2,4B") == (2, 4)
    assert sgd_noise.variant_name(2, 4) == "lr/2,4B" and sgd_noise.variant_name(1, 2) == "lr,2B"
    for bad in ("lr/0", "lr/x", "B2", "lr/2;2B", "0B"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant|at least 1"):
            sgd_noise.parse_variant(bad)


def test_each_variant_moves_an_event_from_the_baseline_run():
    runs = {(1, 1): {"corpus": "c", "d": 5, "lr": 0.125, "t_end": 3000, "batch_size": 256,
                     "rows": [row("restart", None, 1600.0, ode=None, direction=1), row("focus", 2, 100.0, ode=101.0)]},
            (2, 1): {"rows": [row("restart", None, 1200.0, direction=1), row("focus", 2, 100.0)]},
            (1, 2): {"rows": [row("restart", None, 1360.0, direction=1), row("dilution", 2, 900.0)]}}
    rows = {(r["event"][0], r["event"][1]): r for r in sgd_noise.noise_rows(runs)}
    restart = rows[("restart", None)]
    assert restart["moved"][(2, 1)] == pytest.approx(400 / 1600) and restart["moved"][(1, 2)] == pytest.approx(240 / 1600)
    assert rows[("focus", 2)]["moved"][(1, 2)] is None and rows[("focus", 2)]["ode"] == 101.0
    assert rows[("dilution", 2)]["times"][(1, 1)] is None and rows[("dilution", 2)]["moved"][(1, 2)] is None
    text = sgd_noise.noise_table(list(rows.values()), runs)
    assert "| restart σ1 #1 | - | – | 1600 | 1200 | 1360 | 25.0% | 15.0% |" in text
    assert "lr = 0.125, B = 256" in text
