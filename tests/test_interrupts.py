"""flowsim.common.interrupts: SIGINT and SIGTERM become a stop request; a second one interrupts at once."""

import os
import signal

import pytest

from flowsim.common import interrupts
from flowsim.common.interrupts import run_in_chunks, stop_requests


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


def foreground_flowsim(arguments: list[str], **options):
    """`python -m flowsim ARGUMENTS` with SIGINT's default handler restored, as a shell's foreground job gets it (a test
    runner may ignore SIGINT, and its children would inherit that); stdout and stderr piped, unbuffered, and
    $FLOWSIM_SIGNAL_READY set, so that it says on stderr from where it handles signals."""
    import os
    import subprocess
    import sys

    script = (f"import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              f"sys.argv = {['flowsim', *arguments]!r}; runpy.run_module('flowsim', run_name='__main__')")
    environment = {**options.pop("env", os.environ), "PYTHONUNBUFFERED": "1", interrupts.READY_VARIABLE: "1"}
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=environment, **options)


def read_until(process, marker: bytes) -> bytes:
    """The process's stderr up to and including ``marker`` (it must come before the process ends)."""
    import os

    said = b""
    while marker not in said:
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, f"it ended before saying {marker!r}: {said.decode(errors='replace')}"
        said += chunk
    return said


@pytest.mark.parametrize("stage, after", [("start-up", 0.0), ("start-up", 0.3), ("start-up", 1.0), ("stop requests", 0.0)])
def test_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(tmp_path, stage, after):
    """SIGINT during `flowsim run`'s imports and set-up (JAX's garbage-collector callback would drop it, and typer
    would exit 130 silently): one line saying so, or the run's own, exit 130, no traceback, no finished run. The
    signal goes `after` seconds past the line that says its handler is in place (the heavy imports come after it), at
    whatever point of start-up that is on this machine: none is assumed to be over by then."""
    import time

    process = foreground_flowsim(["run", "--out", str(tmp_path / "run"), "--set", "time.t_end=5"])
    said = read_until(process, f"flowsim: signals handled: {stage}".encode())
    time.sleep(after)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    text = (said + stderr).decode()
    assert process.returncode == 130 and "Traceback" not in text, text
    assert "Warning" not in text, text  # an interrupted Thread.start once left JAX's 60 s TPU watchdog to warn at exit
    said = [line for line in text.replace("\r", "\n").splitlines() if "interrupted" in line]
    assert len(said) == 1 and said[0].startswith(("flowsim: interrupted", "interrupted at t = ")), text


def test_ctrl_c_while_typer_builds_the_command_line_is_one_line_and_exit_130(monkeypatch, capsys):
    """A KeyboardInterrupt raised while typer builds the click command (before click can turn it into 130: the race
    the test above sometimes hits at 0.15 s) leaves as one line and exit 130, no traceback."""
    import typer.main

    import flowsim.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(typer.main, "get_command", interrupted)
    monkeypatch.setattr(cli, "_interrupt_reported", False)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == cli.INTERRUPTED_STARTING


