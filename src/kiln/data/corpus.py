"""Reading prepared shards: manifest checks, memory-mapped tokens (or ranges read from a URL),
the document table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.data.manifest import MANIFEST, READ_VERSIONS, DamagedShards
from kiln.data.remote_tokens import RemoteTokens, crc32_of_url
from kiln.data.tokenizers import Tokenizer
from kiln.errors import KilnError
from kiln.util import storage
from kiln.util.checksums import crc32_of


@dataclass(frozen=True)
class Corpus:
    """Documents (each ending in EOS) spread over memory-mapped shards.

    shards: one 1-D token memmap per shard (RemoteTokens for a URL); paths: their .bin files.
    doc_shard, doc_start, doc_len: [num_documents] shard index, offset in it, length.
    weights: per shard, a uint8 memmap of loss weights beside its tokens (chat and
    prompt/completion shards), or None (every token weighs 1); None = no shard has them.
    """

    shards: list[np.ndarray | RemoteTokens]
    paths: list[storage.Location]
    doc_shard: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    weights: list[np.ndarray | None] | None = None

    @property
    def num_documents(self) -> int:
        return len(self.doc_len)

    @property
    def num_tokens(self) -> int:
        return int(self.doc_len.sum())


def open_corpus(
    dirs: Sequence[storage.Location],
    tokenizer: Tokenizer,
    vocab_size: int,
    what: str = "data.paths",
    *,
    verify: bool = True,
) -> Corpus:
    """Open one or more `kiln prepare` outputs as one corpus; checks they match `tokenizer`,
    that every token id is below `vocab_size` (model.vocab_size) and, with `verify`, that each
    shard's bytes have the CRC-32 its manifest records (manifests before checksums: sizes only)."""
    shards: list[np.ndarray | RemoteTokens] = []
    paths: list[storage.Location] = []
    doc_shard, doc_start, doc_len = [], [], []
    weights: list[np.ndarray | None] = []
    for d in dirs:
        manifest = read_manifest(d, what)
        _check_tokenizer(storage.join(d, MANIFEST), manifest, tokenizer)
        dtype = np.dtype(manifest["dtype"])
        for entry in manifest["shards"]:
            tokens, offsets = _open_shard(d, entry, dtype, verify)
            paths.append(storage.join(d, f"{entry['name']}.bin"))
            _check_ids(paths[-1], tokens, entry, vocab_size)
            n = len(offsets) - 1
            doc_shard.append(np.full(n, len(shards), np.int32))
            doc_start.append(offsets[:-1])
            doc_len.append(np.diff(offsets))
            shards.append(tokens)
            weights.append(_open_weights(d, entry, len(tokens), verify))
    if not shards or not sum(len(s) for s in shards):
        raise KilnError(f"{what}: {[str(d) for d in dirs]} hold no tokens")
    return Corpus(
        shards,
        paths,
        np.concatenate(doc_shard),
        np.concatenate(doc_start),
        np.concatenate(doc_len),
        weights if any(w is not None for w in weights) else None,
    )


def read_manifest(d: storage.Location, what: str = "data.paths") -> dict[str, Any]:
    """The manifest.json of a prepared directory (a path or URL), checked for the fields the
    reader needs."""
    if storage.is_remote(d):
        storage.filesystem(str(d), what)  # a missing backend named with the field
    path = storage.join(d, MANIFEST)
    if not storage.is_file(path):
        hint = "" if storage.is_dir(d) else " (no such directory)"
        raise KilnError(
            f"{what}: {path} not found{hint}; source=tokens needs directories written by `kiln prepare`"
        )
    try:
        manifest = json.loads(storage.read_bytes(path))
    except (KilnError, ValueError) as e:
        raise DamagedShards(
            f"{path}: unreadable or not JSON ({e})", "re-run kiln prepare"
        ) from None
    needed = ("version", "tokenizer", "dtype", "shards")
    if not isinstance(manifest, dict) or any(k not in manifest for k in needed):
        raise DamagedShards(
            f"{path}: not a kiln manifest (needs {', '.join(needed)})", "re-run kiln prepare"
        )
    if manifest["version"] not in READ_VERSIONS:
        raise KilnError(
            f"{path}: manifest version {manifest['version']!r}; this kiln reads versions "
            f"{', '.join(map(str, READ_VERSIONS))} (re-run kiln prepare)"
        )
    return manifest


