"""flowsim: exact gradient flows of small Transformers on Markov chains.

Importing the package does not import JAX (the ``flowsim`` command can then say one line when
Ctrl-C comes during its start-up): it sets JAX's options, float64 and the compilation cache, for
when JAX is imported, or on JAX directly where it already is. The public names below are loaded on
first use.
"""

import importlib
import os
import sys

from flowsim import caches


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
    "MarkovChain": "flowsim.chains",
    "OneLayerTransformer": "flowsim.models",
    **{name: "flowsim.losses" for name in ("context_count_law", "loss_monte_carlo", "make_loss_function",
                                           "population_loss", "population_loss_enumerated", "population_loss_finite",
                                           "population_loss_mean_field")},
}

__version__ = "0.1.0"

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'flowsim' has no attribute {name!r}")
