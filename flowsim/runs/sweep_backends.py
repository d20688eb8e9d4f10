"""Where a sweep's chunks run: in this process or a pool of spawned processes (``run_local``), or on a Dask
distributed cluster (``run_dask``). Every worker process gets the thread settings of WORKER_THREAD_ENV, so both
backends compute identical results."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Callable

from flowsim.config import ConfigError
from flowsim.common.interrupts import stop_requests

# BLAS and OpenMP threads of every worker process, as Dask's nanny sets them: equal settings give bit-identical
# results on either backend.
WORKER_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@contextlib.contextmanager
def _worker_environment():
    """Worker processes inherit the thread settings of WORKER_THREAD_ENV."""
    saved = {key: os.environ.get(key) for key in WORKER_THREAD_ENV}
    os.environ.update(WORKER_THREAD_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


PARENT_POLL_SECONDS = 1.0


def exit_with_parent(parent: int) -> None:
    """In a worker: exit as soon as the sweep process ``parent`` is gone (killed with -9 it cannot stop its
    pool), checked every PARENT_POLL_SECONDS by a daemon thread: a worker is re-parented when its parent dies."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


@contextlib.contextmanager
def _interrupts_held():
    """SIGINT blocked in this thread while the block runs, and delivered when it ends (nothing is lost). A process
    spawned inside it inherits the blocked mask and keeps it: a worker never sees the Ctrl-C that a terminal sends
    to the whole process group, so it cannot be cut anywhere (JAX's garbage-collector callback printed tracebacks);
    the sweep process stops its workers itself. (Where there are no signal masks, as on Windows, nothing is held.)"""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def run_local(work: Callable, tasks: list[tuple], workers: int, on_result: Callable) -> None:
    """``on_result(work(*task))`` for every task: in this process when ``workers`` is 1, else in a pool of that many
    spawned processes. SIGINT/SIGTERM stop the work (KeyboardInterrupt)."""
    if workers == 1:  # in this process: SIGINT/SIGTERM stop the solve in progress within about a second
        with stop_requests() as stop:
            for task in tasks:
                on_result(work(*task, should_stop=stop))
        return
    # spawn: a forked child of a process that has started JAX's threads can deadlock.
    with stop_requests() as stop, _worker_environment(), concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=exit_with_parent,
            initargs=(os.getpid(),)) as pool:
        with _interrupts_held():  # the pool spawns its workers as tasks are submitted
            pending = {pool.submit(work, *task) for task in tasks}
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=PARENT_POLL_SECONDS,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                on_result(future.result())
            if stop():  # SIGINT/SIGTERM to the sweep: its workers stop now, and write no row after it
                for process in list(pool._processes.values()):
                    process.terminate()
                pool.shutdown(wait=True, cancel_futures=True)
                raise KeyboardInterrupt


class ClusterLost(RuntimeError):
    """The Dask scheduler could not be reached, or was lost during the sweep (the rows written are kept)."""


def run_dask(work: Callable, tasks: list[tuple], workers: int, scheduler: str | None, on_result: Callable, *,
             split: Callable[[tuple], list[tuple]], on_killed: Callable[[tuple, Exception], object]) -> None:
    """``on_result(work(*task))`` for every task on a Dask cluster (a LocalCluster of ``workers`` processes, or the
    scheduler at ``scheduler``). A worker that dies is replaced and its task run again by the scheduler (up to its
    ``allowed-failures``); a task that kills its workers every time is replaced by ``split(task)``, and one that
    cannot be split gives ``on_killed(task, error)`` as its result while the others finish. Losing the scheduler
    raises ClusterLost."""
    try:
        from distributed import CancelledError, Client, KilledWorker, LocalCluster, as_completed
        from distributed.comm.core import CommClosedError
    except ImportError:
        raise ConfigError("--backend dask needs the 'distributed' package: pip install 'flowsim[dask]'") from None
    where = "the sweep's LocalCluster" if scheduler is None else f"the Dask scheduler at {scheduler}"
    with contextlib.ExitStack() as stack:
        client_log = logging.getLogger("distributed.client")
        client_log.addFilter(quiet := _WithoutTracebacks())
        stack.callback(client_log.removeFilter, quiet)
        for handler in logging.getLogger("distributed").handlers:  # silenced on an interrupt, restored after
            stack.callback(handler.setLevel, handler.level)
        if scheduler is None:
            cluster = stack.enter_context(LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                                       env=WORKER_THREAD_ENV, dashboard_address=None))
            client = stack.enter_context(Client(cluster))
            client.register_plugin(_quiet_on_interrupt_plugin())
        else:
            try:
                client = stack.enter_context(Client(scheduler))
            except OSError as error:
                raise ClusterLost(f"cannot reach {where}: {error}") from None
        # the first to close as an interrupt propagates; a LocalCluster's workers are told as well
        stack.enter_context(_silent_once_interrupted(client if scheduler is None else None))
        submitted = {}

        def submit(task) -> object:
            future = client.submit(work, *task, pure=False)
            submitted[future.key] = task
            return future

        queue = as_completed([submit(task) for task in tasks])
        for future in queue:
            task = submitted[future.key]
            try:
                result = future.result()
            except KilledWorker as error:
                parts = split(task)
                for part in parts:  # which part kills its workers: each on its own
                    queue.add(submit(part))
                if parts:
                    continue
                result = on_killed(task, error)
            # the scheduler gone: the future cancelled, or the connection closed while its result was fetched (Dask's
            # own OSError); any other OSError here is the run's own (a full disk): it propagates as one
            except (CancelledError, CommClosedError) as error:
                raise ClusterLost(f"lost {where} during the sweep ({getattr(error, 'reason', None) or error}); the rows "
                                  "written are kept, and the same command, once the scheduler is back, computes the rest") from None
            on_result(result)


@contextlib.contextmanager
def _silent_once_interrupted(client=None):
    """On an interrupt, Dask's logs say nothing while the blocks around this one close, nor do the workers of
    ``client`` (if given): Dask warns of each task it cancels and each busy worker it kills, and heartbeats fail,
    all of which an interrupted sweep expects."""
    try:
        yield
    except KeyboardInterrupt:
        _silence_dask_logs()
        if client is not None:  # a signal to this process alone: its workers have not heard of it
            with contextlib.suppress(Exception):
                client.run(_silence_dask_logs)
        raise


def _silence_dask_logs(*signal_arguments) -> None:
    """Every Dask logger's records go to the handlers of ``distributed``: those say nothing more (a signal handler too)."""
    for handler in logging.getLogger("distributed").handlers:
        handler.setLevel(logging.CRITICAL + 1)


def _quiet_on_interrupt_plugin():
    """A worker plugin by which a LocalCluster's workers, and any that replace them, neither stop nor speak on
    SIGINT. A terminal's Ctrl-C reaches the whole process group; the sweep process closes the cluster itself, as
    the local pool's stops its workers (each worker printed its event loop's KeyboardInterrupt traceback, then
    Dask's warnings of the tasks cancelled). Dask starts a worker's process from threads of its own, so it cannot
    inherit a blocked SIGINT as the local pool's workers do; the handler is set from the worker's event loop, in
    its main thread."""
    from distributed import WorkerPlugin

    class QuietOnInterrupt(WorkerPlugin):
        idempotent = True

        def setup(self, worker) -> None:
            signal.signal(signal.SIGINT, _silence_dask_logs)

    return QuietOnInterrupt()


class _WithoutTracebacks(logging.Filter):
    """Drops Dask's logged tracebacks of its own shutdown once the scheduler is lost; its one-line messages stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None