def _check_tokenizer(
    path: storage.Location, manifest: dict[str, Any], tokenizer: Tokenizer
) -> None:
    theirs = manifest["tokenizer"]
    if theirs.get("sha256") != tokenizer.sha256 or theirs.get("eos_id") != tokenizer.eos_id:
        raise KilnError(
            f"{path}: shards were tokenized with {theirs.get('spec')!r} "
            f"(sha256 {str(theirs.get('sha256'))[:12]}), but data.tokenizer is {tokenizer.spec!r} "
            f"(sha256 {tokenizer.sha256[:12]}); set data.tokenizer to the one used by kiln prepare"
        )


def _open_shard(
    d: storage.Location, entry: dict[str, Any], dtype: np.dtype, verify: bool
) -> tuple[np.ndarray | RemoteTokens, np.ndarray]:
    remote = storage.is_remote(d)
    bin_path = storage.join(d, f"{entry['name']}.bin")
    idx_path = storage.join(d, f"{entry['name']}.idx")
    n_tok, n_doc = int(entry["num_tokens"]), int(entry["num_documents"])
    for path, expect, kind in (
        (bin_path, n_tok * dtype.itemsize, "bin"),
        (idx_path, (n_doc + 1) * 8, "idx"),
    ):
        try:
            size = storage.size(path)
        except KilnError as e:
            raise DamagedShards(str(e)) from None
        if size != expect:
            raise DamagedShards(f"{path}: {size} bytes, the manifest says {expect}")
        want = entry.get(f"{kind}_crc32")
        crc = crc32_of_url if remote else crc32_of
        if verify and want is not None and f"{crc(path):08x}" != want:
            raise DamagedShards(
                f"{path}: its bytes do not match the CRC-32 in {storage.join(d, MANIFEST)}"
            )
    offsets = np.frombuffer(storage.read_bytes(idx_path), np.int64)
    if offsets[0] != 0 or offsets[-1] != n_tok or np.any(np.diff(offsets) <= 0):
        raise DamagedShards(f"{idx_path}: document offsets are inconsistent")
    if not n_tok:
        return np.zeros(0, dtype), offsets
    if remote:
        return RemoteTokens(str(bin_path), dtype, n_tok), offsets
    return np.memmap(bin_path, dtype, mode="r"), offsets


def _open_weights(d: storage.Location, entry: dict[str, Any], num_tokens: int, verify: bool):
    """The .wts loss weights of a shard whose manifest entry records them, else None."""
    want = entry.get("wts_crc32")
    if want is None:
        return None
    path = storage.join(d, f"{entry['name']}.wts")
    remote = storage.is_remote(d)
    try:
        size = storage.size(path)
    except KilnError as e:
        raise DamagedShards(str(e)) from None
    if size != num_tokens:
        raise DamagedShards(f"{path}: {size} bytes, one loss weight per token needs {num_tokens}")
    crc = crc32_of_url if remote else crc32_of
    if verify and f"{crc(path):08x}" != want:
        raise DamagedShards(
            f"{path}: its bytes do not match the CRC-32 in {storage.join(d, MANIFEST)}"
        )
    if not num_tokens:
        return np.zeros(0, np.uint8)
    if remote:
        return RemoteTokens(str(path), np.dtype(np.uint8), num_tokens)
    return np.memmap(path, np.uint8, mode="r")


def _check_ids(
    path: storage.Location,
    tokens: np.ndarray | RemoteTokens,
    entry: dict[str, Any],
    vocab_size: int,
) -> None:
    """Refuse a shard whose manifest entry records an id >= vocab_size; shards of older
    manifests, which lack the record, are scanned here."""
    top = entry.get("max_token_id")
    if not isinstance(top, int):
        top = max((int(c.max()) for c in _chunks(tokens)), default=-1)
    if top >= vocab_size:
        raise token_id_error(path, top, vocab_size)


def token_id_error(path: storage.Location, token: int, vocab_size: int) -> KilnError:
    """A shard holds `token` >= model.vocab_size: found at open time or in a batch being read."""
    return DamagedShards(
        f"{path}: holds token id {token}, but model.vocab_size is {vocab_size}",
        "allowed: ids below it (the shard is damaged or was prepared for another vocabulary; "
        "re-run kiln prepare with data.tokenizer)",
    )


def _chunks(tokens: np.ndarray | RemoteTokens, size: int = 1 << 26):
    for start in range(0, len(tokens), size):
        yield tokens[start : start + size]


def split_documents(num_documents: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document indices, each sorted: ceil(fraction * n) held out (at least one
    document stays for training), chosen by a fixed permutation so the split never depends on
    data.seed and a held-out document is never trained on by any run of the same corpus."""
    n_eval = (
        0
        if eval_fraction == 0
        else min(int(np.ceil(eval_fraction * num_documents)), num_documents - 1)
    )
    order = np.random.default_rng(20240601).permutation(num_documents)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])