@pytest.mark.parametrize("where", ["gc callback", "import", "thread start", "jax backend set-up"])
def test_the_sigint_handler_defers_an_interrupt_that_lands_in_a_gc_callback_an_import_or_a_thread_start(
        monkeypatch, tmp_path, where):
    """Inside a garbage-collector callback, a module's import or Thread.start the handler raises nothing and asks for
    the signal to be handled again later; elsewhere it raises KeyboardInterrupt."""
    import gc
    import importlib
    import sys
    import threading

    from flowsim.common import interrupts

    sent = []
    monkeypatch.setattr(interrupts, "deliver_later", sent.append)
    monkeypatch.setattr(interrupts, "raised_interrupt", None)
    outcome = []

    def handle_here():
        try:
            interrupts.interrupt_when_safe(signal.SIGINT, sys._getframe())
            outcome.append("deferred")
        except KeyboardInterrupt:
            outcome.append("raised")

    if where == "gc callback":
        def callback(phase, info):
            if phase == "start" and not outcome:
                handle_here()

        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
    elif where == "jax backend set-up":  # a frame of jax/_src/xla_bridge.py, between its timer's start and its try
        from jax._src import xla_bridge

        exec(compile("handle_here()", xla_bridge.__file__, "exec"), {"handle_here": handle_here})
    elif where == "thread start":
        class StartedEvent(threading.Event):  # Thread.start waits on it: the interrupt lands inside start
            def wait(self, timeout=None):
                handle_here()
                return super().wait(timeout)

        thread = threading.Thread(target=lambda: None)
        thread._started = StartedEvent()
        thread.start()
        thread.join()
    else:
        (tmp_path / "module_being_imported.py").write_text("import builtins\nbuiltins._flowsim_handle_here()\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setattr("builtins._flowsim_handle_here", handle_here, raising=False)
        importlib.import_module("module_being_imported")
        monkeypatch.delitem(sys.modules, "module_being_imported")
    assert outcome == ["deferred"] and sent == [signal.SIGINT]
    with pytest.raises(KeyboardInterrupt):
        interrupts.interrupt_when_safe(signal.SIGINT, sys._getframe())


def test_a_deferred_interrupt_comes_back_from_its_timer_to_the_handler_then_in_place(monkeypatch):
    """deliver_later's SIGALRM sends SIGINT again after REDELIVERY_SECONDS to whatever handler is in place then:
    interrupt_when_safe raises in a sleep; inside a stop_requests block the request is set and nothing is raised."""
    import time

    from flowsim.common import interrupts

    monkeypatch.setattr(interrupts, "raised_interrupt", None)
    before = {number: signal.getsignal(number) for number in (signal.SIGALRM, signal.SIGINT)}
    try:
        signal.signal(signal.SIGINT, interrupts.interrupt_when_safe)
        with pytest.raises(KeyboardInterrupt):
            interrupts.deliver_later(signal.SIGINT)
            time.sleep(30)
        assert interrupts.raised_interrupt == "SIGINT"
        monkeypatch.setattr(interrupts, "raised_interrupt", None)
        with stop_requests() as stop:
            interrupts.deliver_later(signal.SIGINT)
            for _ in range(3000):
                if stop():
                    break
                time.sleep(0.01)
            assert stop() and stop.signal_name == "SIGINT"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in before.items():
            signal.signal(number, handler)


def test_an_interrupt_python_drops_is_sent_again_and_other_errors_are_reported(monkeypatch):
    """sys.unraisablehook = redeliver_dropped_interrupts: a KeyboardInterrupt raised where Python can only drop it
    (here a __del__) is sent again, not printed, and clears the remembered one; any other error goes to Python's hook."""
    import sys

    from flowsim.common import interrupts

    sent, reported = [], []
    monkeypatch.setattr(interrupts, "deliver_later", sent.append)
    monkeypatch.setattr(interrupts, "raised_interrupt", "SIGINT")
    monkeypatch.setattr(sys, "__unraisablehook__", lambda unraisable: reported.append(unraisable.exc_type))
    monkeypatch.setattr(sys, "unraisablehook", interrupts.redeliver_dropped_interrupts)

    class DroppedIn:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    DroppedIn(KeyboardInterrupt())
    assert sent == [signal.SIGINT] and interrupts.raised_interrupt is None and not reported
    DroppedIn(ValueError("not an interrupt"))
    assert sent == [signal.SIGINT] and reported == [ValueError]


def test_an_interrupt_a_library_swallowed_still_stops_the_next_block_of_work(monkeypatch):
    """The handler raised KeyboardInterrupt and a bare `except:` (as in some of JAX's own code) swallowed it: the next
    stop_requests block starts with its request set, once; the one after starts clear."""
    import sys

    from flowsim.common import interrupts

    monkeypatch.setattr(interrupts, "raised_interrupt", None)
    with stop_requests() as stop:
        assert not stop()
    try:
        interrupts.interrupt_when_safe(signal.SIGINT, sys._getframe())
    except:  # noqa: E722 -- the swallowing this test is about
        pass
    with stop_requests() as stop:
        assert stop() and stop.signal_name == "SIGINT"
    with stop_requests() as stop:
        assert not stop()


def test_ctrl_c_during_a_prediction_says_nothing_was_cached(tmp_path):
    """`flowsim predict` caches a prediction whole or not at all: interrupted in the middle it says so (not that the
    command was starting), exits 130 and leaves no cache entry."""
    import os

    cache = tmp_path / "predictions"
    process = foreground_flowsim(["predict"], env={**os.environ, "FLOWSIM_PREDICTION_CACHE": str(cache)})
    first = read_until(process, b"flowsim: Stage I").decode()  # the first stage's progress line: the prediction has begun
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=120)
    text = first + rest.decode()
    assert "\nflowsim: Stage I" in "\n" + first, text
    assert process.returncode == 130 and "Traceback" not in text, text
    said = [line for line in text.splitlines() if "interrupted" in line]
    assert said == ["flowsim: interrupted while predicting: nothing was cached; the same command predicts again"], text
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_a_command_leaves_with_its_own_status_and_no_redelivery_pending():
    """An interrupt deferred inside the last imports of a command that then ends at once (a sweep without a grid
    fails within milliseconds of its imports) left its SIGALRM timer pending: it fired after the interpreter had
    restored SIGALRM's default, and the process died by SIGALRM (-14) instead of exiting 2. The entry point cancels
    it on the way out."""
    import subprocess
    import sys

    script = ("import signal, sys\n"
              "import flowsim.cli, flowsim.common.interrupts as interrupts\n"
              "def command():\n"
              "    interrupts.deliver_later(signal.SIGINT)\n"
              "    sys.exit(2)\n"
              "flowsim.cli.main = command\n"
              "from flowsim.__main__ import main\n"
              "try:\n"
              "    main()\n"
              "except SystemExit as stop:\n"
              "    print(stop.code, signal.getitimer(signal.ITIMER_REAL)[0])\n")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0 and completed.stdout.split() == ["2", "0.0"], completed.stdout + completed.stderr


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_signals_interrupt_raises_for_both_signals_and_leaves_nothing_for_a_later_stop_request(number):
    """Inside signals_interrupt both signals raise KeyboardInterrupt; once its caller has it, the next stop_requests
    block starts unstopped (a remembered interrupt would stop the next run of the same process at once)."""
    from flowsim.common.interrupts import interrupt_when_safe, signals_interrupt

    before = signal.getsignal(number)
    with pytest.raises(KeyboardInterrupt):
        with signals_interrupt():
            assert signal.getsignal(number) is interrupt_when_safe
            os.kill(os.getpid(), number)
            for _ in range(10**7):  # the handler runs between bytecodes
                pass
    assert signal.getsignal(number) is before
    with stop_requests() as stop:
        assert not stop()


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_line_loads_is_one_line_and_exit_130(number):
    """Ctrl-C or SIGTERM while `flowsim`'s modules load (the handler `main` installs first) says so in one line and
    exits 130; SIGTERM is not a silent 143."""
    import subprocess
    import sys

    code = ("import os, signal, time, flowsim.__main__ as entry; "
            f"signal.signal({int(number)}, entry._interrupted_while_loading); os.kill(os.getpid(), {int(number)}); time.sleep(10)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130 and done.stderr == "flowsim: interrupted while the command was starting\n", done
