"""Directories a command fills before its result is whole (a staging directory renamed into
place, XLA's dump in the temporary directory), removed however the command ends.

Leaving the block removes what is left of the directory. A signal ends a command at once
(`kiln.util.interrupt`: the directory is removed first), a crash or `kill -9` without running
anything, and in either case threads of the process (XLA's compiler writing its dump, orbax's
writers) may still be adding files under the directory: XLA even makes it again if it is gone.
So each directory is also handed to a small helper process, started with the first one, which
removes what is left of it once this process has ended: when the pipe the helper reads is
closed, which the kernel does only after the last thread has gone.

`staged` is how a command writes an output directory in one piece (`kiln import-hf`,
`kiln export-hf`): `check_stageable` before any work, a failed write as one line naming the
output (`kiln.errors.write_error`), and leftovers of writers that died with their machine removed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import KilnError, WriteFailed, write_error
from kiln.util.files import check_creatable, pid_alive
from kiln.util.interrupt import on_interrupt

# The helper: lines `+TREE,PARENT,...` (remove this directory at the end, then these parents
# if empty) and `-TREE` (keep it), each path's bytes in hex, until the end of its input (this
# process has ended); then it removes what is left.
_REMOVER = """
import os, shutil, sys
left = {}
for line in sys.stdin.buffer:
    tree, *parents = [bytes.fromhex(p) for p in line[1:].decode().split(",")]
    if line[:1] == b"+":
        left[tree] = parents
    else:
        left.pop(tree, None)
for tree, parents in left.items():
    shutil.rmtree(tree, ignore_errors=True)
    for parent in parents:
        try:
            os.rmdir(parent)
        except OSError:
            pass
"""

_lock = threading.Lock()
_remover: subprocess.Popen | None = None
_remover_failed = False


def _tell_remover(sign: bytes, *paths: Path) -> None:
    """Send one line to the helper, starting it first if needed; without it (no interpreter to
    start, or it has gone) the directory is removed in this process only."""
    global _remover, _remover_failed
    line = sign + b",".join(os.fsencode(p).hex().encode() for p in paths) + b"\n"
    with _lock:
        if _remover is None and not _remover_failed:
            try:
                _remover = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _REMOVER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    # stderr stays the command's: whoever reads it to its end (a pipe, a test)
                    # gets there once the removal is done.
                    # A session of its own: Ctrl-C at a terminal reaches the command alone.
                    start_new_session=True,
                )
            except (OSError, ValueError):
                _remover_failed = True
        if _remover is not None:
            with contextlib.suppress(OSError, ValueError):
                _remover.stdin.write(line)
                _remover.stdin.flush()


@contextlib.contextmanager
def scratch_directory(path: Path, mode: int = 0o777, parents: bool = False) -> Iterator[Path]:
    """A new empty directory at `path` (a name of this process's own) for the block; what is
    left of it is removed when the block ends, or when the process ends inside the block.

    `parents`: missing parent directories are made, and removed again if they are empty at the
    end (they are not when the block has renamed `path` into one of them).
    """
    path = Path(path).absolute()
    made = [p for p in path.parents if not p.exists()] if parents else []

    def clean() -> None:
        # Files another thread adds meanwhile may stay: the helper removes them at the end.
        shutil.rmtree(path, ignore_errors=True)
        for parent in made:  # deepest first
            with contextlib.suppress(OSError):
                parent.rmdir()

    _tell_remover(b"+", path, *made)
    forget = on_interrupt(clean)
    try:
        shutil.rmtree(path, ignore_errors=True)  # an earlier process's, of the same pid
        path.mkdir(mode=mode, parents=parents)
        yield path
    finally:
        forget()
        clean()
        if not os.path.lexists(path):
            _tell_remover(b"-", path)


def temporary_directory(prefix: str) -> contextlib.AbstractContextManager[Path]:
    """`scratch_directory` in the system's temporary directory (TMPDIR), private to the user,
    named `prefix` + pid + a random part."""
    name = f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    return scratch_directory(Path(tempfile.gettempdir()) / name, mode=0o700)


def check_stageable(out: Path, field: str) -> None:
    """KilnError unless `out` can be `staged`: new, or an empty directory (staging directories
    that dead writers left in it aside), in a directory kiln can create or write. Checked before
    any work; `field` names it in the line (e.g. `--out`)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or set(out.iterdir()) - set(_left_inside(out))):
        raise KilnError(f"{field}: {out} already exists and is not empty; choose a new directory")
    # Staged beside a new `out`, so its parent is written; inside an existing one.
    check_creatable(out, field, beside=not out.is_dir())


@contextlib.contextmanager
def staged(out: Path, *, then: str) -> Iterator[Path]:
    """A staging directory for the block to fill, which becomes the directory `out` when the
    block ends without an exception; else it is removed, as are the parents of `out` it made,
    so `out` is as it was (`check_stageable` first).

    A new `out` is staged beside it (`.NAME.partial-HOST-PID`) and renamed into place at once.
    An existing `out` (empty) may be a mount point or a link, which a rename would fail on or
    replace: it is staged inside (`.partial-HOST-PID`), and the entries move up in the order
    they were written, any moved already being removed again if an exception or a signal comes
    meanwhile. Staging directories of `out` that writers on this host left when they died (a
    crash that the helper process did not outlive) are removed first.

    A failed write (an OSError, or a `WriteFailed` under the staging directory) becomes one line
    naming `out` (`kiln.errors.write_error`; `then`: what running the same command again does).
    """
    out = Path(out).absolute()
    try:
        with _staging(out) as staging:
            yield staging
    except BaseException as e:
        error = e.error if isinstance(e, WriteFailed) else e
        if isinstance(error, OSError):
            raise write_error(error, out, then=then) from None
        raise


def _writer() -> str:
    """What a staging directory's name holds before its writer's pid: `partial-HOST-`."""
    return f"partial-{socket.gethostname()}-"


def _left_by_dead(directory: Path, prefix: str) -> list[Path]:
    """Entries `PREFIX` + pid of `directory` whose process, on this host, has ended."""
    found = []
    for path in directory.glob(f"{glob.escape(prefix)}*"):
        pid = path.name.removeprefix(prefix)
        if pid.isdigit() and not pid_alive(int(pid)):
            found.append(path)
    return found


def _left_inside(out: Path) -> list[Path]:
    """Staging directories dead writers left inside an existing `out`."""
    return _left_by_dead(out, f".{_writer()}")


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """`staged` without the translation of a failed write."""
    if not out.is_dir():
        beside = f".{out.name}.{_writer()}"
        for stale in _left_by_dead(out.parent, beside):
            shutil.rmtree(stale, ignore_errors=True)
        with scratch_directory(out.with_name(f"{beside}{os.getpid()}"), parents=True) as staging:
            yield staging
            os.replace(staging, out)
        return
    for stale in _left_inside(out):
        shutil.rmtree(stale, ignore_errors=True)
    with scratch_directory(out / f".{_writer()}{os.getpid()}") as staging:
        yield staging
        moved: list[Path] = []

        def unmove() -> None:
            for path in moved:
                shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(OSError):
                    path.unlink()

        forget = on_interrupt(unmove)
        try:
            for entry in sorted(staging.iterdir(), key=lambda e: e.lstat().st_mtime_ns):
                moved.append(out / entry.name)  # first: a signal during the rename removes it
                os.replace(entry, out / entry.name)
        except BaseException:
            unmove()
            raise
        finally:
            forget()
