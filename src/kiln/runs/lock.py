"""One writer per run directory (and per store of `kiln teacher-logits`): an exclusive lock file
naming its holder's host and pid.

The lock is an advisory `flock` on `{run_dir}/kiln.lock`, which the kernel releases when the
holder exits in any way (kill -9 included), so a lock left behind by a dead process never
blocks a new one. The file's content (host, pid, start time) only names the holder in the
refusal; on a clean exit the file is removed. Where `flock` is not supported, the content
decides: a lock whose pid is gone on this host is stale and taken over, any other is refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from contextlib import suppress
from pathlib import Path

from kiln.errors import KilnError
from kiln.util.interrupt import on_interrupt

LOCK_NAME = "kiln.lock"


class RunLock:
    """The exclusive lock of one run directory, held from `acquire` until `release` or exit.

    `field` and `kind` name the directory in a refusal: the option or config field that chose
    it, and what it holds (a "run", a "store").
    """

    def __init__(
        self, run_dir: Path, command: str, *, field: str = "train.run_name", kind: str = "run"
    ):
        self.path = Path(run_dir) / LOCK_NAME
        self.command = command
        self.field, self.kind = field, kind
        self._fd: int | None = None
        self._forget = lambda: None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> str | None:
        """Take the lock (the run directory must exist); KilnError naming the holder if another
        process has it. Returns a note when a lock left by a dead process was taken over."""
        if self._fd is not None:
            return None
        while True:
            fd = self._open()
            try:
                locked = _flock(fd)
                holder = _read_holder(fd)
                if locked is False or (locked is None and _alive_elsewhere(holder)):
                    raise KilnError(self._refusal(holder))
                if not _same_file(fd, self.path):
                    continue  # the holder removed the file between our open and flock: retry
            except BaseException:
                os.close(fd)
                raise
            break
        self._fd = fd
        self._forget = on_interrupt(self.release)
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": _now(),
            "command": self.command,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        if holder and holder.get("pid") != os.getpid():
            return (
                f"{self.path}: took over the stale lock of pid {holder.get('pid')} on "
                f"{holder.get('host')} (since {holder.get('since')}): that process is gone"
            )
        return None

    def _open(self) -> int:
        """The lock file, created if absent; KilnError if something else has its name."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except IsADirectoryError:
            fd = None
        if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        if fd is not None:
            os.close(fd)
        kind = "a directory" if self.path.is_dir() else "not a regular file"
        raise KilnError(
            f"{self.path}: {kind}, where the run keeps its lock file; allowed: a regular file "
            "or nothing (remove it: kiln creates the lock file itself)"
        )

    def release(self) -> None:
        """Remove the lock file and let go (a no-op when not held)."""
        if self._fd is None:
            return
        self._forget()
        try:
            with suppress(OSError):  # a read-only or vanished run directory: still unlocked
                if _same_file(self._fd, self.path):
                    self.path.unlink()
        finally:
            os.close(self._fd)
            self._fd = None

    def _refusal(self, holder: dict | None) -> str:
        who = (
            f"pid {holder.get('pid')} on host {holder.get('host')} "
            f"(`{holder.get('command')}`, since {holder.get('since')})"
            if holder
            else "another process (the lock file names no holder yet)"
        )
        return (
            f"{self.field}: the {self.kind} directory {self.path.parent} is in use by {who}; "
            f"one process writes a {self.kind} at a time (its lock: {self.path}); wait for it "
            f"to end, stop it, or use another {self.field}"
        )


def _flock(fd: int) -> bool | None:
    """True if this process now holds the lock, False if another does, None if unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return True


def _read_holder(fd: int) -> dict | None:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _alive_elsewhere(holder: dict | None) -> bool:
    """Without flock: whether the named holder may still run (unknown on another host: yes)."""
    if not holder or holder.get("pid") == os.getpid():
        return False
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
