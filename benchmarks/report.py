"""Benchmarks write their tables into one markdown file, each into a section of its own."""

from __future__ import annotations

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


def spread(values: list) -> str:
    """'mean ± sample standard deviation' of the values that are not None ('never' if none are)."""
    values = [v for v in values if v is not None]
    if not values:
        return "never"
    return f"{np.mean(values):.4g} ± {np.std(values, ddof=1) if len(values) > 1 else 0.0:.2g}"

