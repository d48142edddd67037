"""Directories a run will write, checked before any work: a path that cannot be created (a
file in the way, a read-only or pseudo filesystem) is bad input, refused in one line."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kiln.config import Config
from kiln.errors import KilnError
from kiln.util import storage

# Sources tokenized into data.cache_dir on first use.
_CACHED_SOURCES = ("text", "jsonl", "parquet")
# Bytes of path kept free below a run directory for the files kiln writes there (the deepest,
# a checkpoint's data files, take about 100).
RUN_DIR_RESERVE = 256


def check_output_paths(config: Config) -> None:
    """KilnError naming the field if the run directory or the data cache cannot be written."""
    output_dir = config.local_output_dir.expanduser()
    if storage.is_remote(storage.location(config.train.output_dir)):
        storage.filesystem(config.train.output_dir, "train.output_dir")  # its backend is there
        check_creatable(output_dir, "train.mirror_dir")
    else:
        check_creatable(output_dir, "train.output_dir")
    run_dir = output_dir / config.train.run_name
    check_path_length(run_dir, "train.output_dir/train.run_name", RUN_DIR_RESERVE)
    if run_dir.exists() or run_dir.is_symlink():
        check_creatable(run_dir, "train.run_name")
    if any(s.source in _CACHED_SOURCES for _, s in config.data.mixture()):
        cache = config.data.cache_dir
        root = Path(cache).expanduser() if cache else output_dir / ".cache"
        if not root.is_dir():  # an existing cache may be read-only: prepared data is only read
            check_creatable(root, "data.cache_dir" if cache else "data.cache_dir (default)")


def check_creatable(path: Path, field: str) -> None:
    """KilnError unless `path` is a writable directory or one that can be created.

    Probes with a temporary directory in the nearest existing ancestor, removed at once, so a
    refusal leaves nothing behind and a pass means the first real write will not fail for
    want of permission (space can still run out: see `kiln.errors.write_error`).
    """
    path = path.absolute()
    check_path_length(path, field)
    existing = path
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
