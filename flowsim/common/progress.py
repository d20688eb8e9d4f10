"""Progress: a heartbeat for computations that block (JAX compiling the stiff integrator, a sweep's first batch, a
prediction step at a large vocabulary: without it a command can sit silent for tens of seconds), and bars that are
plain lines when stderr is not a terminal."""

from __future__ import annotations

import contextlib
import math
import sys
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


def stderr_is_terminal() -> bool:
    """Whether progress goes to a terminal (a redrawn bar) or to a file or pipe (plain lines)."""
    return sys.stderr is not None and sys.stderr.isatty()


class LineProgress:
    """tqdm's interface as plain lines for a log file: a line each time the share done passes another ``every``
    (5%: about 20 lines a run, against a thousand redraws of a bar), with the description, the count and the
    seconds so far."""

    def __init__(self, total: float, initial: float = 0.0, desc: str = "", unit: str = "", every: float = 0.05,
                 count: Callable[[float], str] | None = None):
        self.total, self.n, self.desc, self.unit, self.every = float(total), float(initial), desc, unit, every
        self.postfix, self.started = "", time.perf_counter()
        self.count = count or (lambda n: f"{n:.0f}/{self.total:.0f}{' ' + unit if unit else ''}")
        self._said = self._passed()
        if every <= 1:  # a first line: the log shows the work began (and where a resumed one starts)
            self._say()

    def _share(self) -> float:
        return self.n / self.total if self.total > 0 else 1.0

    def _passed(self) -> float:
        """How many multiples of ``every`` the share done has passed (1e-9: 0.25 / 0.05 is 4.999... in floats)."""
        return math.floor(self._share() / self.every + 1e-9)

    def _say(self) -> None:
        postfix = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {100 * self._share():3.0f}% ({self.count(self.n)}{postfix}) "
              f"{time.perf_counter() - self.started:.0f} s", file=sys.stderr, flush=True)

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._passed() > self._said:
            self._said = self._passed()
            self._say()

    def set_description_str(self, desc: str, refresh: bool = True) -> None:
        """A new description; one asked to show now (``refresh``: a heartbeat, as while JAX compiles) is a line."""
        self.desc = desc
        if refresh and self.every <= 1:
            print(desc, file=sys.stderr, flush=True)

    def set_postfix_str(self, postfix: str, refresh: bool = True) -> None:
        self.postfix = postfix

    def close(self) -> None:
        pass

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(*, total: float, initial: float = 0.0, desc: str = "", unit: str = "", disable: bool = False,
                 count: Callable[[float], str] | None = None, **tqdm_options):
    """A tqdm bar on a terminal, ``LineProgress`` (its lines showing ``count(n)``) when stderr is a file or a pipe;
    with ``disable``, one that says nothing."""
    if stderr_is_terminal():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit or "it", disable=disable, **tqdm_options)
    return LineProgress(total, initial, desc, unit, every=math.inf if disable else 0.05, count=count)
