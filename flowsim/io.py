"""Atomic file writing: a reader never sees a half-written file, and an interrupted write
leaves the previous complete version in place.

Every file flowsim writes goes through ``write_atomic_bytes`` (temporary file in the same
folder, fsync, rename over the target).
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np


def write_atomic_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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


def write_atomic_json(path: Path, payload, indent: int = 2) -> None:
    """JSON with a final newline (numpy scalars written as floats)."""
    write_atomic_text(path, json.dumps(payload, indent=indent, default=float) + "\n")


def write_atomic_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic_bytes(path, buffer.getvalue())
