import json
import subprocess
import sys

import numpy as np
import pytest

from flowsim.chains import MarkovChain
from flowsim.config import ConfigError, load_config
from flowsim.experiment import execute_run
from flowsim.models import model_from_config
from flowsim.observables import Observables
from flowsim.rundir import load_run
from flowsim.status import Status

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
    # config.toml is the full resolved config: reloading it reproduces the config
    assert load_config(tmp_path / "run" / "config.toml") == config
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


def test_overrides_and_general_P(tmp_path):
    config = load_config(None, ["chain.P=[[0.5,0.5],[0.2,0.8]]", "solver.method=BDF", "flow.rates.W1=2"])
    assert config.chain.lam is None and config.chain.pi is None
    assert config.solver.method == "BDF" and config.flow.rates == {"W1": 2}
    np.testing.assert_allclose(MarkovChain.from_config(config.chain).pi, [2 / 7, 5 / 7])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["solver.method=Euler"], "solver.method = 'Euler' is invalid"),
        (["solver.metod=BDF"], "unknown config key solver.metod"),
        (["chain.pi=[0.5,0.6]"], "chain: pi sums to 1.1"),
        (["init.eps='small'"], "init.eps = 'small' has type str"),
        (["time.t_end=-1.0"], "time.t_end = -1.0 is invalid"),
        (["loss.kind='exact'"], "loss.kind = 'exact' is invalid"),
        (["solver"], "--set expects key=value"),
    ],
)
def test_bad_config_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        config = load_config(None, overrides)
        MarkovChain.from_config(config.chain)
    assert message in str(error.value)


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "flowsim.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_run_writes_a_run_directory(tmp_path):
    sets = [item for pair in zip(["--set"] * len(SMALL), SMALL) for item in pair]
    completed = run_cli("run", *sets, "--out", str(tmp_path / "out"), "--quiet", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert "finished" in completed.stdout
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["status_name"] == "finished"


def test_cli_bad_config_prints_one_line_and_exits_non_zero(tmp_path):
    completed = run_cli("run", "--set", "chain.P=[[0,1],[1,0]]", cwd=tmp_path)
    assert completed.returncode == 2
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and "periodic" in lines[0] and "Traceback" not in completed.stderr
    assert not (tmp_path / "runs").exists()
    missing = run_cli("run", "nowhere.toml", cwd=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_cli_stages_labels_a_run_without_observables(tmp_path):
    config = load_config(None, ["time.t_end=300.0", "time.n_log=100"])
    execute_run(config, tmp_path / "run", progress=False)
    (tmp_path / "run" / "observables.npz").unlink()
    (tmp_path / "run" / "stages.json").unlink()
    completed = run_cli("stages", str(tmp_path / "run"), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert "condensation" in completed.stdout and "focus" in completed.stdout
    data = json.loads((tmp_path / "run" / "stages.json").read_text())
    assert data["intervals"][0]["stage"] == "condensation"
    assert (tmp_path / "run" / "observables.npz").is_file()
    missing = run_cli("stages", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert missing.returncode == 2 and "not a complete run directory" in missing.stderr
