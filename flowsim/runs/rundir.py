"""Run directories: the resolved config, the trajectory and the metadata of one run.

    RUN_DIR/config.toml      the full resolved configuration
    RUN_DIR/trajectory.npz   t (ascending, t[0] = 0), loss, W0, W_Q, W_K, W1 (leading axis = time)
    RUN_DIR/meta.json        status, seed, solver statistics, wall time, library versions, the
                             process that wrote it (pid, host: a "running" run whose process is
                             gone was interrupted)
    RUN_DIR/solver_state.npz JaxRadau's or JaxBDF's loop state when the run was interrupted (`--resume`
                             continues from it with exactly the steps of an uninterrupted run)
    RUN_DIR/observables.npz  observables over time (and observables.csv), see flowsim.observe.observables
    RUN_DIR/summary.png      loss, singular values of W0, attention entropy per query

Every file is written atomically (temporary file, then rename), so an interrupted run
leaves the last complete version of each.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import importlib.metadata
import json
import os
import platform
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from flowsim.config import ConfigError
from flowsim.common.io import DamagedFileError, read_json, write_atomic_bytes, write_atomic_json
from flowsim.solve.status import Status
from flowsim.solve.trajectory import Trajectory

CONFIG_FILE, TRAJECTORY_FILE, META_FILE, SUMMARY_FIGURE = "config.toml", "trajectory.npz", "meta.json", "summary.png"
SOLVER_STATE_FILE = "solver_state.npz"
LOST_RUN = "the run directory cannot be trusted: run the flow again into a new folder"


def library_versions() -> dict[str, str]:
    """Versions of python and of the numerical libraries a result depends on."""
    versions = {"python": platform.python_version()}
    for package in ("flowsim", "jax", "jaxlib", "diffrax", "equinox", "scipy", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc; None elsewhere or when it is gone):
    with the pid it tells a process from a later one that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return None


def this_process() -> dict:
    """The pid, its start time and the host that meta.json records, so a reader can tell a live run from a dead one."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "process_start": process_start(os.getpid())}


