"""Benchmarks write their tables into one markdown file, each into a section of its own."""

from __future__ import annotations

from pathlib import Path


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
