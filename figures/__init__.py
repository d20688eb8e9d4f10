"""The paper figures, one module per figure, rebuilt from run directories.

Each module has ``NAME`` and ``build(cache, out, tiny=False) -> FigureResult``: it reads
the run directories it needs from ``cache`` (running the simulations that are missing,
so a second call only redraws), draws the figure in the common style, writes
``NAME.png``, ``NAME.pdf`` and ``NAME.txt`` (its caption) in ``out``, and returns the
plotted data. ``tiny`` swaps in short runs (tests). ``flowsim figures`` builds them all
and records, in ``out/manifest.json``, each figure's caption, build time and the run
directories it read, with the library versions.
"""

from __future__ import annotations

import ast
import importlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from flowsim.common.io import read_json, write_atomic_json
from flowsim.common.progress import ticking

if TYPE_CHECKING:
    from figures.style import FigureResult

MANIFEST = "manifest.json"
HEARTBEAT_SECONDS = 10.0  # a line while a figure builds: its runs can take minutes

FIGURE_MODULES = (
    "fig01_loss_stages",
    "fig02_singular_values",
    "fig03_attention_snapshots",
    "fig04_attention_entropy",
    "fig05_embedding_trajectory",
    "fig06_embedding_norms",
    "fig07_transition_matrices",
    "fig08_symmetry_breaking",
    "fig09_predicted_vs_measured",
    "fig10_premature_specialisation",
    "fig11_pathwise_factors",
    "fig12_depth_smoothing",
    "fig13_text_attention",
    "fig14_sgd_against_the_flow",
    "fig15_phase_diagram",
    "fig16_gpt_study",
    "fig17_induction_task",
    "fig18_text_cycle",
)


class FigureInputError(RuntimeError):
    """A cached run directory that cannot be used."""


def figure_entry(module_name: str) -> tuple[str, str, str]:
    """(NAME, docstring, COST) of a figure module, read from its source without importing it (which would import
    matplotlib and JAX: seconds, where listing the figures should take none). O(the module's size)."""
    tree = ast.parse((Path(__file__).parent / f"{module_name}.py").read_text())
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant)}
    return constants["NAME"], ast.get_docstring(tree) or "", constants["COST"]


def figure_names() -> list[str]:
    return [figure_entry(module)[0] for module in FIGURE_MODULES]


def figure_list(out: Path) -> list[str]:
    """One line per figure: its name, what it shows (its module's first docstring sentence), what it computes and its
    expected cost (its module's COST), and the seconds its last build into ``out`` took (``out``/manifest.json)."""
    manifest_path = Path(out) / MANIFEST
    manifest = read_json(manifest_path) if manifest_path.is_file() else {}  # DamagedFileError names a damaged one
    built = manifest.get("figures", {}) if isinstance(manifest, dict) else {}
    lines = []
    for module_name in FIGURE_MODULES:
        name, docstring, cost = figure_entry(module_name)
        first_paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
        shows = first_paragraph.split(": ", 1)[-1].split(". ")[0].rstrip(".")
        last = f"{built[name]['seconds']:.1f} s on its last build in {out}" if name in built else f"not built in {out} yet"
        lines.append(f"{name}: {shows}. Computes {cost} ({last})")
    return lines


def build_figures(out: Path, cache: Path, only: Sequence[str] = (), tiny: bool = False,
                  report: Callable[[str], None] = print) -> list[FigureResult]:
    """Build every figure (or those named in ``only``), reporting each one's time. A figure
    whose inputs are unusable is reported and skipped; the others are still built, and a
    FigureInputError naming every skipped figure is raised at the end."""
    from flowsim.runs.rundir import library_versions

    modules = {importlib.import_module(f"figures.{m}").NAME: importlib.import_module(f"figures.{m}") for m in FIGURE_MODULES}
    unknown = sorted(set(only) - set(modules))
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; known: {sorted(modules)}")
    manifest_path = Path(out) / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"figures": {}}
    results, failed = [], []
    chosen = [name for name in modules if not only or name in only]
    for number, name in enumerate(chosen, 1):
        module = modules[name]
        report(f"{name}: building ({module.COST}); figure {number} of {len(chosen)}")
        started = time.perf_counter()
        try:
            with ticking(lambda seconds: report(f"{name}: building, {seconds:.0f} s so far"), every=HEARTBEAT_SECONDS):
                result = module.build(Path(cache), Path(out), tiny=tiny)
        except FigureInputError as error:
            report(f"{name}: not built: {error}")
            failed.append(f"{name}: {error}")
            continue
        seconds = time.perf_counter() - started
        report(f"{name}: {seconds:.1f} s  {result.caption}")
        results.append(result)
        runs = sorted({key.split(":")[0] for key in result.data})
        manifest["figures"][name] = {"caption": result.caption, "seconds": round(seconds, 2), "cache": str(cache), "runs": runs}
        manifest["versions"] = library_versions()
        write_atomic_json(manifest_path, manifest, indent=1)  # after each figure: nothing lost
    if failed:
        raise FigureInputError(f"{len(failed)} figure(s) not built: " + "; ".join(failed))
    return results
