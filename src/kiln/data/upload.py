"""`kiln prepare` into a URL (gs://, s3://, memory://, ...): tokenized into a local temporary
directory by `kiln.data.prepare.prepare`, then uploaded shard by shard with manifest.json last, so a store
without a manifest is an interrupted upload, never a valid output."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.data.manifest import MANIFEST, up_to_date
from kiln.errors import KilnError
from kiln.util import storage
from kiln.util.scratch import temporary_directory

_SHARD_FILE = re.compile(r"shard-\d{5}\.(bin|idx|wts)")


def prepare_to_url(
    prepare_local: Callable[[Path], tuple[dict[str, Any], bool]],
    wanted: dict[str, Any],
    output: str,
    what: str,
) -> tuple[dict[str, Any], bool]:
    """`prepare` into a URL: `prepare_local(directory)` tokenizes into a local temporary
    directory, whose shards are then uploaded with manifest.json last. `wanted` is the output's
    identity (`kiln.data.manifest.identity_of`): a URL that holds it already is left as it is.
    The caller has checked that `output`'s filesystem is installed."""
    existing = up_to_date(output, wanted, what)
    if existing is not None:
        return existing, False
    # Shards without a manifest are what an interrupted upload leaves: they are removed.
    names = storage.listdir(output)
    others = [n for n in names if not _SHARD_FILE.fullmatch(n)]
    if others:
        raise KilnError(
            f"{what} {output}: exists and holds {others[0]!r}, so it is not empty or a kiln "
            "prepare output"
        )
    with temporary_directory("kiln-prepare-") as tmp:  # removed however the command ends
        local = tmp / "shards"
        manifest, _ = prepare_local(local)
        storage.make_dirs(output, what)
        for stale in names:
            storage.remove(f"{output}/{stale}", what)
        for entry in manifest["shards"]:
            for suffix in (".bin", ".idx", ".wts") if "wts_crc32" in entry else (".bin", ".idx"):
                shard = entry["name"] + suffix
                storage.upload(local / shard, f"{output}/{shard}", what)
        storage.upload(local / MANIFEST, f"{output}/{MANIFEST}", what)
    return manifest, True
