"""Memory budgets: a computation whose size is known in advance is estimated and refused
before anything is allocated, with one line that gives the estimate, the budget and how
to raise it.

The budget is ``FLOWSIM_MEMORY_BUDGET_GB`` gigabytes when set, else half of this
machine's physical memory.
"""

from __future__ import annotations

import math
import os

BUDGET_VARIABLE = "FLOWSIM_MEMORY_BUDGET_GB"
GB = 1e9


class BudgetError(ValueError):
    """A computation estimated to need more memory than the budget allows."""


def physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system: assume a small machine
        return 8 * GB


def memory_budget_bytes() -> tuple[float, str]:
    """The budget in bytes and where it comes from (for the message)."""
    text = os.environ.get(BUDGET_VARIABLE)
    if text is not None:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise BudgetError(f"{BUDGET_VARIABLE} = {text!r}: expected a positive number of gigabytes")
        return value * GB, f"{BUDGET_VARIABLE} = {text}"
    return 0.5 * physical_memory_bytes(), f"half this machine's memory; set {BUDGET_VARIABLE} to change it"


def format_bytes(size: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size / 1e3:.3g} kB"


def check_memory(estimate_bytes: float, what: str, remedy: str) -> None:
    """Raise ``BudgetError`` when ``what`` (a phrase naming the computation and its size) is
    estimated to need more than the budget; ``remedy`` says how to make it smaller."""
    budget, source = memory_budget_bytes()
    if estimate_bytes > budget:
        raise BudgetError(f"{what} needs about {format_bytes(estimate_bytes)}, over the memory budget of "
                          f"{format_bytes(budget)} ({source}): {remedy}")
