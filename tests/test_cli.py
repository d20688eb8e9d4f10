"""The command line: exit codes, one-line errors, what each command writes."""

import json
import subprocess
import sys

from flowsim.config import load_config
from flowsim.experiment import execute_run

SMALL = ["time.t_end=30.0", "time.n_linear=31", "time.n_log=10", "model.m=4", "model.k=4"]


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
