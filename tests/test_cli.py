"""The command line: exit codes, one-line errors, what each command writes."""

import json
import subprocess
import sys

import numpy as np
import pytest

from flowsim.config import load_config
from flowsim.runs.experiment import execute_run
from flowsim.model.models import OneLayerTransformer

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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------
# Failing loudly and losing nothing


def _invoke(*args):
    from typer.testing import CliRunner

    from flowsim.cli import app

    return CliRunner().invoke(app, list(args))


def _one_error_line(result) -> str:
    """The command's output is one 'flowsim: error: ...' line and no traceback."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("flowsim: error: "), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    return lines[0]


def test_a_diverging_run_exits_1_with_status_diverged_and_no_stage_labels(tmp_path):
    result = _invoke("run", "--set", "time.t_end=2000", "--set", "solver.method=gradient_descent", "--set", "solver.lr=20",
                     "--out", str(tmp_path / "run"), "--quiet")
    assert result.exit_code == 1 and "diverged" in result.output
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status_name"] == "diverged" and not (tmp_path / "run" / "stages.json").exists()
    assert "not labelled" in _one_error_line(_invoke("stages", str(tmp_path / "run")))


def test_an_oversized_finite_loss_is_refused_in_one_line(tmp_path):
    line = _one_error_line(_invoke("run", "--set", "loss.kind=finite", "--set", "loss.s=10000", "--out", str(tmp_path / "r")))
    assert "over the memory budget" in line and "FLOWSIM_MEMORY_BUDGET_GB" in line
    assert not (tmp_path / "r").exists()


def test_out_that_is_a_file_is_refused_by_every_command(tmp_path):
    (tmp_path / "file").write_text("x")
    for command in (["run"], ["sweep", "--grid", "chain.lam=[0.3]"], ["bridge", "train"]):
        assert "is a file, not a folder" in _one_error_line(_invoke(*command, "--out", str(tmp_path / "file")))


@pytest.mark.slow
def test_damaged_run_files_give_one_line_and_exit_2(tmp_path):
    config = load_config(None, SMALL)
    execute_run(config, tmp_path / "good", progress=False)
    whole = (tmp_path / "good" / "trajectory.npz").read_bytes()
    for damage, content in {"truncated": whole[: len(whole) // 3], "empty": b""}.items():
        run_dir = tmp_path / damage
        run_dir.mkdir()
        for name in ("config.toml", "meta.json", "observables.npz"):  # the cached observables stay: still noticed
            (run_dir / name).write_bytes((tmp_path / "good" / name).read_bytes())
        (run_dir / "trajectory.npz").write_bytes(content)
        for command in ("stages", "compare"):
            line = _one_error_line(_invoke(command, str(run_dir)))
            assert "trajectory.npz is damaged" in line and "run the flow again" in line
    (tmp_path / "good" / "observables.npz").write_bytes(b"")  # a damaged cache is recomputed
    assert _invoke("stages", str(tmp_path / "good")).exit_code == 0
    assert (tmp_path / "good" / "observables.npz").stat().st_size > 0


def test_a_sweep_resumed_with_other_settings_is_refused(tmp_path):
    out = str(tmp_path / "sweep")
    base = ["sweep", "--grid", "chain.lam=[0.3, 0.5]", "--out", out, *[item for s in SMALL for item in ("--set", s)]]
    assert _invoke(*base).exit_code == 0
    before = {path.name: path.read_text() for path in (tmp_path / "sweep" / "rows").iterdir()}
    line = _one_error_line(_invoke(*base, "--set", "time.t_end=40.0"))
    assert "2 rows it cannot reuse, made with other settings or damaged" in line and "time.t_end: 30.0 -> 40.0" in line
    assert {path.name: path.read_text() for path in (tmp_path / "sweep" / "rows").iterdir()} == before  # untouched
    assert _invoke(*base).exit_code == 0  # the same settings resume (nothing to run)
    assert _invoke(*base, "--set", "time.t_end=40.0", "--force-new").exit_code == 0
    rows = [json.loads(path.read_text()) for path in (tmp_path / "sweep" / "rows").iterdir()]
    assert {row["config"]["time"]["t_end"] for row in rows} == {40.0}


def test_sweep_help_shows_the_grid_syntax():
    assert "[v1, v2, ...]" in _invoke("sweep", "--help").output


def test_bridge_compare_on_a_flowsim_run_says_what_it_is(tmp_path):
    pytest.importorskip("torch")  # without it the command says that the bridge needs torch
    execute_run(load_config(None, SMALL), tmp_path / "run", progress=False)
    line = _one_error_line(_invoke("bridge", "compare", str(tmp_path / "run")))
    assert "not a `flowsim bridge train` run directory" in line and "flowsim compare" in line


@pytest.mark.slow
def test_sigterm_stops_an_explicit_solve_inside_its_compiled_call(tmp_path):
    """Tsit5's solve is one compiled call; SIGTERM sent while it runs must reach the event it polls
    after every step (the handler runs in the main thread, which must not be blocked in the call)."""
    import os
    import signal

    sets = ["solver.method='Tsit5'", "time.t_end=100000.0", "solver.max_steps=50000000"]  # hours to the end
    arguments = [item for s in sets for item in ("--set", s)]
    run_dir = tmp_path / "run"
    # --quiet: without a progress bar no Python runs during the compiled solve but the event's own poll
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "FLOWSIM_SIGNAL_READY": "1"}
    process = subprocess.Popen([sys.executable, "-m", "flowsim.cli", "run", *arguments, "--out", str(run_dir), "--quiet"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=environment)
    said = b""
    # the run's handler is in place: compiling or solving now (a blocked main thread would take neither signal till the end)
    while b"signals handled: stop requests" not in said:
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, f"the run ended before its handler was in place: {said.decode(errors='replace')}"
        said += chunk
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr.decode()
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status_name"] == "interrupted" and 0 <= meta["t_reached"] < 100000.0


@pytest.mark.slow  # three processes; the default suite resumes interrupted runs bit for bit without a signal
def test_sigint_stops_a_run_which_resume_continues_to_the_uninterrupted_state(tmp_path):
    """A run sent SIGINT mid-solve exits 130 with its points and its loop state (JaxBDF's) written;
    --resume then reaches, bit for bit, what an uninterrupted run reaches."""
    import os
    import re
    import signal

    import numpy as np

    from flowsim.assemble import prepare
    from flowsim.solve.solvers import solve_flow

    sets = ["loss.kind=finite", "loss.s=20", "time.t_end=3000"]  # a solve of a few seconds: time to interrupt it
    arguments = [item for s in sets for item in ("--set", s)]
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "flowsim.cli", "run", *arguments, "--out", str(run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    progress = b""
    # the bar has moved past t = 0: compiled, and saving points (a bar at t = 0 may still be compiling)
    while not any(float(t) > 0 for t in re.findall(rb"t=([0-9.]+)/", progress)):
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, f"the run ended before solving: {progress.decode(errors='replace')}"
        progress += chunk
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)  # stops within one chunk, not at the end of the run
    assert process.returncode == 130, stderr.decode()
    assert f"flowsim run --resume {run_dir}" in stderr.decode() and b"Traceback" not in stderr
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status_name"] == "interrupted" and 0 < meta["t_reached"] < 3000
    assert (run_dir / "solver_state.npz").is_file()
    stages = run_cli("stages", str(run_dir), cwd=tmp_path)
    assert stages.returncode == 0 and "partial run: status interrupted" in stages.stdout

    resumed = run_cli("run", "--resume", str(run_dir), "--quiet", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "finished" in resumed.stdout and "steps differ" not in resumed.stderr
    assert json.loads((run_dir / "meta.json").read_text())["status_name"] == "finished"
    assert not (run_dir / "solver_state.npz").exists()
    prepared = prepare(load_config(None, sets))
    whole = solve_flow(prepared.flow, prepared.params0, prepared.times)
    with np.load(run_dir / "trajectory.npz") as saved:
        for name, values in whole.trajectory.params.items():
            np.testing.assert_array_equal(saved[name], values)


def test_an_init_file_with_nan_entries_is_refused_before_a_folder_is_made(tmp_path):
    model = OneLayerTransformer(d=4, m=8, k=8)
    params = {name: np.array(value) for name, value in model.init(1e-3, 0).items()}
    params["W_Q"][2, 3] = np.nan
    np.savez(tmp_path / "start.npz", **params)
    line = _one_error_line(_invoke("run", "--set", f"init.file='{tmp_path / 'start.npz'}'", "--out", str(tmp_path / "r")))
    assert "init.file" in line and "W_Q has 1 non-finite entries" in line and "nan" in line
    assert not (tmp_path / "r").exists()


def _as_interrupted(run_dir) -> None:
    """Make a finished run one whose process stopped halfway (what --resume continues): its first half of the
    trajectory, and meta.json saying "interrupted"."""
    from flowsim.solve.trajectory import Trajectory

    whole = Trajectory.load(run_dir / "trajectory.npz")
    half = len(whole) // 2
    Trajectory(t=whole.t[:half], loss=whole.loss[:half], params={name: value[:half] for name, value in whole.params.items()}
               ).save(run_dir / "trajectory.npz")
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, "status_name": "interrupted", "t_reached": float(whole.t[half - 1])}))


def test_a_resume_after_the_config_was_edited_is_refused_naming_the_keys(tmp_path):
    run_dir = tmp_path / "run"
    execute_run(load_config(None, SMALL), run_dir, progress=False)
    _as_interrupted(run_dir)
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace("lam = 0.5", "lam = 0.8"))
    meta = (run_dir / "meta.json").read_bytes()
    line = _one_error_line(_invoke("run", "--resume", str(run_dir)))
    assert "config.toml was edited after the run started (chain.lam: 0.5 -> 0.8)" in line
    assert (run_dir / "meta.json").read_bytes() == meta


def test_a_failed_resume_leaves_the_folder_as_it_was(tmp_path):
    """A solver state from another run (another size) fails the resume; meta.json keeps its status and t_reached."""
    execute_run(load_config(None, SMALL), tmp_path / "run", progress=False)
    _as_interrupted(tmp_path / "run")
    np.savez(tmp_path / "run" / "solver_state.npz", y=np.zeros((1, 7)), saved=np.zeros((1, 64, 7)))
    files = {name: (tmp_path / "run" / name).read_bytes() for name in ("meta.json", "config.toml", "trajectory.npz")}
    line = _one_error_line(_invoke("run", "--resume", str(tmp_path / "run")))
    assert "solver_state.npz is damaged (not this run's JaxBDF loop state: the saved JaxBDF state lacks" in line
    assert "delete it to resume afresh from the last saved point" in line
    assert {name: (tmp_path / "run" / name).read_bytes() for name in files} == files


def test_a_run_the_old_default_began_with_jaxradau_resumes_with_jaxbdf_from_its_last_point(tmp_path):
    """'auto' stood for JaxRadau at small sizes before it was JaxBDF: such a run's loop state is JaxRadau's, which
    JaxBDF cannot continue, so the resume starts afresh from the last saved point and ends as a whole run does."""
    from flowsim.solve.trajectory import Trajectory

    execute_run(load_config(None, SMALL), tmp_path / "run", progress=False)
    whole = Trajectory.load(tmp_path / "run" / "trajectory.npz")
    _as_interrupted(tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    (tmp_path / "run" / "meta.json").write_text(json.dumps({**meta, "method": "JaxRadau"}))
    np.savez(tmp_path / "run" / "solver_state.npz", y=np.zeros((1, 7)), saved=np.zeros((1, 64, 7)))  # not JaxBDF's
    assert _invoke("run", "--resume", str(tmp_path / "run")).exit_code == 0
    resumed = Trajectory.load(tmp_path / "run" / "trajectory.npz")
    np.testing.assert_array_equal(resumed.t, whole.t)
    np.testing.assert_allclose(resumed.loss, whole.loss, rtol=1e-6)
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["method"] == "JaxBDF"


def test_a_second_writer_of_a_run_or_a_sweep_folder_is_refused(tmp_path):
    from flowsim.runs.rundir import folder_lock

    execute_run(load_config(None, SMALL), tmp_path / "run", progress=False)
    _as_interrupted(tmp_path / "run")
    meta = (tmp_path / "run" / "meta.json").read_bytes()
    with folder_lock(tmp_path / "run"):
        line = _one_error_line(_invoke("run", "--resume", str(tmp_path / "run")))
    assert "is in use by another flowsim process (pid" in line and (tmp_path / "run" / "meta.json").read_bytes() == meta
    sweep = ["sweep", "--grid", "chain.lam=[0.3]", "--out", str(tmp_path / "sweep"), *[i for s in SMALL for i in ("--set", s)]]
    with folder_lock(tmp_path / "sweep"):
        line = _one_error_line(_invoke(*sweep))
    assert "sweep folder" in line and "in use by another flowsim process" in line
    assert not (tmp_path / "sweep" / "sweep.json").exists()


@pytest.mark.parametrize("code, reason", [(28, "disk full"), (30, "read-only file system")])  # ENOSPC, EROFS
def test_a_failed_write_keeps_the_trajectory_and_says_what_was_lost(tmp_path, monkeypatch, code, reason):
    import os

    from flowsim.runs import experiment
    from flowsim.solve.trajectory import Trajectory

    def cannot_write(observables, run_dir):
        raise OSError(code, os.strerror(code), str(run_dir / "observables.npz"))

    monkeypatch.setattr(experiment, "save_observables", cannot_write)
    result = _invoke("run", *[i for s in SMALL for i in ("--set", s)], "--out", str(tmp_path / "run"))
    assert result.exit_code == 1 and reason in result.output and "Traceback" not in result.output
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status_name"] == f"failed: {reason}"
    assert "kept: trajectory.npz" in meta["message"] and "not written: observables.npz" in meta["message"]
    assert Trajectory.load(tmp_path / "run" / "trajectory.npz").t[-1] == 30.0


@pytest.mark.parametrize("arguments, message", [
    (["--set", "init.eps=1e200"], "init.eps = 1e+200 is invalid: input should be less than or equal to 1000"),
    (["--set", "init.seed=-1"], "init.seed = -1 is invalid: input should be greater than or equal to 0"),
    (["--set", "solver.rtol=1e-300"], "solver.rtol = 1e-300 is invalid"),
    (["--set", "init.file='FOLDER'"], "init.file 'FOLDER' is a folder; expected an .npz file"),
    (["FOLDER"], "config file 'FOLDER' is a folder; expected a TOML file"),
    (["LATIN1"], "is not UTF-8 text (byte 0xe9 at offset"),
])
def test_bad_values_and_files_are_named_in_one_line(tmp_path, monkeypatch, arguments, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FOLDER").mkdir()
    (tmp_path / "LATIN1").write_bytes("[chain]\nlam = 0.5  # réglé\n".encode("latin-1"))
    assert message in _one_error_line(_invoke("run", *arguments, "--out", str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()


def test_files_where_folders_go_and_a_nan_target_are_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")
    assert "the runs folder 'runs' is a file" in _one_error_line(_invoke("run", *[i for s in SMALL for i in ("--set", s)]))
    (tmp_path / "cache").write_text("")
    line = _one_error_line(_invoke("figures", "--only", "fig10_premature_specialisation", "--tiny", "--cache", "cache"))
    assert "--cache 'cache' is a file, not a folder" in line
    assert "--loss-target nan is not a finite number" in _one_error_line(_invoke("compare-runs", "--loss-target", "nan", "x"))


def test_stages_of_a_running_run_say_how_far_its_table_goes(tmp_path):
    """A running solver is ahead of its last checkpoint: the note gives the saved reach, which the table covers."""
    from flowsim.runs.rundir import this_process
    from flowsim.solve.trajectory import Trajectory

    run_dir = tmp_path / "run"
    execute_run(load_config(None, SMALL), run_dir, progress=False)
    whole = Trajectory.load(run_dir / "trajectory.npz")
    Trajectory(whole.t[:20], whole.loss[:20], {name: value[:20] for name, value in whole.params.items()}).save(run_dir / "trajectory.npz")
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, "status_name": "running", "t_reached": 29.5, **this_process()}))
    result = _invoke("stages", str(run_dir))
    assert result.exit_code == 0 and f"partial run: status running, saved up to t = {whole.t[19]:g} of t_end = 30" in result.output
    assert "29.5" not in result.output


def test_compare_runs_tabulates_one_layer_runs_and_overlays_them(tmp_path):
    """Each run's line holds the onsets its own stages.json gives; a larger ε condenses sooner; the overlay is written."""
    for name, eps in (("small", 1e-3), ("large", 1e-2)):
        execute_run(load_config(None, ["time.t_end=300.0", "time.n_log=100", f"init.eps={eps}"]), tmp_path / name, progress=False)
    figure = tmp_path / "both.png"
    result = _invoke("compare-runs", str(tmp_path / "small"), str(tmp_path / "large"), "--figure", str(figure),
                     "--loss-target", "1.0")
    assert result.exit_code == 0, result.output
    header, *lines, written = result.output.strip().splitlines()
    assert header.split()[:4] == ["run", "status", "t_end", "final"] and written == f"written: {figure}"
    columns = {line.split()[0]: line.split() for line in lines}
    condensed = {}
    for name in ("small", "large"):
        intervals = json.loads((tmp_path / name / "stages.json").read_text())["intervals"]
        condensed[name] = min(i["t_end"] for i in intervals if i["stage"] == "condensation")
        firsts = [min((i["t_start"] for i in intervals if i["stage"] == stage), default=None)
                  for stage in ("focus", "dilution", "restart")]
        expected = [f"{condensed[name]:.5g}"] + ["not reached" if t is None else f"{t:.5g}" for t in firsts]
        row = columns[name]  # name, status, t_end, final loss, time to the target, condensed, focus, dilution, restart, cycles
        assert row[1] == "finished" and " ".join(row[5:-1]) == " ".join(expected)
        assert None in firsts  # one event the run did not reach by t = 300 reads "not reached"
    assert condensed["large"] < condensed["small"]
    assert figure.stat().st_size > 10_000
    too_many = _invoke("compare-runs", *[str(tmp_path / "small")] * 5, "--figure", str(tmp_path / "five.png"))
    assert "1 to 4 one-layer runs, got 5" in _one_error_line(too_many)
    nowhere = _invoke("compare-runs", str(tmp_path / "small"), "--figure", str(tmp_path / "missing" / "a.png"))
    assert "--figure" in _one_error_line(nowhere) and "missing" in _one_error_line(nowhere)


def test_an_underflowing_initial_scale_a_uniform_pi_and_a_huge_sweep_are_one_line_each(tmp_path, monkeypatch):
    """ε whose ε⁴ underflows float64, π uniform in `predict` (μ1 = 0) and 2 × 10⁸ sweep rows: one line, exit 2,
    nothing written."""
    line = _one_error_line(_invoke("run", "--set", "init.eps=1e-300", "--out", str(tmp_path / "tiny")))
    assert "init.eps = 1e-300" in line and "underflow" in line and not (tmp_path / "tiny").exists()
    assert _invoke("run", "--set", "init.eps=1e-70", "--out", str(tmp_path / "small"), *[x for s in SMALL for x in ("--set", s)],
                   "--quiet").exit_code == 0
    monkeypatch.setenv("FLOWSIM_PREDICTION_CACHE", "off")
    line = _one_error_line(_invoke("predict", "--set", "chain.pi=[0.25, 0.25, 0.25, 0.25]"))
    assert "π is uniform" in line and "μ1" in line
    line = _one_error_line(_invoke("sweep", "--grid", "time.t_end=[20, 30]", "--seeds", "100000000", "--out", str(tmp_path / "big")))
    assert "200000000 rows" in line and not (tmp_path / "big").exists()


def test_a_damaged_sweep_row_is_named_and_recomputed_only_on_request(tmp_path):
    """A row file whose final_loss is not a number, or that holds a JSON array, is reported by name with what is
    wrong, is never copied into sweep.csv, and --force-new recomputes it."""
    out = tmp_path / "sweep"
    base = ["sweep", "--grid", "chain.lam=[0.3, 0.5]", "--out", str(out), *[item for s in SMALL for item in ("--set", s)]]
    assert _invoke(*base).exit_code == 0
    first, second = sorted((out / "rows").iterdir())
    row = json.loads(first.read_text())
    first.write_text(json.dumps({**row, "final_loss": "abc"}))
    second.write_text("[1, 2]")
    line = _one_error_line(_invoke(*base))
    assert "final_loss is 'abc', expected a number" in line and "--force-new" in line
    assert "abc" not in (out / "sweep.csv").read_text()
    assert _invoke(*base, "--force-new").exit_code == 0
    assert all(isinstance(json.loads(path.read_text())["final_loss"], float) for path in (out / "rows").iterdir())


@pytest.mark.parametrize("damage", ["[1, 2]", "status_name"])
def test_a_meta_json_of_the_wrong_shape_is_one_line_in_every_command(tmp_path, damage):
    """meta.json that is a JSON array, or whose status_name is a number: stages, resume and compare each say which
    file is damaged and how, in one line."""
    run_dir = tmp_path / "run"
    assert _invoke("run", "--out", str(run_dir), "--quiet", *[x for s in SMALL for x in ("--set", s)]).exit_code == 0
    meta = run_dir / "meta.json"
    meta.write_text(damage if damage.startswith("[") else json.dumps({**json.loads(meta.read_text()), "status_name": 3}))
    for command in (["stages", str(run_dir)], ["run", "--resume", str(run_dir)], ["compare", str(run_dir)]):
        line = _one_error_line(_invoke(*command))
        assert "meta.json is damaged" in line and ("list" in line or "status_name is 3" in line), (command, line)


def test_a_prediction_cache_entry_that_is_a_folder_is_passed_over(tmp_path, monkeypatch):
    """The cache entry's name taken by a folder: predict computes, prints its table, and says it did not cache."""
    from flowsim.config import load_config
    from flowsim.runs.predictions import prediction_key

    monkeypatch.setenv("FLOWSIM_PREDICTION_CACHE", str(tmp_path))
    (tmp_path / f"{prediction_key(load_config(None, ['time.t_end=30']))}.json").mkdir()
    result = _invoke("predict", "--set", "time.t_end=30")  # through condensation
    assert result.exit_code == 0 and "condensation" in result.output and "prediction not cached" in result.output, result.output


def test_paths_the_file_system_cannot_hold_and_dangling_links_are_one_line(tmp_path):
    """--out as a link to nothing or a loop of links, a name over 255 bytes, a path over 4095 bytes (as --out, in
    every command that writes), and an over-long input path (through the console entry point): one line, exit 2."""
    (tmp_path / "dangling").symlink_to(tmp_path / "missing" / "x")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    long_name, long_path = tmp_path / ("a" * 300), tmp_path.joinpath(*["b" * 200] * 25)
    for out, expected in ((tmp_path / "dangling", "symbolic link to nothing"), (tmp_path / "loop1", "symbolic link to nothing"),
                          (long_name, "300 bytes long"), (long_path, "a path holds at most 4095")):
        for command in (["run", "--set", "time.t_end=5"], ["sweep", "--grid", "time.t_end=[5, 6]"], ["figures", "--tiny"]):
            assert expected in _one_error_line(_invoke(*command, "--out", str(out))), (command, out)
    done = run_cli("stages", str(long_name), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "File name too long" in done.stderr and "at most 255 bytes" in done.stderr


def test_a_folder_another_process_writes_is_named_with_its_holder_and_left_untouched(tmp_path):
    """While a run directory's lock is held (by a writer that may not have written its trajectory yet), resume,
    stages and compare each name the holder (pid, host, since) in one line and write nothing."""
    from flowsim.runs.rundir import folder_lock

    finished = tmp_path / "finished"
    assert _invoke("run", "--out", str(finished), "--quiet", *[x for s in SMALL for x in ("--set", s)]).exit_code == 0
    (finished / "stages.json").unlink()
    starting = tmp_path / "starting"  # a writer that has only taken its lock so far
    for folder in (finished, starting):
        with folder_lock(folder):
            before = sorted(path.name for path in folder.iterdir())
            for command in (["run", "--resume", str(folder)], ["stages", str(folder)], ["compare", str(folder)]):
                line = _one_error_line(_invoke(*command))
                assert "in use by another flowsim process (pid " in line and " since " in line, (command, line)
            assert sorted(path.name for path in folder.iterdir()) == before


@pytest.mark.parametrize("method,tampered_t", [pytest.param("JaxRadau", 1e9, marks=pytest.mark.slow), ("JaxRadau", -1.0),
                                               ("JaxRadau", float("nan")), ("JaxBDF", float("nan"))])
def test_a_solver_state_whose_time_was_altered_is_refused_and_the_folder_kept(tmp_path, monkeypatch, method, tampered_t):
    """A loop state saved by an interrupted run, its t altered (past the horizon, before the start, NaN): the resume
    is one line naming the state, and meta.json, config.toml and trajectory.npz are as they were. Unaltered, the
    resumed run reaches what an uninterrupted one does, bit for bit (JaxRadau's and JaxBDF's)."""
    from flowsim.common.interrupts import StopRequest

    run_dir, config = tmp_path / "run", load_config(None, [*SMALL, f"solver.method='{method}'"])
    with monkeypatch.context() as patched:
        patched.setattr(StopRequest, "__call__", lambda self: True)  # SIGINT at the first poll: the state is saved
        execute_run(config, run_dir, progress=False)
    original = dict(np.load(run_dir / "solver_state.npz"))
    np.savez(run_dir / "solver_state.npz", **{**original, "t": np.full_like(original["t"], tampered_t)})
    files = {name: (run_dir / name).read_bytes() for name in ("meta.json", "config.toml", "trajectory.npz")}
    line = _one_error_line(_invoke("run", "--resume", str(run_dir)))
    assert f"the saved {method} state is at t =" in line and "altered" in line, line
    assert {name: (run_dir / name).read_bytes() for name in files} == files
    if np.isnan(tampered_t):  # once per method: the state as saved resumes to the uninterrupted run
        np.savez(run_dir / "solver_state.npz", **original)
        resumed = _invoke("run", "--resume", str(run_dir), "--quiet")
        assert resumed.exit_code == 0 and "steps differ" not in resumed.output, resumed.output
        whole = execute_run(config, tmp_path / "whole", progress=False)
        with np.load(run_dir / "trajectory.npz") as saved:
            for name, values in whole.trajectory.params.items():
                np.testing.assert_array_equal(saved[name], values)


def test_a_full_disk_in_a_sweep_is_one_line_that_keeps_the_rows_written(tmp_path, monkeypatch):
    """ENOSPC on the second row file (workers = 1, in this process): one line naming the file and the rows kept,
    exit 1; the first row is intact, and the same command afterwards finishes the sweep."""
    import errno

    from flowsim.runs import sweep

    real, calls = sweep.write_atomic_json, []

    def full_on_the_second_row(path, *args, **kwargs):
        if "rows" in str(path):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    out = tmp_path / "sweep"
    base = ["sweep", "--grid", "chain.lam=[0.3, 0.5]", "--batch", "1", "--out", str(out), *[x for s in SMALL for x in ("--set", s)]]
    with monkeypatch.context() as patched:
        patched.setattr(sweep, "write_atomic_json", full_on_the_second_row)
        result = _invoke(*base)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and lines[-1].startswith("flowsim: error: no space left on device while writing "), result.output
    assert f"1 row is written in {out / 'rows'}, kept" in lines[-1] and len(list((out / "rows").iterdir())) == 1
    assert _invoke(*base).exit_code == 0 and len(list((out / "rows").iterdir())) == 2


def test_interrupt_and_failure_messages_name_only_what_exists(tmp_path, monkeypatch):
    """An interrupted `figures` or sweep names a folder only when something was written in it, and a failed write that
    kept nothing says so without claiming a trajectory."""
    import errno

    import figures

    from flowsim import cli
    from flowsim.runs.experiment import _record_lost_outputs

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(figures, "build_figures", interrupted)
    result = _invoke("figures", "--out", str(tmp_path / "figo"), "--cache", str(tmp_path / "cache"))
    assert result.exit_code == 130
    assert result.output.strip() == ("interrupted: no figure was written; the same command builds the figures again "
                                     "from the runs cached so far"), result.output

    def one_then_interrupted(out, cache, only, tiny, report):
        report("fig01_loss_stages: building (the default flowsim run)")
        report("fig01_loss_stages: 1.0 s  Loss of the default run")
        (out / "fig01_loss_stages.png").write_bytes(b"png")
        (out / "fig02_singular_values.png").write_bytes(b"an earlier build's")
        report("fig02_singular_values: building (the default flowsim run)")
        raise KeyboardInterrupt

    (tmp_path / "figo").mkdir()
    monkeypatch.setattr(figures, "build_figures", one_then_interrupted)
    result = _invoke("figures", "--out", str(tmp_path / "figo"), "--cache", str(tmp_path / "cache"))
    assert result.output.strip().splitlines()[-1].startswith(f"interrupted: fig01_loss_stages written in {tmp_path / 'figo'}; ")
    assert cli._rows_written(tmp_path / "st4") == "no row was written"
    (tmp_path / "st4" / "rows").mkdir(parents=True)
    (tmp_path / "st4" / "rows" / "a.json").write_text("{}")
    assert cli._rows_written(tmp_path / "st4") == f"1 row is written in {tmp_path / 'st4' / 'rows'}"
    (tmp_path / "run").mkdir()
    message = str(_record_lost_outputs(tmp_path / "run", OSError(errno.ENOSPC, "No space left on device")))
    assert "kept: nothing; not written: trajectory.npz, observables.npz" in message, message
    assert "last checkpoint" not in message


def test_a_run_whose_last_meta_write_failed_is_finished_by_its_resume(tmp_path, monkeypatch):
    """The disk fills at the final meta.json writes (the run's and its failure record's): meta.json still says
    "running". `stages` labels it, and `--resume` writes the missing outputs and meta.json "finished" from the
    complete trajectory without solving again; no temporary file is left."""
    import errno

    import flowsim.runs.experiment as experiment

    run_dir = tmp_path / "run"
    real = experiment.write_meta

    def full_after_the_solve(folder, meta):
        if meta.get("status_name") != "running":
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "meta.json"))
        return real(folder, meta)

    with monkeypatch.context() as patched:
        patched.setattr(experiment, "write_meta", full_after_the_solve)
        with pytest.raises(experiment.OutputWriteError, match="disk full"):
            execute_run(load_config(None, SMALL), run_dir, progress=False)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status_name"] == "running"
    gone = subprocess.Popen(["true"])
    gone.wait()  # the writer's process has ended, as it would have after its error
    (run_dir / "meta.json").write_text(json.dumps({**meta, "pid": gone.pid, "process_start": -1}))
    trajectory = (run_dir / "trajectory.npz").read_bytes()
    assert _invoke("stages", str(run_dir)).exit_code == 0
    result = _invoke("run", "--resume", str(run_dir))
    assert result.exit_code == 0 and "its outputs written by a resume" in result.output, result.output
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status_name"] == "finished" and meta["t_reached"] == 30.0
    assert (run_dir / "trajectory.npz").read_bytes() == trajectory and (run_dir / "summary.png").stat().st_size > 0
    assert not [path.name for path in run_dir.iterdir() if path.name.startswith(".") and path.name != ".flowsim.lock"]


