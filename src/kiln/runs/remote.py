"""Run directories read from a URL (a teacher, `checkpoint.load_params_from`): mirrored into a
local cache first, because kiln's checkpoint reader (step listing, CRC-32 checks, orbax
restore) works on local files. Only what changed since the last mirror is fetched again."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.util import storage

# Not needed to restore or check a run: event files and logs can be large.
_SKIPPED_DIRS = ("tensorboard", "damaged-checkpoints")
_SKIPPED_FILES = ("metrics.jsonl",)
# Files this small are fetched at every start (a config.yaml may change and keep its size);
# larger ones (checkpoint arrays, written once per step) only when their size differs.
_ALWAYS_BYTES = 1 << 20


def _needed(rel: str) -> bool:
    return rel.split("/", 1)[0] not in _SKIPPED_DIRS and rel not in _SKIPPED_FILES


def local_run(given: str, field: str, config: Any, only: tuple[str, ...] | None = None) -> Path:
    """The local path of `given`: itself if local, else its mirror under
    `{train.output_dir}/.cache/remote-runs/` (same last name, so a step directory stays one).
    `only`: fetch just these files (e.g. config.yaml, for `kiln compile`)."""
    loc = storage.location(given)
    if isinstance(loc, Path):
        return loc
    key = hashlib.sha256(loc.encode()).hexdigest()[:16]
    root = config.local_output_dir.expanduser() / ".cache" / "remote-runs" / key
    local = root / storage.name(loc)
    mirror(loc, local, field, only)
    return local


def mirror(url: str, local: Path, field: str, only: tuple[str, ...] | None = None) -> None:
    """Make `local` hold the files below `url` (sizes compared; files gone there removed), or
    just the files `only` names."""
    fs, path = storage.filesystem(url, field)
    with storage.reading(url, "read", field):
        if not fs.isdir(path):
            raise KilnError(f"{field}: {url} is not a directory; allowed: a kiln run directory")
        remote = {
            h[len(path) :].lstrip("/"): int(info["size"])
            for h, info in fs.find(path, detail=True).items()
        }
        remote = {r: s for r, s in remote.items() if (r in only if only else _needed(r))}
        missing = [name for name in only or () if name not in remote]
        if missing:
            raise KilnError(f"{field}: {url} has no {missing[0]}; is it a kiln run directory?")
        for rel, size in remote.items():
            dest = local / rel
            if size > _ALWAYS_BYTES and dest.is_file() and dest.stat().st_size == size:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(f".{dest.name}.part-{os.getpid()}")
            fs.get_file(f"{path}/{rel}", str(part))
            os.replace(part, dest)
    if only:
        return
    for old in sorted(local.rglob("*"), reverse=True):
        rel = old.relative_to(local).as_posix()
        if ".part-" in old.name:  # another process (host) may be fetching into it right now
            continue
        if old.is_file() and rel not in remote:
            old.unlink()
        elif old.is_dir() and not any(old.iterdir()):
            old.rmdir()
