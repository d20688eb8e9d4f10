"""flowsim.solve.trajectory: saved times and parameters, checked on construction, round-tripped exactly."""

import numpy as np
import pytest

from flowsim.solve.trajectory import Trajectory


def _trajectory(n=4):
    rng = np.random.default_rng(0)
    return Trajectory(t=np.linspace(0, 3, n), loss=rng.random(n), params={"W0": rng.random((n, 2, 3)), "W1": rng.random((n, 3, 2))})


def test_save_load_round_trip_is_exact(tmp_path):
    trajectory = _trajectory()
    trajectory.save(tmp_path / "trajectory.npz")
    loaded = Trajectory.load(tmp_path / "trajectory.npz")
    np.testing.assert_array_equal(loaded.t, trajectory.t)
    np.testing.assert_array_equal(loaded.loss, trajectory.loss)
    assert sorted(loaded.params) == ["W0", "W1"]
    for name in loaded.params:
        np.testing.assert_array_equal(loaded.params[name], trajectory.params[name])
    np.testing.assert_array_equal(loaded.at(2)["W1"], trajectory.params["W1"][2])
    assert len(loaded) == 4


def test_inconsistent_arrays_are_refused(tmp_path):
    good = _trajectory()
    with pytest.raises(ValueError, match="leading"):
        Trajectory(t=good.t, loss=good.loss[:-1], params=good.params)
    with pytest.raises(ValueError, match="leading"):
        Trajectory(t=good.t, loss=good.loss, params={"W0": good.params["W0"][:2]})
    with pytest.raises(ValueError, match="ascending"):
        Trajectory(t=good.t[::-1], loss=good.loss, params=good.params)
    np.savez(tmp_path / "not_a_trajectory.npz", W0=good.params["W0"])
    with pytest.raises(ValueError, match="missing arrays"):
        Trajectory.load(tmp_path / "not_a_trajectory.npz")
