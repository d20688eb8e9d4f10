"""flowsim: exact gradient flows of small Transformers on Markov chains.

Importing the package does not import JAX (the ``flowsim`` command can then say one line when
Ctrl-C comes during its start-up): it sets JAX's options, float64 and the compilation cache, for
when JAX is imported, or on JAX directly where it already is. The public names below are loaded on
first use, and the modules that moved into the layer subpackages still import by their old names
(``flowsim.solvers`` is ``flowsim.solve.solvers``).
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys

from flowsim.common import caches


def _jax_options() -> dict[str, object]:
    """Small initialisations need float64 throughout; XLA executables kept on disk let a later process load
    the stiff integrator instead of compiling it again (benchmarks/MEASUREMENTS.md)."""
    options: dict[str, object] = {"jax_enable_x64": True}
    cache_dir = caches.cache_dir("FLOWSIM_COMPILATION_CACHE", "xla")
    if cache_dir is not None:
        options.update(jax_compilation_cache_dir=cache_dir, jax_persistent_cache_min_compile_time_secs=0.5)
    return options


def _configure_jax() -> None:
    """JAX reads JAX_<OPTION> from the environment when it is imported; once imported, it takes them directly.
    With the cache off, a cache directory inherited from a flowsim parent process is dropped too."""
    jax = sys.modules.get("jax")
    options = _jax_options()
    if "jax_compilation_cache_dir" not in options:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    for name, value in options.items():
        if jax is not None:
            jax.config.update(name, value)
        else:
            os.environ[name.upper()] = str(value)


_configure_jax()

_PUBLIC = {
    "MarkovChain": "flowsim.model.chains",
    "OneLayerTransformer": "flowsim.model.models",
    **{name: "flowsim.model.losses" for name in ("context_count_law", "loss_monte_carlo", "make_loss_function",
                                           "population_loss", "population_loss_enumerated", "population_loss_finite",
                                           "population_loss_mean_field")},
}

__version__ = "0.1.0"

__all__ = sorted(_PUBLIC)


# modules that moved into the layer subpackages, by their old names (docs/model.md, "The packages")
MOVED = {f"flowsim.{name}": f"flowsim.{package}.{name}" for package, names in {
    "common": ("io", "caches", "interrupts", "progress", "budget"),
    "model": ("chains", "tasks", "models", "losses", "flow"),
    "solve": ("status", "integration", "bdf", "stiff", "rkc", "compiled_methods", "reference_methods", "solvers",
              "trajectory"),
    "observe": ("observables", "stages", "specialisation", "families"),
    "runs": ("experiment", "labelling", "rundir", "predictions", "runs_compared", "plots", "sweep", "sweep_backends"),
}.items() for name in names}


class _MovedModuleLoader(importlib.abc.Loader):
    """Imports a module by its old name: the new module itself is put in its place (one object, two names)."""

    def __init__(self, target: str):
        self.target = target

    def exec_module(self, module) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(MOVED[fullname]))


sys.meta_path.insert(0, _MovedModuleFinder())  # before any finder that could still see an old file


def __dir__() -> list[str]:
    """The module's names with the public ones loaded on first use (``_PUBLIC``), as completion and ``dir`` show them."""
    return sorted({*globals(), *_PUBLIC})


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'flowsim' has no attribute {name!r}")
