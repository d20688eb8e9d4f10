"""flowsim.interrupts: SIGINT and SIGTERM become a stop request; a second one interrupts at once."""

import os
import signal

import pytest

from flowsim.interrupts import stop_requests


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_sets_the_request_and_the_handlers_are_restored(number):
    before = signal.getsignal(number)
    with stop_requests() as stop:
        assert not stop()
        os.kill(os.getpid(), number)
        assert stop() and stop.signal_name == signal.Signals(number).name
    assert signal.getsignal(number) is before


def test_a_second_signal_raises_keyboard_interrupt():
    with pytest.raises(KeyboardInterrupt):
        with stop_requests() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop()
            os.kill(os.getpid(), signal.SIGINT)