def test_a_signal_during_the_last_chunk_still_stops_the_run_and_its_resume_writes_the_outputs(tmp_path, monkeypatch):
    """SIGINT while the solve's last chunk runs (the request is seen only once it has reached the last save time):
    the run still stops there, interrupted, with its trajectory whole and no stages or figure; `--resume` writes them
    without solving again."""
    import os
    import signal

    import flowsim.runs.experiment as experiment

    run_dir = tmp_path / "run"
    real = experiment.solve_flow

    def signalled_while_solving(*args, **kwargs):
        result = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # stop_requests' handler turns it into a request
        return result

    with monkeypatch.context() as patched:
        patched.setattr(experiment, "solve_flow", signalled_while_solving)
        result = execute_run(load_config(None, SMALL), run_dir, progress=False)
    assert result.status_name == "interrupted" and "SIGINT" in result.message and result.t_reached == 30.0
    assert not (run_dir / "summary.png").exists() and not (run_dir / "stages.json").exists()
    trajectory = (run_dir / "trajectory.npz").read_bytes()
    resumed = _invoke("run", "--resume", str(run_dir))
    assert resumed.exit_code == 0 and "its outputs written by a resume" in resumed.output, resumed.output
    assert (run_dir / "trajectory.npz").read_bytes() == trajectory and (run_dir / "summary.png").stat().st_size > 0


