"""Why an integration stopped: one enumeration for every solver path, each status with its message.

The compiled JaxRadau loop stores these integers per batch member; the scipy, diffrax
and gradient-descent drivers return them; ``FlowResult.status`` is one of them and
``meta.json`` records its value and name.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """``Status.X.message(t=..., max_steps=...)`` is the one-line explanation of a result."""

    FINISHED = 0
    STEP_LIMIT = 1
    NON_FINITE = 2
    RUNNING = 3
    DIVERGED = 4
    INTERRUPTED = 5
    SOLVER_FAILED = -1

    def message(self, where: str = "", *, max_steps: int | None = None, method: str = "the solver", reason: str = "") -> str:
        """The status in words. ``where`` says where the integration stopped (``at_time(t)``, or
        "between t = a and t = b"); ``reason`` is the failing solver's own explanation."""
        where = f" {where}" if where else ""
        return {
            Status.FINISHED: "reached the last save time",
            Status.STEP_LIMIT: f"step limit max_steps = {max_steps} reached{where}",
            Status.NON_FINITE: f"the state became non-finite{where}",
            Status.RUNNING: "running",
            Status.DIVERGED: f"the iteration blew up{where}" + (f": {reason}" if reason else ""),
            Status.INTERRUPTED: f"stopped on request{where}",
            Status.SOLVER_FAILED: f"{method} failed{where}" + (f": {reason}" if reason else ""),
        }[self]

    @property
    def partial(self) -> bool:
        """A run that stopped early on a sound state: its saved points are valid as far as they go."""
        return self in (Status.STEP_LIMIT, Status.INTERRUPTED, Status.RUNNING)

    @property
    def broken(self) -> bool:
        """A run whose state left the flow (non-finite or diverged): not labelled as a flow."""
        return self in (Status.NON_FINITE, Status.DIVERGED)

    @property
    def label(self) -> str:
        """The name written to run directories and tables: ``finished``, ``step_limit``, ..."""
        return self.name.lower()


def at_time(t: float) -> str:
    """"at t = ..." for ``Status.message``."""
    return f"at t = {t:.6g}"
