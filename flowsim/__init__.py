"""flowsim: exact gradient flows of small Transformers on Markov chains."""

import os

import jax

jax.config.update("jax_enable_x64", True)  # small initialisations need float64 throughout


def _compilation_cache_dir() -> str | None:
    """FLOWSIM_COMPILATION_CACHE: a directory, or "off"; by default the user's cache directory."""
    chosen = os.environ.get("FLOWSIM_COMPILATION_CACHE")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "false") else chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flowsim", "xla")


_cache_dir = _compilation_cache_dir()
if _cache_dir is not None:
    # XLA executables kept on disk: a later process loads them instead of compiling the
    # stiff integrator again (benchmarks/MEASUREMENTS.md).
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from flowsim.chains import MarkovChain  # noqa: E402
from flowsim.losses import (  # noqa: E402
    context_count_law,
    loss_monte_carlo,
    make_loss_function,
    population_loss,
    population_loss_enumerated,
    population_loss_finite,
    population_loss_mean_field,
)
from flowsim.models import OneLayerTransformer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "MarkovChain",
    "OneLayerTransformer",
    "context_count_law",
    "loss_monte_carlo",
    "make_loss_function",
    "population_loss",
    "population_loss_enumerated",
    "population_loss_finite",
    "population_loss_mean_field",
]
