"""flowsim.observe.specialisation: the premature-specialisation probes on runs whose answers are known."""

import numpy as np
import pytest
from scipy.linalg import subspace_angles
from scipy.optimize import brentq

from flowsim.observe.observables import Observables, doubling_angles
from flowsim.observe.specialisation import summarise


def rotating_plane(phi: float) -> np.ndarray:
    """A 2-plane in R^4 turned by phi in the (e1, e3) plane: its principal angle to the
    plane at phi' is |phi - phi'| (below pi / 2)."""
    return np.array([[np.cos(phi), 0.0], [0.0, 1.0], [np.sin(phi), 0.0], [0.0, 0.0]])


def synthetic_run(t: np.ndarray, phi: np.ndarray, entropy: np.ndarray) -> Observables:
    spans = [rotating_plane(p) for p in phi]
    columns = {"loss": 1.0 - t / (4 * t[-1]), "attention_entropy_2": np.column_stack([entropy, entropy]),
               "basis_angle": np.array([subspace_angles(s, spans[-1]).max() for s in spans]),
               "basis_doubling_angle": doubling_angles(t, spans)}
    return Observables(t=t, columns=columns, constants={"pi": np.array([0.5, 0.5])})


def test_end_relative_maturity_and_index_on_a_synthetic_run():
    t = np.linspace(0.0, 200.0, 2001)
    entropy = 1.0 - 0.5 * np.minimum(1.0, t / 100.0)
    phi = np.maximum(0.0, 1.0 - t / 50.0) + np.where((t > 60) & (t < 61), 0.5, 0.0)  # one late wobble
    summary = summarise(synthetic_run(t, phi, entropy), loss_target=0.9)
    assert summary.t_basis_final == pytest.approx(61.0, abs=0.1)  # matured for good only after the wobble
    assert summary.premature_index_final == pytest.approx(0.61, abs=1e-3)
    assert summary.t_loss_target == pytest.approx(80.0, abs=0.1) and summary.final_loss == pytest.approx(0.75)
    one_layer = Observables(t=t, columns={"loss": t}, constants={"pi": np.array([0.5, 0.5])})
    with pytest.raises(ValueError, match="two-layer"):
        summarise(one_layer)


def test_doubling_maturity_does_not_depend_on_the_horizon():
    """A basis that turns fast, then keeps turning on a logarithmic clock forever: measured
    against its end it matures later the longer the run; per doubling of time it matures
    where phi(2t) - phi(t) falls to 0.1 for good, whatever the horizon."""
    phi_of = lambda t: 1.5 * (1.0 - np.exp(-t / 20.0)) + 0.05 * np.log1p(t)  # noqa: E731
    entropy_of = lambda t: 1.0 - 0.5 * np.minimum(1.0, t / 100.0)  # noqa: E731
    t_cross = brentq(lambda t: phi_of(2 * t) - phi_of(t) - 0.1, 14.0, 200.0)
    summaries = []
    for t_end in (200.0, 800.0):
        t = np.linspace(0.0, t_end, int(t_end * 5) + 1)
        run = synthetic_run(t, phi_of(t), entropy_of(t))
        doubling = run["basis_doubling_angle"]
        defined = ~np.isnan(doubling)
        assert not defined[0] and not defined[-1] and defined[t <= t_end / 2][1:].all()
        partner = t[np.searchsorted(t, 2 * t[defined])]
        np.testing.assert_allclose(doubling[defined], phi_of(partner) - phi_of(t[defined]), atol=1e-10)
        summaries.append(summarise(run))
    short, long = summaries
    assert short.t_basis_mature == pytest.approx(t_cross, abs=0.21) and long.t_basis_mature == pytest.approx(t_cross, abs=0.21)
    assert short.premature_index == pytest.approx(t_cross / 100.0, abs=3e-3)
    # the end-relative criterion moves with the horizon
    assert long.t_basis_final > short.t_basis_final + 40.0
    # the entropy has done 90% of its fall at t = 90; the basis turns by phi(180) - phi(90) over the next doubling
    for summary in summaries:
        assert summary.t_upper_specialised == pytest.approx(90.0, abs=0.21)
        assert summary.basis_turn_at_specialisation == pytest.approx(phi_of(180.0) - phi_of(90.0), abs=1e-3)


def test_no_doubling_maturity_while_the_basis_keeps_turning():
    t = np.linspace(0.0, 100.0, 1001)
    summary = summarise(synthetic_run(t, 0.004 * t, np.ones_like(t)))  # 0.004 t per doubling: above 0.1 past t = 25
    assert summary.t_basis_mature is None and summary.premature_index is None
