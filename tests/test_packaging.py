"""A plain (non-editable) install works from any directory: the wheel carries the shipped
configs as package data, and the commands that read them find them."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The project's wheel, built and unpacked into a folder of its own (its dependencies are
    the test environment's), and a working directory far from the repository."""
    root = tmp_path_factory.mktemp("install")
    wheels, target = root / "wheels", root / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(wheels), str(REPOSITORY)],
                           capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"the wheel could not be built here (no build backend reachable?): {build.stderr.strip()[-300:]}")
    wheel = next(wheels.glob("flowsim-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target), str(wheel)],
                   check=True)
    workdir = root / "elsewhere"
    workdir.mkdir()
    return names, target, workdir


def run_installed(installed, *args):
    _, target, workdir = installed
    env = {**os.environ, "PYTHONPATH": str(target)}  # the session's compilation cache: the installed code is the same
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=workdir, env=env)


@pytest.mark.slow
def test_wheel_ships_every_config(installed):
    names, _, _ = installed
    shipped = sorted(str(path.relative_to(REPOSITORY)) for path in (REPOSITORY / "flowsim" / "configs").rglob("*.toml"))
    assert shipped and all(name in names for name in shipped), set(shipped) - set(names)


@pytest.mark.slow
def test_installed_package_runs_shipped_configs_from_any_directory(installed):
    _, target, _ = installed
    where = run_installed(installed, "-c", "import flowsim; print(flowsim.__file__)")
    assert where.stdout.strip().startswith(str(target)), where  # the installed copy, not the repository
    run = run_installed(installed, "-m", "flowsim.cli", "run", "configs/two_layer/glu.toml", "--quiet", "--out", "glu",
                        "--set", "time.t_end=2.0", "--set", "time.n_linear=5", "--set", "time.n_log=0")
    assert run.returncode == 0, run.stderr
    assert 'ffn = "glu"' in (installed[2] / "glu" / "config.toml").read_text()
    figure = run_installed(installed, "-m", "flowsim.cli", "figures", "--only", "fig10_premature_specialisation",
                           "--out", "figs", "--cache", "cache", "--tiny")
    assert figure.returncode == 0, figure.stderr
    assert (installed[2] / "figs" / "fig10_premature_specialisation.png").is_file()
    pytest.importorskip("torch")
    bridge = run_installed(installed, "-m", "flowsim.cli", "bridge", "train", "configs/bridge/markov-default.toml", "--quiet",
                           "--out", "bridge", "--set", "optim.steps=8", "--set", "log.n_checkpoints=4",
                           "--set", "data.batch_size=16", "--set", "log.probe_per_type=4")
    assert bridge.returncode == 0, bridge.stderr


@pytest.mark.slow
def test_the_suite_collects_without_torch():
    """torch is an optional extra: with it absent every test module imports, and the bridge's are skipped
    with the reason (``tests/without_torch.py`` runs any part of the suite that way)."""
    run = subprocess.run([sys.executable, "tests/without_torch.py", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
                         cwd=REPOSITORY, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "error" not in run.stdout.lower().split("short test summary")[-1]
    assert "SKIPPED [1] tests/test_bridge.py" in run.stdout and "No module named 'torch'" in run.stdout
