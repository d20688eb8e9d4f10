"""Where flowsim keeps what it can compute again: one rule for every cache (compiled XLA code, predictions).

``FLOWSIM_<NAME>_CACHE`` names a directory, or turns the cache off ("off", "0", "false" or empty); unset, the cache
is ``$XDG_CACHE_HOME/flowsim/<subdir>`` (``~/.cache`` without XDG_CACHE_HOME). Only ``os`` is imported: the package's
own start-up reads it before JAX is loaded."""

from __future__ import annotations

import os

OFF = ("", "off", "0", "false")


def cache_dir(variable: str, subdir: str) -> str | None:
    """The directory of the cache that ``variable`` controls, or None where it is off."""
    chosen = os.environ.get(variable)
    if chosen is not None:
        return None if chosen.strip().lower() in OFF else chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flowsim", subdir)