@pytest.mark.parametrize("group", [[], ["bridge"]])
def test_the_help_describes_every_command_without_cutting_it_off(group):
    """`flowsim --help` and `flowsim bridge --help` at 80 columns: every command's line is whole, none ends in '...'."""
    from typer.testing import CliRunner

    from flowsim.cli import app

    result = CliRunner().invoke(app, [*group, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    listed = result.output.split("Commands:")[1].strip().splitlines()
    assert len(listed) >= 3 and not [line for line in listed if line.rstrip().endswith("...")], listed


def test_a_theory_integration_that_fails_is_one_line_and_exit_1(monkeypatch):
    """`predict` whose own integration fails (a reduced flow whose steps shrink to nothing) names the failure in one
    line, exit 1, no traceback."""
    from typer.testing import CliRunner

    import flowsim.runs.predictions
    from flowsim.cli import app

    def failing(config, progress):
        raise RuntimeError("the rank-3 reduced flow failed at t ≈ 2645.96, where its coordinates have norm 6481: the "
                           "step size fell below the spacing of floating-point numbers")

    monkeypatch.setattr(flowsim.runs.predictions, "cached_prediction", failing)
    result = CliRunner().invoke(app, ["predict"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "flowsim: error: the prediction failed: the rank-3 reduced flow failed at t ≈ 2645.96" in result.output


@pytest.mark.parametrize("phase, patched, number", [("observables", "compute_observables", "SIGTERM"),
                                                    ("stage labels", "stages_of", "SIGINT"),
                                                    ("summary figure", "plot_run_summary", "SIGTERM")])
def test_a_signal_in_each_output_phase_exits_130_and_the_phase_is_finished_without_solving(tmp_path, monkeypatch, phase,
                                                                                          patched, number):
    """SIGINT or SIGTERM while the observables, the stage labels or the figure are computed: exit 130 with one line
    naming the phase and the remedy; meta.json says "interrupted", the phase and the solve's statistics; the
    trajectory is whole. `flowsim stages` then labels the run and `--resume` writes every output without solving."""
    import os
    import signal

    import flowsim.runs.experiment as experiment

    run_dir = tmp_path / "run"
    real = getattr(experiment, patched)

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, number))  # lands as the phase starts its work
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(experiment, patched, signalled)
        sets = [item for pair in zip(["--set"] * len(SMALL), SMALL) for item in pair]
        result = _invoke("run", *sets, "--out", str(run_dir), "--quiet")
    assert result.exit_code == 130, result.output
    said = result.output.strip().splitlines()
    assert len(said) == 1 and f"interrupted while computing the {phase}" in said[0] and "--resume" in said[0], said
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status_name"] == "interrupted" and meta["interrupted_phase"] == phase
    assert meta["t_reached"] == 30.0 and meta["n_steps"] > 0 and meta["method"] == "JaxBDF"
    trajectory = (run_dir / "trajectory.npz").read_bytes()
    steps = meta["n_steps"]

    def no_solve(*args, **kwargs):
        raise AssertionError("the outputs of a solved run must not solve again")

    monkeypatch.setattr(experiment, "solve_flow", no_solve)
    labelled = _invoke("stages", str(run_dir))
    assert labelled.exit_code == 0 and "condensation" in labelled.output, labelled.output
    resumed = _invoke("run", "--resume", str(run_dir))
    assert resumed.exit_code == 0 and "its outputs written by a resume" in resumed.output, resumed.output
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status_name"] == "finished" and "interrupted_phase" not in meta and meta["n_steps"] == steps
    assert set(meta["outputs"]) >= {"observables_seconds", "stage_labels_seconds", "summary_figure_seconds"}
    assert (run_dir / "trajectory.npz").read_bytes() == trajectory and (run_dir / "summary.png").stat().st_size > 0


@pytest.mark.slow
def test_sigterm_while_the_observables_are_computed_is_exit_130_from_the_command_line(tmp_path):
    """The real command, its SIGTERM handler and all: the signal comes as the observables start (the function is
    wrapped to send it), and the process leaves with 130 and one line, not killed by the signal (-15)."""
    run_dir = tmp_path / "run"
    script = ("import os, signal, sys, runpy; import flowsim.runs.experiment as e; real = e.compute_observables\n"
              "def signalled(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return real(*a, **k)\n"
              "e.compute_observables = signalled\n"
              f"sys.argv = {['flowsim', 'run', *[x for s in SMALL for x in ('--set', s)], '--out', str(run_dir), '--quiet']!r}\n"
              "runpy.run_module('flowsim', run_name='__main__')")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert completed.returncode == 130, completed.stderr
    assert "interrupted while computing the observables" in completed.stderr and "Traceback" not in completed.stderr
    assert json.loads((run_dir / "meta.json").read_text())["interrupted_phase"] == "observables"


def test_config_toml_pins_the_method_and_tolerance_that_ran_and_reloads_to_the_same_flow(tmp_path):
    """A run with the default method saves what "auto" stood for and its rtol (config.toml, meta.json's config and
    tolerances); `flowsim run` of that config.toml integrates the same steps to the same numbers."""
    from flowsim.config import tomllib

    sets = [item for pair in zip(["--set"] * len(SMALL), SMALL) for item in pair]
    first = _invoke("run", *sets, "--out", str(tmp_path / "first"), "--quiet")
    assert first.exit_code == 0, first.output
    solver = tomllib.loads((tmp_path / "first" / "config.toml").read_text())["solver"]
    meta = json.loads((tmp_path / "first" / "meta.json").read_text())
    assert solver["method"] == meta["method"] == "JaxBDF" and solver["rtol"] == meta["tolerances"]["rtol"] == 1e-7
    assert meta["config"]["solver"]["method"] == "JaxBDF" and meta["tolerances"]["atol"] == 1e-12
    again = _invoke("run", str(tmp_path / "first" / "config.toml"), "--out", str(tmp_path / "again"), "--quiet")
    assert again.exit_code == 0, again.output
    second = json.loads((tmp_path / "again" / "meta.json").read_text())
    assert second["n_steps"] == meta["n_steps"] and second["config_digest"] == meta["config_digest"]
    np.testing.assert_array_equal(np.load(tmp_path / "again" / "trajectory.npz")["loss"],
                                  np.load(tmp_path / "first" / "trajectory.npz")["loss"])


@pytest.mark.parametrize("damage", ["meta without status", "loss NaN from index 10", "an infinite weight"])
def test_files_with_lost_status_or_non_finite_numbers_are_named_as_damaged(tmp_path, damage):
    """meta.json without its status, a loss that turns NaN, an infinite weight: `stages` and `compare-runs` name the
    file and what is wrong, exit 2; so they do when a cached observables.npz was computed from the damaged file."""
    run_dir = tmp_path / "run"
    execute_run(load_config(None, SMALL), run_dir, progress=False)
    if damage == "meta without status":
        meta = json.loads((run_dir / "meta.json").read_text())
        (run_dir / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("status", "status_name")}))
        expected = ("meta.json is damaged", "no status_name")
    else:
        arrays = dict(np.load(run_dir / "trajectory.npz"))
        if damage == "an infinite weight":
            arrays["W0"][20, 0, 0] = np.inf
            expected = ("trajectory.npz is damaged", "W0 is not finite from saved point 20")
        else:
            arrays["loss"][10:] = np.nan
            expected = ("trajectory.npz is damaged", "loss is not finite from saved point 10")
        np.savez(run_dir / "trajectory.npz", **arrays)
        from flowsim.runs.labelling import save_observables
        from flowsim.observe.observables import Observables

        save_observables(Observables.load(run_dir), run_dir)  # a cache stamped with the damaged file's digest
    for command in (["stages", str(run_dir)], ["compare-runs", str(run_dir), "--figure", str(tmp_path / "x.png")]):
        result = _invoke(*command)
        line = _one_error_line(result)
        assert result.exit_code == 2 and all(part in line for part in expected), line


