"""flowsim.interrupts: SIGINT and SIGTERM become a stop request; a second one interrupts at once."""

import os
import signal

import pytest

from flowsim.interrupts import run_in_chunks, stop_requests


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


def test_the_loop_runs_chunks_until_done_or_stopped_and_checkpoints_on_its_schedule():
    """Every chunk but the last is followed by a stop poll and (schedule 0 s) a checkpoint; a request already set
    still lets one chunk run; a long schedule checkpoints nothing."""
    def counting(chunks: int):
        done = []
        return done, lambda: done.append(1) or len(done) < chunks

    done, advance = counting(5)
    saved = []
    assert run_in_chunks(advance, lambda: False, lambda: saved.append(len(done)), 0.0) is False
    assert len(done) == 5 and saved == [1, 2, 3, 4]
    done, advance = counting(5)
    assert run_in_chunks(advance, lambda: len(done) >= 2, None, 0.0) is True and len(done) == 2
    done, advance = counting(5)
    assert run_in_chunks(advance, lambda: True, None, 0.0) is True and len(done) == 1
    done, advance = counting(3)
    saved = []
    assert run_in_chunks(advance, None, lambda: saved.append(1), 3600.0) is False and len(done) == 3 and not saved
