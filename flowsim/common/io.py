"""Atomic file writing: a reader never sees a half-written file, and an interrupted write
leaves the previous complete version in place.

Every file flowsim writes goes through ``write_atomic_bytes`` (temporary file in the same
folder, fsync, rename over the target). Every .npz and .json file it reads goes through
``read_npz`` / ``read_json``, which turn a damaged file into one ``DamagedFileError`` that
names the file and what to do.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
import tempfile
import zipfile
from pathlib import Path

import numpy as np


def _process_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# the mode open() gives a new file (0644 under the usual umask 022); mkstemp's own is 0600
NEW_FILE_MODE = 0o666 & ~_process_umask()


def write_atomic_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``; the file gets the mode a plain
    ``open`` would give it (``NEW_FILE_MODE``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, NEW_FILE_MODE)
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_atomic_text(path: Path, text: str) -> None:
    write_atomic_bytes(path, text.encode())


REMEDY = "delete it and run the command that writes it again"


class DamagedFileError(ValueError):
    """A file flowsim wrote earlier cannot be read back (truncated, empty, or not what it should be)."""

    def __init__(self, path: Path, reason: str, remedy: str):
        super().__init__(f"{path} is damaged ({reason}): {remedy}")
        self.path, self.reason = Path(path), reason


def _strict(value):
    """NaN and infinities as JSON null (strict JSON has no NaN); numpy scalars and arrays as Python values."""
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    if isinstance(value, np.ndarray):
        return _strict(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_atomic_json(path: Path, payload, indent: int = 2) -> None:
    """Strict JSON with a final newline: NaN and infinities become null, numpy values plain numbers."""
    write_atomic_text(path, json.dumps(_strict(payload), indent=indent, allow_nan=False) + "\n")


def check_regular(path: Path, remedy: str = REMEDY) -> None:
    """DamagedFileError where ``path`` (a link followed) exists but is not a regular file: a FIFO would block the
    read for ever and a device (/dev/zero) never end it; FileNotFoundError where it does not exist."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise DamagedFileError(path, "not a regular file (a FIFO, a device or a folder)", remedy)


def read_json(path: Path, remedy: str = REMEDY):
    """The JSON value in ``path`` (data only: JSON names no code); a damaged file, one nested past Python's recursion
    limit, or one that is not a regular file raises ``DamagedFileError``."""
    path = Path(path)
    check_regular(path, remedy)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DamagedFileError(path, f"not valid JSON: {error}", remedy) from None
    except RecursionError:
        raise DamagedFileError(path, "nested too deep to be a file flowsim wrote", remedy) from None


def read_npz(path: Path, required: tuple[str, ...] = (), remedy: str = REMEDY) -> dict[str, np.ndarray]:
    """Every array of an .npz file, read in full (so truncation shows here, not later) and never unpickled
    (``allow_pickle=False``: an object array is refused, not built); a damaged file, one that is not a regular file, or
    one without the ``required`` arrays raises ``DamagedFileError`` (its message ends with ``remedy``)."""
    path = Path(path)
    check_regular(path, remedy)
    if path.stat().st_size == 0:
        raise DamagedFileError(path, "empty file", remedy)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, zipfile.LargeZipFile) as error:
        raise DamagedFileError(path, f"{type(error).__name__}: {error}", remedy) from None
    missing = [name for name in required if name not in arrays]
    if missing:
        raise DamagedFileError(path, f"missing arrays {missing}", remedy)
    return arrays


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (ties a cache to the file it was computed from)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic_bytes(path, buffer.getvalue())
