"""Stopping a long computation cleanly on SIGINT or SIGTERM, and the loop that polls for it.

``stop_requests()`` installs signal handlers for the duration of a ``with`` block and
yields a ``StopRequest``. ``run_in_chunks`` is the loop every long computation runs in (the
solvers' ``drive`` and the bridge's SGD): it polls the request between chunks of work, each
chunk bounded in wall-clock time, and checkpoints on a wall-clock schedule; the caller then
returns what it has computed with status ``interrupted``. A second signal raises
``KeyboardInterrupt`` at once, so a stuck process can still be stopped.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPTED_STARTING = "flowsim: interrupted while the command was starting"  # before any command could say what it kept
REDELIVERY_SECONDS = 0.05


def interrupt_outside_gc_callbacks(signum: int, frame) -> None:
    """SIGINT as KeyboardInterrupt, except inside a garbage-collector callback (JAX registers one, and runs it often
    while it starts): Python drops an exception raised there, so the signal is sent again REDELIVERY_SECONDS later."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks:
            threading.Timer(REDELIVERY_SECONDS, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


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


def run_in_chunks(advance: Callable[[], bool], should_stop: Callable[[], bool] | None,
                  checkpoint: Callable[[], None] | None, checkpoint_every_s: float) -> bool:
    """Call ``advance()`` (one chunk of work; it says whether work is left) until it is done or ``should_stop()``
    says so, asked after each chunk: at least one chunk runs, so a resumed run always moves on. ``checkpoint()``
    saves what there is every ``checkpoint_every_s`` seconds. Returns whether it stopped on request."""
    last_checkpoint = time.perf_counter()
    while advance():
        if should_stop is not None and should_stop():
            return True
        if checkpoint is not None and time.perf_counter() - last_checkpoint >= checkpoint_every_s:
            checkpoint()
            last_checkpoint = time.perf_counter()
    return False
