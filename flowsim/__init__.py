"""flowsim: exact gradient flows of small Transformers on Markov chains."""

import os

import jax

jax.config.update("jax_enable_x64", True)  # small initialisations need float64 throughout
if os.environ.get("FLOWSIM_COMPILATION_CACHE"):
    # XLA executables kept on disk: a later process loads them instead of compiling again.
    jax.config.update("jax_compilation_cache_dir", os.environ["FLOWSIM_COMPILATION_CACHE"])
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
