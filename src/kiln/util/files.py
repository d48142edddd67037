"""Local files kiln writes: output directories checked before the work, and arrays written so
that a failed write (a full disk, a quota) raises an OSError with its errno.

numpy's own writers (`ndarray.tofile`, `np.save` to a real file) write through C stdio and
report a full disk as a bare OSError ("N requested and M written", "Not enough free space"),
without the errno that tells it from other faults; Python's file objects keep it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from kiln.errors import KilnError


def check_creatable(path: Path, field: str, *, beside: bool = False) -> None:
    """KilnError unless `path` is a writable directory or one that can be created.

    Probes with a temporary directory in the nearest existing ancestor, removed at once, so a
    refusal leaves nothing behind and a pass means the first real write will not fail for
    want of permission (space can still run out: see `kiln.errors.write_error`).
    `beside`: `path` is staged next to itself and renamed into place, so its parent is written.
    """
    path = path.absolute()
    check_path_length(path, field)
    existing = path.parent if beside else path
    while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is" if existing == path else f"cannot be created: {existing} is"
        raise KilnError(
            f"{field}: {path} {where} not a directory; allowed: a directory kiln can create or write"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kiln-probe-", dir=existing))
    except OSError as e:
        raise KilnError(
            f"{field}: {path} cannot be created or written ({e.strerror} in {existing}); "
            "allowed: a directory kiln can create or write"
        ) from None


def check_path_length(path: Path, field: str, reserve: int = 0) -> None:
    """KilnError naming `field` when a name in `path` is longer than its filesystem allows, or
    the whole path, with `reserve` bytes for what is written below it, is."""
    path = path.absolute()
    name_max, path_max = _limits(path)
    for name in path.parts:
        size = len(os.fsencode(name))
        if size > name_max:
            raise KilnError(
                f"{field}: the name {_short(name)} in {_short(str(path))} is {size} bytes; "
                f"allowed: at most {name_max} bytes per name (the filesystem's limit)"
            )
    size = len(os.fsencode(str(path)))
    if size + reserve > path_max:
        room = f" plus {reserve} for the files kiln writes below it" if reserve else ""
        raise KilnError(
            f"{field}: {_short(str(path))} is {size} bytes long{room}; allowed: at most "
            f"{path_max} bytes in all (the filesystem's path limit): choose a shorter path"
        )


def _limits(path: Path) -> tuple[int, int]:
    """(longest name, longest path) in bytes on the filesystem of `path`'s nearest existing
    ancestor; POSIX's usual 255 and 4096 where it does not say."""
    for where in (path, *path.parents):
        try:
            return os.pathconf(where, "PC_NAME_MAX"), os.pathconf(where, "PC_PATH_MAX")
        except (OSError, ValueError):
            continue
    return 255, 4096


def _short(text: str) -> str:
    """A long path or name cut in the middle for a one-line message."""
    return text if len(text) <= 80 else f"{text[:40]}...{text[-30:]}"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (staging directories name their writer)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_array(path: Path, array: np.ndarray, *, npy: bool = False, sync: bool = False) -> None:
    """Write `array`'s bytes (C order) to `path`: raw, or as a .npy file (`npy`); `sync`:
    fsync before returning."""
    array = np.ascontiguousarray(array)
    with open(path, "wb") as f:
        if npy:
            header = np.lib.format.header_data_from_array_1_0(array)
            np.lib.format.write_array_header_1_0(f, header)
        f.write(array.data.cast("B") if array.size else b"")
        if sync:
            f.flush()
            os.fsync(f.fileno())
