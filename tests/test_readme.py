"""What the README shows a user is what the commands print: its `flowsim config init` block and the first run's
stage table (the numbers, not the times, which depend on the machine)."""

import re
from pathlib import Path

import numpy as np
import pytest

from typer.testing import CliRunner

from flowsim.cli import app

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def block_after(marker: str) -> list[str]:
    """The indented block that follows the line ``marker`` in the README, without its 4-space indent."""
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == marker) + 1
    block = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return [line for line in block if line.strip()]


def test_the_config_init_block_is_what_the_command_prints():
    result = CliRunner().invoke(app, ["config", "init"])
    assert result.exit_code == 0
    assert block_after("$ flowsim config init") == result.output.strip().splitlines()


def test_the_first_runs_stage_table_is_the_default_runs(tmp_path):
    """The rows the README shows (up to its "..."), cut where the README cuts them, its cycle count and its final loss
    are the default run's, its last line says compiling and solving apart, and its solver counts within 5% of it (or 10, for the few rejected steps) (they vary with the machine and the library versions:
    1346 and 1361 steps on two installs of one 2-core machine; the seconds and the folder's name are the day's)."""
    import json

    result = CliRunner().invoke(app, ["run", "--out", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    printed = (tmp_path / "run" / "stages.txt").read_text().splitlines()
    shown = block_after("directory under `runs/`:")
    rows = shown[:shown.index("...")]
    assert len(rows) >= 4
    for readme_line, line in zip(rows, printed):
        assert line.startswith(readme_line.removesuffix(" ...")), (readme_line, line)
    assert next(line for line in shown if line.startswith("cycles")) == printed[-1]
    stats = json.loads((tmp_path / "run" / "meta.json").read_text())
    summary = next(line.strip() for line in shown if line.strip().startswith("method "))
    counts = re.match(r"method JaxBDF, (\d+) steps \((\d+) rejected\), nfev (\d+), njev (\d+); compiling [\d.]+ s, "
                      r"solving [\d.]+ s; final loss (\S+) at t = 6000", summary)
    assert counts is not None, summary
    for shown_count, key in zip(counts.groups()[:4], ("n_steps", "n_rejected", "nfev", "njev")):
        assert int(shown_count) == pytest.approx(stats[key], rel=0.05, abs=10), (summary, stats)
    final_loss = np.load(tmp_path / "run" / "trajectory.npz")["loss"][-1]
    assert float(counts.group(5)) == pytest.approx(final_loss, abs=1e-6), (summary, final_loss)