def test_compare_refuses_a_config_edited_after_the_run(tmp_path):
    """Guards issue 83, item 13: `flowsim compare` read an edited config.toml and put the edited chain's predictions
    beside the unedited run's measurements. Now it is refused as `--resume` refuses it, naming the changed keys,
    before anything is predicted or written."""
    run_dir = tmp_path / "run"
    execute_run(load_config(None, SMALL), run_dir, progress=False)
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace("lam = 0.5", "lam = 0.8"))
    line = _one_error_line(_invoke("compare", str(run_dir)))
    assert f"compare '{run_dir}': config.toml was edited after the run started (chain.lam: 0.5 -> 0.8)" in line
    assert "Restore it to compare" in line and not (run_dir / "compare.json").exists()


def test_a_start_outside_the_formulas_range_is_said_so_without_a_raw_warning():
    """Guards issue 83, item 14: at init.eps = 10 `predict --tier formula` printed a first focus at t = 0 taken from a
    NaN, under a raw numpy RuntimeWarning, and the full tier (`compare`) blamed the chain ("is the chain degenerate?").
    Now the rows say the start is outside the formulas' range, no raw warning is printed, and the full tier's
    condensation names init.eps."""
    import warnings

    from flowsim.assemble import prepare
    from flowsim.config import ConfigError
    from theory.origin import predict_condensation

    result = _invoke("predict", "--tier", "formula", "--set", "init.eps=10")
    assert result.exit_code == 0, result.output
    assert "RuntimeWarning" not in result.output and "Warning:" not in result.output
    focus = next(line for line in result.output.splitlines() if line.startswith("focus"))
    assert "outside the formula's range: the start is past condensation's midpoint" in focus and " 0 " not in focus
    config = load_config(None, ["init.eps=10"])
    prepared = prepare(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match=r"the start is beyond the small start the predictions describe .*: lower init.eps"):
            predict_condensation(prepared.chain.pi, prepared.chain.P, prepared.params0, 10.0)


