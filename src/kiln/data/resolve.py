"""Config values that come from the data: `model.vocab_size: auto` and the tokenizer of shards."""

from __future__ import annotations

import math
from typing import Any

from kiln.data.corpus import read_manifest
from kiln.data.tokenizers import load_tokenizer
from kiln.errors import KilnError
from kiln.util import storage

VOCAB_MULTIPLE = 128  # embedding and head widths that tile evenly on TPU and GPU


def rounded_vocab(tokenizer_size: int) -> int:
    """The tokenizer's size rounded up to a multiple of VOCAB_MULTIPLE."""
    return VOCAB_MULTIPLE * math.ceil(tokenizer_size / VOCAB_MULTIPLE)


def manifest_tokenizer(paths: list[str]) -> str:
    """The tokenizer spec that `kiln prepare` recorded for the shard directories `paths`."""
    if not paths:
        raise KilnError("data.paths: empty; source=tokens needs `kiln prepare` output directories")
    specs = {p: read_manifest(storage.location(p))["tokenizer"].get("spec") for p in paths}
    if len(set(specs.values())) > 1:
        listed = ", ".join(f"{p}: {s!r}" for p, s in specs.items())
        raise KilnError(
            f"data.tokenizer: not given, and the shards were prepared with different "
            f"tokenizers ({listed}); allowed: shards of one tokenizer"
        )
    spec = next(iter(specs.values()))
    if not isinstance(spec, str):
        raise KilnError(f"{paths[0]}: its manifest.json names no tokenizer; set data.tokenizer")
    return spec


def resolve_data_fields(raw: dict[str, Any], config: Any) -> dict[str, Any] | None:
    """Updates to the nested config dict `raw` that fill in values derived from the data, or None.

    - data.tokenizer, for source=tokens (of any source of a mixture) when the config does not
      give it: the manifests'.
    - model.vocab_size: auto -> the tokenizer's size rounded up to a multiple of 128.
    """
    d = config.data
    updates: dict[str, dict[str, Any]] = {}
    tokenizer = d.tokenizer
    shards = [s for _, s in d.mixture() if s.source == "tokens"]
    if shards and "tokenizer" not in d.model_fields_set:
        tokenizer = manifest_tokenizer([p for s in shards for p in (*s.paths, *s.eval_paths)])
        if tokenizer != d.tokenizer:
            first = next(p for s in shards for p in (*s.paths, *s.eval_paths))
            where = f"the tokenizer recorded in {storage.join(storage.location(first), 'manifest.json')}"
            load_tokenizer(tokenizer, what=f"data.tokenizer ({where})")
            updates["data"] = {"tokenizer": tokenizer}
    if config.model.vocab_size == "auto":
        size = load_tokenizer(tokenizer).vocab_size
        updates["model"] = {"vocab_size": rounded_vocab(size)}
    if not updates:
        return None
    out = dict(raw)
    for section, fields in updates.items():
        out[section] = {**(out.get(section) or {}), **fields}
    return out
