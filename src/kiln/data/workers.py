"""Parallel workers of `kiln prepare` that never outlive it, and SIGTERM handled as SIGINT.

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
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_POLL_SECONDS = 0.2


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[Executor]:
    """An executor of `workers` processes (fork) when this process is single-threaded and has not
    loaded JAX, as in `kiln prepare`; of threads otherwise (forking a live JAX runtime is unsafe,
    and spawn would re-run an unguarded __main__). Thread workers still use every core for the
    tokenizers that encode batches in native threads (tokenizers, sentencepiece).

    Submit every task before starting other threads (e.g. a progress bar): processes are forked
    at the first submit. On an exception the pending tasks are cancelled and the worker processes
    stop at once, abandoning their running tasks.
    """
    stop = None
    if threading.active_count() == 1 and "jax" not in sys.modules:
        ctx = multiprocessing.get_context("fork")
        stop = ctx.Event()
        pool: Executor = ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(), stop)
        )
    else:
        pool = ThreadPoolExecutor(workers)
    try:
        yield pool
    except BaseException:
        if stop is not None:
            stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _worker_init(parent: int, stop) -> None:
    # One process per core already; the tokenizers library's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the whole process group: the parent alone handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises KeyboardInterrupt, as SIGINT does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        # None: the previous handler was not installed from Python; the default is the nearest.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
