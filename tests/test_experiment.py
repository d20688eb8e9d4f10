"""flowsim.runs.experiment: one run end to end, into a run directory that reads back exactly."""

import numpy as np

from flowsim.config import load_config
from flowsim.runs.experiment import execute_run, pinned_config
from flowsim.model.models import model_from_config
from flowsim.observe.observables import Observables
from flowsim.runs.rundir import load_run
from flowsim.solve.status import Status

SMALL = ["time.t_end=30.0", "time.n_linear=31", "time.n_log=10", "model.m=4", "model.k=4"]


def test_run_directory_round_trip(tmp_path):
    config = load_config(None, SMALL + ["init.seed=5"])
    result = execute_run(config, tmp_path / "run", progress=False)
    assert result.success
    run = load_run(tmp_path / "run")
    saved = run.trajectory
    np.testing.assert_array_equal(saved.t, result.trajectory.t)
    assert saved.t[0] == 0.0 and np.all(np.diff(saved.t) > 0)
    for name in ("W0", "W_Q", "W_K", "W1"):
        np.testing.assert_array_equal(saved.params[name], result.trajectory.params[name])
        assert saved.params[name].shape[0] == len(saved.t)
    np.testing.assert_array_equal(saved.loss, result.trajectory.loss)
    # the initial point is the seeded initialisation
    np.testing.assert_array_equal(saved.params["W0"][0], np.asarray(model_from_config(config.model, 4).init(1e-3, 5)["W0"]))
    # config.toml is the full resolved config, pinned: reloading it reproduces the config with "auto" written out
    assert load_config(tmp_path / "run" / "config.toml") == pinned_config(config) != config
    assert pinned_config(config).solver.method == "JaxBDF" and config.solver.method == "auto"
    assert run.meta["seed"] == 5 and run.meta["status_name"] == "finished"
    assert {"python", "jax", "diffrax", "scipy", "numpy"} <= set(run.meta["versions"])
    assert run.meta["nfev"] > 0 and run.meta["wall_time_s"] > 0
    assert (tmp_path / "run" / "summary.png").stat().st_size > 10_000
    observables = Observables.load(tmp_path / "run")
    np.testing.assert_array_equal(observables.t, saved.t)
    np.testing.assert_array_equal(observables["loss"], saved.loss)
    assert (tmp_path / "run" / "observables.csv").is_file()
    assert not list((tmp_path / "run").glob(".*tmp*"))  # no temporary files left behind


def test_a_run_stopped_by_its_step_limit_keeps_what_it_computed(tmp_path):
    config = load_config(None, SMALL + ["solver.max_steps=40"])
    result = execute_run(config, tmp_path / "run", progress=False)
    assert result.status == Status.STEP_LIMIT
    run = load_run(tmp_path / "run")
    assert run.meta["status_name"] == "step_limit" and "step limit" in run.meta["message"]
    n = len(run.trajectory.t)
    assert 1 < n < len(config.save_times())
    np.testing.assert_array_equal(run.trajectory.t, config.save_times()[:n])
