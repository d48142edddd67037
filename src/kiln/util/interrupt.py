"""Ctrl-C and SIGTERM: one line and an immediate exit, for every command.

Every command exits 128 + the signal's number: 130 for SIGINT (`kiln: interrupted`), 143 for
SIGTERM (`kiln: stopped by SIGTERM`).

Unwinding a KeyboardInterrupt through half-imported C extensions or past XLA's compile threads
can abort or crash the interpreter at exit, so `kiln.cli` ends the process at once with
`os._exit` on either signal, for the whole of every command: what a command is writing is
either renamed into place whole (`kiln.util.atomic`, `kiln.util.scratch`) or removed by the
cleanups registered here, which run first (lock files are released the same way). A run's loop
takes the signals over to checkpoint first (see `kiln.training.loop.stop_requests`), and
`kiln prepare` while its workers run (see `kiln.data.workers.signals_as_interrupt`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import NoReturn

# Run before exiting (e.g. releasing a run directory's lock); each must be quick and safe.
_cleanups: list[Callable[[], None]] = []


def on_interrupt(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Register `cleanup` to run before an interrupted exit; returns a function unregistering it."""
    _cleanups.append(cleanup)
    return lambda: _cleanups.remove(cleanup) if cleanup in _cleanups else None


class Stopped(KeyboardInterrupt):
    """A signal other than SIGINT raised as an exception (see `kiln.data.workers`), so that
    cleanup runs as for Ctrl-C; the process still exits `exit_code(signum)`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def signal_of(e: KeyboardInterrupt) -> int:
    """The signal behind a KeyboardInterrupt: SIGINT unless it is a `Stopped`."""
    return e.signum if isinstance(e, Stopped) else signal.SIGINT


def exit_code(signum: int) -> int:
    """The exit code of a command a signal stopped: 128 + its number (130 SIGINT, 143 SIGTERM)."""
    return 128 + signum


def stop_line(signum: int) -> str:
    """The one line a command a signal stopped prints."""
    return (
        "kiln: interrupted"
        if signum == signal.SIGINT
        else f"kiln: stopped by {signal.Signals(signum).name}"
    )


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
    exit_now(exit_code(signum), stop_line(signum))


@contextmanager
def exit_on_signals() -> Iterator[None]:
    """Inside, SIGINT exits 130 and SIGTERM 143, each with one line (in the main thread; a
    handler can be set only there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _exit_now) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
