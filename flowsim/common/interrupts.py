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
import sys
import threading
import time
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPTED_STARTING = "flowsim: interrupted while the command was starting"  # before any command could say what it kept
REDELIVERY_SECONDS = 0.05
IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
# An interrupt raised inside Thread.start (while it waits for the new thread to run) leaves a running thread its
# caller never learns of: JAX's backend set-up starts a 60 s watchdog timer so, which then holds up the exit.
THREAD_START = threading.Thread.start.__code__
# JAX's backend set-up starts that timer and cancels it in a `finally` one statement later: an interrupt between the
# two leaves it running as well, so the whole set-up defers interrupts (it takes about a second).
JAX_BACKEND_SETUP = os.path.join("jax", "_src", "xla_bridge.py")
# set (to anything): a line on stderr at each point from which SIGINT and SIGTERM are handled, for a test or a supervisor
# to signal a process at a known stage instead of after a guessed sleep
READY_VARIABLE = "FLOWSIM_SIGNAL_READY"
raised_interrupt: str | None = None  # the signal interrupt_when_safe last raised as KeyboardInterrupt, until stop_requests sees it


def interrupt_when_safe(signum: int, frame) -> None:
    """SIGINT as KeyboardInterrupt, except where raising it would be lost or fatal, where it is sent again
    REDELIVERY_SECONDS later (``deliver_later``): inside a garbage-collector callback (JAX registers one, and runs it
    often while it starts), where Python drops the exception; inside an import, where an exception raised while
    a native extension initialises (jaxlib's, loaded when a command first needs JAX) can crash the interpreter; and
    inside ``Thread.start`` or JAX's backend set-up, which would leave a started thread running unseen (that set-up
    starts a timer, and the process then waits 60 s for it at exit and warns of a slow TPU). What
    it raises is remembered in ``raised_interrupt``: a library's bare ``except:`` may swallow it, and the next
    ``stop_requests`` block then starts with its request set."""
    global raised_interrupt
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        code = frame.f_code
        if (code in callbacks or code is THREAD_START or code.co_filename in IMPORT_MACHINERY
                or code.co_filename.endswith(JAX_BACKEND_SETUP)):
            deliver_later(signum)
            return
        frame = frame.f_back
    raised_interrupt = signal.Signals(signum).name
    raise KeyboardInterrupt


def deliver_later(signum: int) -> None:
    """Send ``signum`` to this process again after REDELIVERY_SECONDS, from a SIGALRM timer, so that whichever handler
    is in place then takes it (``stop_requests``' once a run has begun): no thread, since starting one inside a
    signal handler can deadlock on threading's own locks or hold up the interpreter's exit."""
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signum))
    signal.setitimer(signal.ITIMER_REAL, REDELIVERY_SECONDS)


def cancel_redelivery() -> None:
    """Cancel a signal ``deliver_later`` has yet to send: on the way out the interpreter restores SIGALRM's default
    action, so a timer still pending then would kill the process by SIGALRM (exit -14, "Alarm clock") instead of
    letting it leave with its own status. (A command that ends within REDELIVERY_SECONDS of an interrupt deferred
    inside its imports does so.)"""
    signal.setitimer(signal.ITIMER_REAL, 0)


def redeliver_dropped_interrupts(unraisable) -> None:
    """``sys.unraisablehook``: a KeyboardInterrupt raised where Python can only drop it (a callback from native code,
    which prints "Exception ignored in ...") is sent again by ``deliver_later`` instead of printed; anything else is
    reported as Python would."""
    global raised_interrupt
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        raised_interrupt = None  # it comes again, so no stop_requests block should start stopped for it
        deliver_later(signal.SIGINT)
        return
    sys.__unraisablehook__(unraisable)


def say_signals_ready(stage: str) -> None:
    """Where ``$FLOWSIM_SIGNAL_READY`` is set: 'flowsim: signals handled: STAGE' on stderr, unbuffered (os.write, as a
    signal handler may be running Python's own writers)."""
    if os.environ.get(READY_VARIABLE):
        os.write(2, f"flowsim: signals handled: {stage}\n".encode())


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
    global raised_interrupt
    request = StopRequest()
    if raised_interrupt is not None:  # a library's bare `except:` swallowed it (JAX has some): it still stops the work
        request.set(raised_interrupt)
        raised_interrupt = None
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):
        if request():
            raise KeyboardInterrupt
        request.set(signal.Signals(signum).name)

    previous = {number: signal.signal(number, handler) for number in STOP_SIGNALS}
    say_signals_ready("stop requests")
    try:
        yield request
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM alike raise ``KeyboardInterrupt`` (where it is safe,
    ``interrupt_when_safe``): for work made of short steps that keeps nothing half-done (its files are written
    atomically), which the caller catches to say what was kept. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global raised_interrupt
    previous = {number: signal.signal(number, interrupt_when_safe) for number in STOP_SIGNALS}
    try:
        yield
    except KeyboardInterrupt:
        raised_interrupt = None  # it reached the caller, which handles it: no later stop_requests block inherits it
        raise
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
