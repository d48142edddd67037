"""A prepared output's manifest.json: the identity of what it was prepared from (inputs,
tokenizer, format), and whether an output already holds exactly that."""

from __future__ import annotations

import json
from typing import Any

from kiln.data.chat import RecordFormat
from kiln.data.tokenizers import Tokenizer, identity
from kiln.errors import KilnError
from kiln.util import storage

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2  # the newest this kiln writes (with loss weights)
READ_VERSIONS = (1, 2)  # 1: tokens only, every token a target; 2: may carry .wts weights


class DamagedShards(KilnError):
    """Prepared shards whose files are not what `kiln prepare` wrote (sizes, checksums,
    manifest); `reason` says what is wrong without advice, for a cache that kiln rebuilds."""

    def __init__(self, reason: str, advice: str = "the shard is damaged, re-run kiln prepare"):
        super().__init__(f"{reason}; {advice}")
        self.reason = reason


def identity_of(
    fmt: str,
    field: str,
    tokenizer: Tokenizer,
    inputs: list,
    on_decode_error: str,
    record_format: RecordFormat | None = None,
) -> dict[str, Any]:
    out = {
        "version": 1 if record_format is None else MANIFEST_VERSION,
        "format": fmt,
        "field": None if fmt == "text" else field,
        "tokenizer": identity(tokenizer),
        "inputs": inputs,
    }
    if on_decode_error != "error":  # absent for the default, so older outputs stay up to date
        out["on_decode_error"] = on_decode_error
    if record_format is not None:
        out["record_format"] = record_format.identity()
    return out


def up_to_date(output: storage.Location, wanted: dict[str, Any], what: str) -> dict | None:
    """The manifest of `output` when it was prepared as `wanted`, None when there is none;
    KilnError when it holds shards of other inputs or another tokenizer."""
    existing = existing_manifest(output)
    if existing is None:
        return None
    if not existing:
        raise DamagedShards(
            f"{what} {output}: its {MANIFEST} is unreadable or not JSON",
            "choose a new directory or delete it",
        )
    if {k: existing.get(k) for k in wanted} == wanted:
        return existing
    raise KilnError(
        f"{what} {output}: already holds shards prepared from other inputs or another "
        "tokenizer (its manifest.json differs); choose a new directory or delete it"
    )


def existing_manifest(output: storage.Location) -> dict[str, Any] | None:
    path = storage.join(output, MANIFEST)
    if not storage.is_file(path):
        return None
    try:
        return json.loads(storage.read_bytes(path))
    except (KilnError, ValueError):
        return {}
