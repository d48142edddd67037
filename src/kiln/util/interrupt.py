"""Ctrl-C and SIGTERM outside the training loop: one line and an immediate exit.

Unwinding a KeyboardInterrupt through half-imported C extensions or past XLA's compile threads
can abort or crash the interpreter at exit, so until the loop installs its own handlers (which
checkpoint and stop, see `kiln.training.loop.stop_requests`) a signal ends the process at once with
`os._exit`: nothing is half-written at that point (the run directory is written only after
validation, checkpoints only inside orbax's temporary directories), and lock files are released.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import NoReturn

# Run before exiting (e.g. releasing a run directory's lock); each must be quick and safe.
_cleanups: list[Callable[[], None]] = []


def on_interrupt(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Register `cleanup` to run before an interrupted exit; returns a function unregistering it."""
    _cleanups.append(cleanup)
    return lambda: _cleanups.remove(cleanup) if cleanup in _cleanups else None


def exit_now(code: int, message: str) -> NoReturn:
    """Run the registered cleanups, print `message` as one line on stderr and exit with `code`
    at once (no unwinding, no waiting for other threads)."""
    for cleanup in list(_cleanups):
        with suppress(Exception):  # exiting anyway; the kernel drops what is left
            cleanup()
    with suppress(Exception):  # a closed or broken stderr: the line below is best effort
        sys.stderr.flush()
    with suppress(OSError):
        os.write(sys.stderr.fileno(), f"{message}\n".encode())
    os._exit(code)


def _exit_now(signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    message = "kiln: interrupted" if signum == signal.SIGINT else f"kiln: stopped by {name}"
    exit_now(128 + signum, message)


@contextmanager
def exit_on_signals() -> Iterator[None]:
    """Inside, SIGINT exits 130 and SIGTERM 143, each with one line (main thread only)."""
    previous = {s: signal.signal(s, _exit_now) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
