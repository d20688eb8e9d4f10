"""flowsim.runs.rundir: fresh run folders, metadata with versions, incomplete folders named."""

import json

import numpy as np
import pytest

from flowsim.runs.rundir import (
    CONFIG_FILE,
    META_FILE,
    TRAJECTORY_FILE,
    library_versions,
    load_run,
    new_run_dir,
    write_config,
    write_meta,
)
from flowsim.solve.trajectory import Trajectory


def test_new_run_dirs_never_collide(tmp_path):
    made = {new_run_dir(tmp_path, "default") for _ in range(3)}  # within one second: suffixed
    assert len(made) == 3 and all(path.is_dir() and path.name.startswith("default-") for path in made)


def test_run_directory_reads_back_and_names_what_is_missing(tmp_path):
    run_dir = tmp_path / "run"
    write_config(run_dir, "[chain]\nlam = 0.5\n")
    with pytest.raises(FileNotFoundError, match=f"missing {TRAJECTORY_FILE}, {META_FILE}"):
        load_run(run_dir)
    write_meta(run_dir, {"status_name": "finished", "seed": np.int64(3), "wall_time_s": np.float64(1.5)})
    Trajectory(t=np.array([0.0, 1.0]), loss=np.array([2.0, 1.0]), params={"W0": np.ones((2, 2, 2))}).save(run_dir / TRAJECTORY_FILE)
    run = load_run(run_dir)
    assert run.config == {"chain": {"lam": 0.5}} and run.meta["seed"] == 3 and run.meta["wall_time_s"] == 1.5
    assert json.loads((run_dir / META_FILE).read_text()) == run.meta
    assert (run_dir / CONFIG_FILE).read_text().endswith("\n")


def test_versions_name_the_numerical_libraries():
    versions = library_versions()
    assert {"python", "flowsim", "jax", "jaxlib", "diffrax", "scipy", "numpy"} <= set(versions)
    assert versions["numpy"] == np.__version__


def test_a_running_status_whose_process_is_gone_reads_as_interrupted():
    import subprocess
    import sys

    from flowsim.runs.rundir import status_of, this_process

    alive = {"status_name": "running", **this_process()}
    assert status_of(alive) == "running"
    finished_child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = {**alive, "pid": int(finished_child.stdout)}
    assert status_of(dead) == "interrupted"
    assert status_of({**dead, "host": "another-host"}) == "running"  # another host's process cannot be checked
    assert status_of({**dead, "status_name": "finished"}) == "finished"


def test_an_output_folder_must_not_be_a_file(tmp_path):
    import pytest

    from flowsim.runs.rundir import check_output_dir

    (tmp_path / "file").write_text("x")
    check_output_dir(tmp_path / "new" / "folder")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output_dir(tmp_path / "file" / "below")


def test_a_recorded_pid_reused_by_another_process_reads_as_interrupted():
    import os

    from flowsim.runs.rundir import process_start, status_of, this_process

    me = {"status_name": "running", **this_process()}
    assert me["process_start"] == process_start(os.getpid()) is not None
    assert status_of(me) == "running"
    assert status_of({**me, "process_start": me["process_start"] - 1}) == "interrupted"  # same pid, another process


def test_a_folder_lock_refuses_a_second_writer_and_goes_with_its_holder(tmp_path):
    import signal
    import subprocess
    import sys

    from flowsim.runs.rundir import FolderInUseError, folder_lock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from flowsim.runs.rundir import folder_lock\n"
                               f"with folder_lock({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUseError, match=rf"in use by another flowsim process \(pid {holder.pid} on "):
            with folder_lock(tmp_path):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with folder_lock(tmp_path):  # a killed holder leaves no stale lock
        with pytest.raises(FolderInUseError):  # and the lock excludes this process's other writers too
            with folder_lock(tmp_path):
                pass


def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_and_its_target_left_alone(tmp_path):
    """Guards issue 83, item 2: folder_lock opened .flowsim.lock following symbolic links and truncated it, so a link
    placed in a shared run folder had `bridge train`, `run` and `sweep` overwrite the file it points to. Now a link, a
    FIFO or a folder at the lock's path is refused in one line (ConfigError: exit 2), the target untouched, and the
    read-only check of `stages` and `compare` neither follows the link nor blocks on the FIFO."""
    import os

    from flowsim.config import ConfigError
    from flowsim.runs.rundir import LOCK_FILE, check_not_in_use, folder_lock

    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / LOCK_FILE).symlink_to(precious)
    for check in (lambda: folder_lock(linked).__enter__(), lambda: check_not_in_use(linked)):
        with pytest.raises(ConfigError, match=rf"{LOCK_FILE} is a symbolic link, expected flowsim's lock file: remove it"):
            check()
    assert precious.read_text() == "keep me\n"
    for kind, make in (("fifo", os.mkfifo), ("folder", os.mkdir)):
        folder = tmp_path / kind
        folder.mkdir()
        make(folder / LOCK_FILE)
        for check in (lambda: folder_lock(folder).__enter__(), lambda: check_not_in_use(folder)):
            with pytest.raises(ConfigError, match=r"is not a regular file, expected flowsim's lock file"):
                check()