def _process_is_alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` runs on this host, and is the process that started at ``started`` (when recorded)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started is None or process_start(pid) in (None, started)


def status_of(meta: dict) -> str:
    """The run's status name; a "running" run whose process (on this host) is gone is "interrupted"."""
    status = meta.get("status_name", "unknown")
    if status == Status.RUNNING.label and meta.get("host") == socket.gethostname() and isinstance(meta.get("pid"), int) \
            and not _process_is_alive(meta["pid"], meta.get("process_start")):
        return Status.INTERRUPTED.label
    return status


LOCK_FILE = ".flowsim.lock"


class FolderInUseError(ConfigError):
    """Another live process writes the folder (``folder_lock``)."""


def _holder(recorded: bytes) -> str:
    """The lock file's record of its holder, as a reader sees it."""
    try:
        who = json.loads(recorded.decode(errors="replace"))
        return f"pid {who.get('pid')} on {who.get('host')}, since {who.get('since')}"
    except (ValueError, AttributeError):
        return "another process"


def check_not_in_use(folder: Path, what: str = "run directory") -> None:
    """FolderInUseError, naming the holder, where another process holds ``folder``'s lock (``folder_lock``); the
    check takes a shared lock for a moment, so it creates nothing and waits for nothing."""
    path = Path(folder) / LOCK_FILE
    if not path.exists() and not path.is_symlink():
        return
    handle = _open_lock_file(path, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        raise FolderInUseError(f"the {what} {str(folder)!r} is in use by another flowsim process "
                               f"({_holder(os.read(handle, 4096))}); wait for it to finish") from None
    finally:
        os.close(handle)


def _open_lock_file(path: Path, flags: int) -> int:
    """A descriptor of the lock file ``path``, opened without following a symbolic link (a link placed in a shared
    folder would have the lock truncate the file it points to) and without waiting (a FIFO would block the open);
    ConfigError, naming it, where it is a link or anything but a regular file."""
    remedy = "remove it (flowsim makes its own lock file) and run the command again"
    try:
        handle = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symbolic link, expected flowsim's lock file: {remedy}") from None
        if error.errno != errno.EISDIR:
            raise
        handle = None
    if handle is None or not stat.S_ISREG(os.fstat(handle).st_mode):
        if handle is not None:
            os.close(handle)
        raise ConfigError(f"{path} is not a regular file, expected flowsim's lock file: {remedy}")
    return handle


@contextlib.contextmanager
def folder_lock(folder: Path, what: str = "run directory", wait: bool = False):
    """Hold an exclusive lock on ``folder`` (an flock on FOLDER/.flowsim.lock, which records the holder's pid,
    start time and host) while the block runs; FolderInUseError, naming the holder, if another process holds it
    (or, with ``wait``, wait for it: for short work such as a fetch's). The kernel releases the lock when its process
    dies, so a crashed writer never leaves a stale lock."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    handle = _open_lock_file(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        by = _holder(os.read(handle, 4096))
        os.close(handle)
        raise FolderInUseError(f"the {what} {str(folder)!r} is in use by another flowsim process ({by}); "
                               "wait for it to finish, or choose another folder") from None
    try:
        os.ftruncate(handle, 0)
        stamp = _dt.datetime.now().isoformat(timespec="seconds")
        os.pwrite(handle, json.dumps({**this_process(), "since": stamp}).encode(), 0)
        yield
    finally:
        os.close(handle)  # closing the descriptor releases the lock


def discard_unused_folder(folder: Path) -> None:
    """Remove ``folder`` where it holds nothing but its lock file: one a command made and then refused to use."""
    folder = Path(folder)
    if folder.is_dir() and {path.name for path in folder.iterdir()} <= {LOCK_FILE}:
        (folder / LOCK_FILE).unlink(missing_ok=True)
        folder.rmdir()


META_TEXT_FIELDS = ("status_name", "message", "started", "finished")


def read_meta(run_dir: Path) -> dict:
    """meta.json of a run directory ({} when it has none); a damaged one (not JSON, not an object, a text field
    that is not text) raises DamagedFileError."""
    path = Path(run_dir) / META_FILE
    if not path.is_file():
        return {}
    meta = read_json(path, LOST_RUN)
    if not isinstance(meta, dict):
        raise DamagedFileError(path, f"a JSON {type(meta).__name__}, not an object", LOST_RUN)
    for key in META_TEXT_FIELDS:
        if key in meta and not isinstance(meta[key], str):
            raise DamagedFileError(path, f"its {key} is {meta[key]!r}, expected text", LOST_RUN)
    if "status_name" not in meta:  # every meta.json flowsim writes says how the run stands
        raise DamagedFileError(path, "it has no status_name: whether the run finished is unknown", LOST_RUN)
    return meta


NAME_MAX, PATH_MAX = 255, 4096  # bytes, as Linux's file systems hold them


def check_path_length(path: Path, flag: str) -> None:
    """ValueError where a part of ``path`` or the whole of it is longer than a file system holds."""
    too_long = next((part for part in Path(path).parts if len(part.encode()) > NAME_MAX), None)
    if too_long is not None:
        raise ValueError(f"{flag}: the name {too_long[:40]!r}... is {len(too_long.encode())} bytes long; a file or folder "
                         f"name holds at most {NAME_MAX}")
    if len(str(Path(path).absolute()).encode()) >= PATH_MAX:
        raise ValueError(f"{flag}: the path is {len(str(Path(path).absolute()).encode())} bytes long; a path holds at "
                         f"most {PATH_MAX - 1}")


def check_output_dir(out: Path, flag: str = "--out") -> None:
    """An output folder must be a folder or not exist yet, and a name the file system can hold (ValueError naming
    it otherwise)."""
    out = Path(out)
    check_path_length(out, flag)
    if out.is_symlink() and not out.exists():
        raise ValueError(f"{flag} {str(out)!r} is a symbolic link to nothing (a missing target, or a loop of links); "
                         "remove it or choose another folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {str(out)!r} is a file, not a folder; choose a folder")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{flag} {str(out)!r}: {str(parent)!r} is a file, not a folder")


def new_run_dir(root: Path, name: str) -> Path:
    """A fresh folder root/NAME-YYYYmmdd-HHMMSS (suffixed if it exists); ValueError if root is a file."""
    check_output_dir(root, "the runs folder")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate = root / f"{name}-{stamp}"
    suffix = 1
    while candidate.exists():
        candidate = root / f"{name}-{stamp}-{suffix}"
        suffix += 1
    candidate.mkdir(parents=True)
    return candidate


def write_config(run_dir: Path, toml_text: str) -> None:
    write_atomic_bytes(run_dir / CONFIG_FILE, toml_text.encode())


def write_meta(run_dir: Path, meta: dict) -> None:
    write_atomic_json(run_dir / META_FILE, meta)


@dataclass(frozen=True)
class Run:
    """A loaded run directory."""

    path: Path
    config: dict
    trajectory: Trajectory
    meta: dict

    @property
    def status_name(self) -> str:
        return status_of(self.meta)


def load_run(run_dir: Path | str) -> Run:
    """Read config.toml, trajectory.npz and meta.json of a run directory."""
    run_dir = Path(run_dir)
    missing = [name for name in (CONFIG_FILE, TRAJECTORY_FILE, META_FILE) if not (run_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a complete run directory: missing {', '.join(missing)}")
    try:
        config = tomllib.loads((run_dir / CONFIG_FILE).read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise DamagedFileError(run_dir / CONFIG_FILE, f"not valid TOML: {error}", LOST_RUN) from None
    except RecursionError:
        raise DamagedFileError(run_dir / CONFIG_FILE, "nested too deep to be a config flowsim wrote", LOST_RUN) from None
    meta = read_meta(run_dir)
    return Run(path=run_dir, config=config, trajectory=Trajectory.load(run_dir / TRAJECTORY_FILE), meta=meta)
