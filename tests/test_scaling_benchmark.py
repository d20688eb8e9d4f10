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


def test_the_equal_error_summary_compares_at_every_baseline_error_and_never_credits_an_error_not_reached():
    def row(method, rtol, solve_s, loss_error, status="finished"):
        return {"case": "d64", "method": method, "rtol": rtol, "solve_s": solve_s, "loss_error": loss_error, "status": status}

    rows = [row("CVODE", 1e-6, 2.4, 3.5e-6), row("CVODE", 1e-8, 3.8, 4.6e-7),
            row("JaxBDF", 2e-6, 0.78, 2.9e-6), row("JaxBDF", 1e-6, 0.88, 1.7e-6), row("JaxBDF", 4e-6, 0.70, 9.7e-6),
            row("JaxBDF", 3e-8, 1.10, 3.3e-7), row("JaxBDF", 1e-9, 0.5, 1e-9, status="step_limit"),
            row("Slow", 1e-6, 9.0, 5e-6)]
    lines = scaling.equal_error_summary(rows, baseline="CVODE").splitlines()[2:]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    # the looser baseline run first: JaxBDF's fastest within 3.5e-6 is rtol 2e-6 (not 4e-6, whose error is larger)
    assert cells[0][:6] == ["d64", "1e-06", "2.40", "3.5e-06", "JaxBDF", "2e-06"]
    assert cells[0][8] == f"{2.4 / 0.78:.2f}×"
    assert cells[1][4:] == ["Slow", "–", "–", "none within", "–"]
    # at the tighter level only rtol 3e-8 qualifies; the unfinished run's small error is not counted
    assert cells[2][:6] == ["d64", "1e-08", "3.80", "4.6e-07", "JaxBDF", "3e-08"]
    assert cells[2][8] == f"{3.8 / 1.10:.2f}×"
    assert len(cells) == 4


def test_a_baseline_that_is_not_run_is_refused_before_any_run(tmp_path):
    completed = subprocess.run([sys.executable, str(SCRIPT), "--cases", "d16", "--methods", "JaxBDF", "--baseline",
                                "JaxBDF,CVODE", "--out", str(tmp_path / "r.md")], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    assert "--baseline CVODE is not among --methods JaxBDF" in completed.stderr.strip().splitlines()[-1]
    assert "reference" not in completed.stderr and not (tmp_path / "r.md").exists()
