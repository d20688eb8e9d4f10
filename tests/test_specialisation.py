"""flowsim.specialisation: the premature-specialisation probes on a run whose answers are known."""

import numpy as np
import pytest

from flowsim.observables import Observables
from flowsim.specialisation import summarise


def test_specialisation_probes_on_a_synthetic_run():
    t = np.linspace(0.0, 200.0, 2001)
    entropy = 1.0 - 0.5 * np.minimum(1.0, t / 100.0)
    columns = {
        "loss": 1.0 - t / 400.0,
        "attention_entropy_2": np.column_stack([entropy, entropy]),
        "basis_angle": np.maximum(0.0, 1.0 - t / 50.0) + np.where((t > 60) & (t < 61), 0.5, 0.0),  # one late wobble
    }
    summary = summarise(Observables(t=t, columns=columns, constants={"pi": np.array([0.5, 0.5])}), loss_target=0.9)
    assert summary.t_basis_mature == pytest.approx(61.0, abs=0.1)  # matured for good only after the wobble
    assert summary.upper_entropy_fall_at_maturity == pytest.approx(0.5 * 61.0 / 100.0, abs=1e-3)
    assert summary.premature_index == pytest.approx(0.61, abs=1e-3)
    assert summary.t_loss_target == pytest.approx(40.0, abs=0.1) and summary.final_loss == pytest.approx(0.5)
    one_layer = Observables(t=t, columns={"loss": columns["loss"]}, constants={"pi": np.array([0.5, 0.5])})
    with pytest.raises(ValueError, match="two-layer"):
        summarise(one_layer)
