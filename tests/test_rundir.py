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


class _RunsCode:
    """A pickle payload that calls os.makedirs(path) when unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        import os

        return os.makedirs, (self.path,)


def _handed_run(folder):
    """A complete run directory, as flowsim writes it, for a hostile edit."""
    folder.mkdir()
    write_config(folder, '[chain]\nlam = 0.5\n')
    Trajectory(np.array([0.0, 1.0]), np.array([1.0, 0.5]), {"W0": np.zeros((2, 2, 2))}).save(folder / TRAJECTORY_FILE)
    write_meta(folder, {"status_name": "finished"})
    return folder


@pytest.mark.parametrize("kind", ["npz with a pickled object", "npz as a FIFO", "meta.json nested deep",
                                  "meta.json as a FIFO", "config.toml nested deep", "init.file as a FIFO",
                                  "init.file with a pickled object"])
def test_a_hostile_file_in_a_run_folder_is_refused_and_nothing_in_it_runs(tmp_path, kind):
    """Guards issue 83, item 3 (the trust model of docs/reliability.md): a run folder is untrusted input. An .npz
    whose array is a pickle that calls os.makedirs is refused unbuilt (allow_pickle=False); a FIFO where an .npz,
    meta.json or init.file should be is refused instead of blocking the read for ever; a meta.json or config.toml
    nested past Python's recursion limit (a RecursionError traceback before) is named as damaged. Each is one error
    naming the file."""
    import os

    from flowsim.common.io import DamagedFileError
    from flowsim.config import ConfigError, load_config
    from flowsim.observe.observables import Observables

    run = _handed_run(tmp_path / "run")
    marker = tmp_path / "made-by-the-file"
    hostile_npz = {"W0": np.array([_RunsCode(str(marker))], dtype=object)}
    if kind == "npz with a pickled object":
        np.savez(run / TRAJECTORY_FILE, t=np.zeros(2), loss=np.zeros(2), **hostile_npz)
        np.savez(run / "observables.npz", t=np.zeros(2), **hostile_npz)
        for read in (lambda: load_run(run), lambda: Observables.load(run)):
            with pytest.raises(DamagedFileError, match=r"\.npz is damaged \(ValueError: Object arrays cannot be loaded"):
                read()
    elif kind == "npz as a FIFO":
        for name in (TRAJECTORY_FILE, "observables.npz"):
            (run / name).unlink(missing_ok=True)
            os.mkfifo(run / name)
        with pytest.raises(DamagedFileError, match=r"observables.npz is damaged \(not a regular file"):
            Observables.load(run)
        with pytest.raises(FileNotFoundError, match="missing trajectory.npz"):
            load_run(run)
    elif kind == "meta.json nested deep":
        (run / META_FILE).write_text("[" * 100_000 + "]" * 100_000)
        with pytest.raises(DamagedFileError, match=r"meta.json is damaged \(nested too deep to be a file flowsim wrote\)"):
            load_run(run)
    elif kind == "meta.json as a FIFO":
        from flowsim.common.io import read_json

        (run / META_FILE).unlink()
        os.mkfifo(run / META_FILE)
        with pytest.raises(DamagedFileError, match=r"meta.json is damaged \(not a regular file"):
            read_json(run / META_FILE)
    elif kind == "config.toml nested deep":
        (run / CONFIG_FILE).write_text("lam = " + "[" * 5000 + "]" * 5000 + "\n")
        with pytest.raises(DamagedFileError, match=r"config.toml is damaged \(nested too deep"):
            load_run(run)
        with pytest.raises(ConfigError, match=r"config.toml' nests its values too deep to be a config"):
            load_config(run / CONFIG_FILE)
    else:
        from flowsim.assemble import prepare

        init = tmp_path / "init.npz"
        if kind == "init.file as a FIFO":
            os.mkfifo(init)
            match = r"init.file .* is not a regular file \(a FIFO or a device\); expected an .npz file"
        else:
            np.savez(init, **hostile_npz)
            match = r"init.file: .*init.npz is damaged \(ValueError: Object arrays cannot be loaded"
        with pytest.raises(ConfigError, match=match):
            prepare(load_config(None, [f"init.file='{init}'"]))
    assert not marker.exists()
