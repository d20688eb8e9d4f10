"""benchmarks/scaling.py's handling of what goes wrong: a backend the machine lacks, a run that fails."""

import subprocess
import sys
from pathlib import Path

import jax
import pytest

import scaling  # benchmarks/ is on the path (conftest)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scaling.py"


def test_a_failed_runs_row_names_its_exception_not_jaxs_note_on_filtered_frames():
    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
              "RuntimeError: Unknown backend cuda\n--------------------\n"
              "For simplicity, JAX has removed its internal frames from the traceback of the following exception. "
              "Set JAX_TRACEBACK_FILTERING=off to include these.\n")
    assert scaling.exception_line(stderr) == "RuntimeError: Unknown backend cuda"
    assert scaling.exception_line("ValueError: bad\n") == "ValueError: bad"
    assert scaling.exception_line("") == "(no message)"


def has_cuda() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@pytest.mark.skipif(has_cuda(), reason="this machine has a CUDA backend: --gpu would start the device check")
def test_the_gpu_mode_on_a_machine_without_cuda_stops_at_once_naming_the_backend(tmp_path):
    completed = subprocess.run([sys.executable, str(SCRIPT), "--gpu", "--out", str(tmp_path / "r.md")],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    last = completed.stderr.strip().splitlines()[-1]
    assert "--platform cuda (--gpu)" in last and "cuda" in last.split(":", 2)[-1], completed.stderr
    assert not (tmp_path / "r.md").exists()
