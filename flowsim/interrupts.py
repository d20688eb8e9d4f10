"""Stopping a long computation cleanly on SIGINT or SIGTERM.

``stop_requests()`` installs signal handlers for the duration of a ``with`` block and
yields a ``StopRequest``. Solvers poll it between chunks of work, each chunk bounded in
wall-clock time, and return what they have computed with status ``interrupted``. A
second signal raises ``KeyboardInterrupt`` at once, so a stuck process can still be
stopped.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """True once a stop was asked for; ``signal_name`` says by which signal."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def __call__(self) -> bool:
        return self.signal_name is not None

    def set(self, signal_name: str = "request") -> None:
        self.signal_name = signal_name


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Turn SIGINT and SIGTERM into a ``StopRequest`` inside the block (main thread only:
    elsewhere Python delivers no signals, and the request is only set by hand)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):
        if request():
            raise KeyboardInterrupt
        request.set(signal.Signals(signum).name)

    previous = {number: signal.signal(number, handler) for number in STOP_SIGNALS}
    try:
        yield request
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
