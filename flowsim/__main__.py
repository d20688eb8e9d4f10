"""``flowsim`` and ``python -m flowsim``: the command line, with a Ctrl-C or SIGTERM during its start-up said in one line
(both are an interrupt throughout: exit 130, saying what was kept)."""

import os
import signal
import sys

from flowsim.common.interrupts import (INTERRUPTED_STARTING, cancel_redelivery, interrupt_when_safe, redeliver_dropped_interrupts,
                                       say_signals_ready)


def _interrupted_while_loading(signum: int, frame) -> None:
    """Ctrl-C or SIGTERM while the command line's modules load: nothing is written yet, so say so and leave at once. A
    KeyboardInterrupt raised inside a native extension's initialisation can crash the interpreter on its way out."""
    os.write(2, (INTERRUPTED_STARTING + "\n").encode())
    os._exit(130)


def main() -> None:
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _interrupted_while_loading)
    say_signals_ready("start-up")
    from flowsim.cli import main as run_command

    for number in (signal.SIGINT, signal.SIGTERM):  # from here each command says what it kept, whichever signal came
        signal.signal(number, interrupt_when_safe)
    sys.unraisablehook = redeliver_dropped_interrupts
    try:
        run_command()
    finally:
        cancel_redelivery()  # the command leaves with its own status, not killed by a redelivery timer still pending


if __name__ == "__main__":
    main()
