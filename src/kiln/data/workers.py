"""Parallel workers of `kiln prepare` that never outlive it, and SIGTERM handled like SIGINT.

Worker processes (fork) exit when the parent dies, even by kill -9 (Linux: PR_SET_PDEATHSIG;
elsewhere, and as a fallback, a thread that polls the parent's pid), and when the parent leaves
the pool because of an exception (Ctrl-C, SIGTERM, a bad input): without this they stay blocked
on the task queue forever, reparented to init.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor

from kiln.util.interrupt import Stopped

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_POLL_SECONDS = 0.2


@contextlib.contextmanager
def worker_pool(workers: int, fn: Callable, jobs: Sequence[tuple]) -> Iterator[list[Future]]:
    """Futures of `fn(*job)` for every job, run by `workers` processes (fork) when this process
    is single-threaded and has not loaded JAX, as in `kiln prepare`; by threads otherwise (forking
    a live JAX runtime is unsafe, and spawn would re-run an unguarded __main__). Thread workers
    still use every core for the tokenizers that encode batches in native threads (tokenizers,
    sentencepiece).

    Every job is submitted (and every process forked) before the block starts, with SIGINT and
    SIGTERM held back meanwhile so that an interrupt never finds the pool half set up. Leaving
    the block by an exception cancels the pending jobs and stops the worker processes at once,
    abandoning their running jobs.
    """
    pool: Executor | None = None
    stop = None
    try:
        with _signals_held():  # a signal that came meanwhile is raised as this block ends
            if threading.active_count() == 1 and "jax" not in sys.modules:
                ctx = multiprocessing.get_context("fork")
                stop = ctx.Event()
                pool = ProcessPoolExecutor(
                    workers, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(), stop)
                )
            else:
                pool = ThreadPoolExecutor(workers)
            futures = [pool.submit(fn, *job) for job in jobs]
        yield futures
    except BaseException:
        if stop is not None:
            stop.set()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


_INTERRUPTS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM stay pending inside the block, and are delivered when it ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _worker_init(parent: int, stop) -> None:
    # One process per core already; the tokenizers library's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the whole process group: the parent alone handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent's SIGTERM handler (see signals_as_interrupt) is inherited by fork; the pool
    # ends a worker with SIGTERM, which should just end it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):  # forked while the parent held them back
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _INTERRUPTS)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    threading.Thread(target=_watch, args=(parent, stop), daemon=True).start()


def _watch(parent: int, stop) -> None:
    """Exit the worker when the parent asks (`stop`) or has died (we were reparented)."""
    while not stop.wait(_POLL_SECONDS):
        if os.getppid() != parent:
            break
    os._exit(1)


@contextlib.contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """Inside the block SIGINT raises KeyboardInterrupt and SIGTERM `Stopped` (a
    KeyboardInterrupt), instead of the immediate exit `kiln.cli` sets: the block's own cleanup
    runs (its workers stopped, its staging directory removed), and the CLI exits 130 or 143.

    Only in the main thread, and only over handlers set from Python (or the defaults): one set
    outside Python, e.g. by JAX's preemption service in a multi-process run, could not be put back.
    """
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield
        return

    def interrupt(signum, _frame):
        raise Stopped(signum)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