def test_small_things_say_what_they_are(tmp_path, monkeypatch):
    """Guards issue 83, item 15: dir(flowsim) lacked the public names loaded on first use; the observables' memory
    message suggested observables.fold_d = 16 where that fold (or a smaller one) was already in effect; `bridge train`
    into a `flowsim run` folder said "unknown config section". Each now says what it is."""
    import flowsim
    from flowsim.assemble import check_observables_size
    from flowsim.config import ConfigError

    assert {"MarkovChain", "OneLayerTransformer", "population_loss"} <= set(dir(flowsim))
    configs = {fold_d: load_config(None, [f"observables.fold_d={fold_d}"]) for fold_d in (16, 8, 40)}
    monkeypatch.setenv("FLOWSIM_MEMORY_BUDGET_GB", "1e-6")
    for fold_d, suggests in ((16, False), (8, False), (40, True)):
        with pytest.raises(ValueError) as error:
            check_observables_size(configs[fold_d], 64, 1000)
        assert ("observables.fold_d = 16" in str(error.value)) == suggests and "save fewer times" in str(error.value)
    monkeypatch.delenv("FLOWSIM_MEMORY_BUDGET_GB")
    pytest.importorskip("torch")
    run_dir = tmp_path / "run"
    execute_run(load_config(None, SMALL), run_dir, progress=False)
    line = _one_error_line(_invoke("bridge", "train", "--out", str(run_dir)))
    assert f"{run_dir} holds a `flowsim run` run, not a bridge run; choose a new folder" in line


