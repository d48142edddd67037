"""`kiln prepare` into a URL (gs://, s3://, memory://, ...): tokenized into a local temporary
directory by `prepare`, then uploaded shard by shard with manifest.json last, so a store
without a manifest is an interrupted upload, never a valid output."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln import storage
from kiln.data.chat import RecordFormat
from kiln.data.prepare import MANIFEST, identity_of, prepare, up_to_date
from kiln.data.sources import OnDecodeError, input_identity
from kiln.data.tokenizers import Tokenizer
from kiln.errors import KilnError

_SHARD_FILE = re.compile(r"shard-\d{5}\.(bin|idx|wts)")


def prepare_to_url(
    files: Sequence[storage.Location],
    fmt: str,
    field: str,
    tokenizer: Tokenizer,
    output: str,
    workers: int | None,
    progress: bool,
    what: str,
    on_decode_error: OnDecodeError,
    record_format: RecordFormat | None,
) -> tuple[dict[str, Any], bool]:
    """`prepare` into a URL: tokenized locally, then uploaded with manifest.json last."""
    storage.filesystem(output, what)  # a missing backend is named before any work
    wanted = identity_of(
        fmt, field, tokenizer, input_identity(files), on_decode_error, record_format
    )
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
    with tempfile.TemporaryDirectory(prefix="kiln-prepare-") as tmp:
        local = Path(tmp) / "shards"
        manifest, _ = prepare(
            files,
            fmt,
            field,
            tokenizer,
            local,
            workers=workers,
            progress=progress,
            what=what,
            on_decode_error=on_decode_error,
            record_format=record_format,
        )
        storage.make_dirs(output, what)
        for stale in names:
            storage.remove(f"{output}/{stale}", what)
        for entry in manifest["shards"]:
            for suffix in (".bin", ".idx", ".wts") if "wts_crc32" in entry else (".bin", ".idx"):
                shard = entry["name"] + suffix
                storage.upload(local / shard, f"{output}/{shard}", what)
        storage.upload(local / MANIFEST, f"{output}/{MANIFEST}", what)
    return manifest, True
