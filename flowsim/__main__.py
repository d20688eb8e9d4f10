"""``flowsim`` and ``python -m flowsim``: the command line, with a Ctrl-C during its start-up said in one line."""

import signal
import sys

from flowsim.interrupts import INTERRUPTED_STARTING, interrupt_outside_gc_callbacks


def main() -> None:
    try:
        signal.signal(signal.SIGINT, interrupt_outside_gc_callbacks)
        from flowsim.cli import main as run_command
    except KeyboardInterrupt:
        sys.stderr.write(INTERRUPTED_STARTING + "\n")
        sys.exit(130)
    run_command()


if __name__ == "__main__":
    main()
