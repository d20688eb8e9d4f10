"""The packages' imports run one way (docs/model.md, "The packages"): each layer is imported in a fresh interpreter
and must not load a layer above it, and no file of it names one, not even inside a function."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
APPLICATION = ("flowsim.runs", "flowsim.bridge", "flowsim.cli", "figures", "matplotlib")
ABOVE_SOLVE = ("flowsim.observe", "flowsim.assemble", "theory", *APPLICATION)
FORBIDDEN = {
    "flowsim.common": ("flowsim.config", "flowsim.methods", "flowsim.model", "flowsim.solve", *ABOVE_SOLVE),
    "flowsim.model": ("flowsim.solve", *ABOVE_SOLVE),
    "flowsim.solve": ABOVE_SOLVE,
    "flowsim.observe": ABOVE_SOLVE[1:],
    "theory": APPLICATION,  # the theory assembles its runs (flowsim.assemble) but reads and writes none
    "flowsim.runs": ("flowsim.bridge", "flowsim.cli", "figures"),
}


def package_files(package: str) -> list[Path]:
    return sorted((REPOSITORY / package.replace(".", "/")).glob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPOSITORY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def offends(name: str, forbidden: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
@pytest.mark.slow
def test_a_layer_loads_nothing_above_it(package):
    modules = [module_name(path) for path in package_files(package)]
    script = ("import importlib, json, sys\n"
              f"for name in {modules!r}:\n    importlib.import_module(name)\n"
              "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPOSITORY, check=True)
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert not [name for name in loaded if offends(name, FORBIDDEN[package])], package


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_file_of_a_layer_names_a_layer_above_it(package):
    found = []
    for path in package_files(package):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if isinstance(node, ast.ImportFrom) and node.module == "flowsim":  # from flowsim import solve, ...
                names = [f"flowsim.{alias.name}" for alias in node.names]
            found += [f"{path.name}:{node.lineno} {name}" for name in names if offends(name, FORBIDDEN[package])]
    assert not found, found


def test_old_module_names_import_the_moved_modules():
    """flowsim.solvers, flowsim.stages, ... (the paths before the layer subpackages) are the new modules themselves."""
    import importlib

    import flowsim

    for old, new in flowsim.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from flowsim.solvers import solve_flow
    from flowsim.solve.solvers import solve_flow as moved

    assert solve_flow is moved
