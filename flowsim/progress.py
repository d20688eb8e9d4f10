"""A heartbeat for computations that block: JAX compiling the stiff integrator, a sweep's first batch, a prediction
step at a large vocabulary. Without it a command can sit silent for tens of seconds."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

TICK_SECONDS = 5.0


@contextlib.contextmanager
def ticking(say: Callable[[float], None], every: float | None = None) -> Iterator[None]:
    """Call ``say(seconds since the block began)`` every ``every`` seconds (TICK_SECONDS) from a daemon thread while the
    block runs; the last call has returned when the block is left."""
    started, done = time.perf_counter(), threading.Event()
    interval = TICK_SECONDS if every is None else every

    def tick() -> None:
        while not done.wait(interval):
            say(time.perf_counter() - started)

    thread = threading.Thread(target=tick, name="flowsim-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