@pytest.mark.parametrize("arguments", [["--help"], ["figures", "--list"], ["config"], ["config", "--bridge", "data"],
                                       ["data", "where", "wikitext2"], ["run", "--help"]])
def test_discovery_commands_import_neither_jax_nor_torch(arguments, tmp_path):
    """Guards issue 84, item 4: `figures --list` imported JAX (through the figure modules) and `config --bridge` torch
    (through flowsim.bridge's check), seconds each to print text. A fresh interpreter runs the command and says which
    of the heavy libraries it imported (benchmarks/discovery.py times them)."""
    from pathlib import Path

    script = ("import sys; from flowsim.cli import main; sys.argv = ['flowsim', *sys.argv[1:]]\n"
              "try:\n    main()\nexcept SystemExit as stop:\n    code = stop.code\n"
              "print('imported:', sorted(m for m in ('jax', 'torch', 'matplotlib') if m in sys.modules), file=sys.stderr)\n"
              "sys.exit(code)")
    repository = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script, *arguments], capture_output=True, text=True,
                          cwd=repository, env={**__import__("os").environ, "PYTHONPATH": str(repository)})
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "imported: []", done.stderr


@pytest.mark.slow
def test_predicts_dilution_notes_say_which_grid_they_are_read_on():
    """Guards issue 84, item 5: predict's notes dated q0's dilution 687.5 beside the table's 692.8 without saying why:
    the notes read the prediction's own fine grid, the table the run's save times. Each note now says so."""
    from typer.testing import CliRunner

    from flowsim.cli import app

    result = CliRunner().invoke(app, ["predict"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("predicted dilution of")]
    assert notes and all(", read on the prediction's own grid (120 times a decade; the table reads it on the run's "
                         "save times): " in line for line in notes), notes
