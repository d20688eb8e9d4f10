"""Benchmarks write their tables into one markdown file, each into a section of its own."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def write_section(path: Path, marker: str, text: str) -> None:
    """Replace the part of ``path`` between <!-- marker --> and <!-- /marker --> (appended if absent)."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    old = path.read_text() if path.is_file() else ""
    block = f"{start}\n{text}\n{end}"
    if start in old and end in old:
        new = old[: old.index(start)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + ("\n\n" if old else "") + block + "\n"
    path.write_text(new)


def published(command: str, started: float, lines: list[str], out: Path | None, marker: str) -> str:
    """A benchmark's table under its command line and wall time (``started``: its ``time.perf_counter()`` at the start),
    printed, and written into section ``marker`` of ``out`` when given."""
    text = "\n".join([f"`{command}` ({time.perf_counter() - started:.0f} s on a 2-core CPU)", "", *lines])
    print(text)
    if out is not None:
        write_section(out, marker, text)
    return text


def spread(values: list) -> str:
    """'mean ± sample standard deviation' of the values that are not None, with '(k/n)' when only
    k of the n are ('never' if none are)."""
    kept = [v for v in values if v is not None]
    if not kept:
        return "never"
    text = f"{np.mean(kept):.4g} ± {np.std(kept, ddof=1) if len(kept) > 1 else 0.0:.2g}"
    return text if len(kept) == len(values) else f"{text} ({len(kept)}/{len(values)})"

