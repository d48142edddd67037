"""Training data: tokenizers, `kiln prepare` shards, and packed batches through grain."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.chat import record_format
from kiln.data.corpus import open_corpus, read_manifest, split_documents
from kiln.data.pipeline import Batch, Datasets, StreamWindows, SyntheticWindows
from kiln.data.prepare import decode_error_note, prepare
from kiln.data.resolve import rounded_vocab
from kiln.data.sources import input_identity, resolve_inputs
from kiln.data.synthetic import markov_chain
from kiln.data.tokenizers import Tokenizer, load_tokenizer
from kiln.errors import KilnError
from kiln.humanize import plural

__all__ = ["Batch", "Datasets", "Tokenizer", "cache_dir_for", "load_tokenizer", "make_datasets"]


def make_datasets(config: Any) -> Datasets:
    """Datasets of this process for `config` (a kiln Config); tokenizes raw files into the
    cache on first use. Raises KilnError for bad paths, tokenizer or vocabulary size."""
    d = config.data
    if d.source == "none":
        raise KilnError(
            "data.source: 'none' (a config written by kiln import-hf names no training data); "
            "set data.source to text, jsonl, parquet, tokens or synthetic, and data.paths"
        )
    tokenizer = load_tokenizer(d.tokenizer)
    if config.model.vocab_size < tokenizer.vocab_size:
        raise KilnError(
            f"model.vocab_size: {config.model.vocab_size} is smaller than the "
            f"{tokenizer.vocab_size:,} tokens of data.tokenizer {d.tokenizer!r}; allowed: >= "
            f"{tokenizer.vocab_size:,}, or auto ({rounded_vocab(tokenizer.vocab_size):,}, a "
            "multiple of 128)"
        )
    index, count = _process_layout(config)
    batch = config.train.global_batch_size
    if batch % count:
        raise KilnError(
            f"train.global_batch_size: {batch} is not divisible by the {count} processes"
        )
    common = {
        "global_batch_size": batch,
        "process_index": index,
        "process_count": count,
        "seed": d.seed,
        "prefetch_batches": d.prefetch_batches,
    }
    if d.source == "synthetic":
        v, seed = tokenizer.vocab_size, d.seed % 2**32
        entropy = (
            markov_chain(v, seed).entropy_rate if d.synthetic_kind == "markov" else math.log(v)
        )
        train = SyntheticWindows(d.synthetic_kind, v, d.seq_len, seed, stream=0)
        held_out = SyntheticWindows(d.synthetic_kind, v, d.seq_len, seed, stream=1)
        return Datasets(tokenizer, train, held_out, entropy_rate=entropy, **common)

    notes: list[str] = []
    corpus, sources, identity = _open_source(config, d.paths, tokenizer, notes)
    if d.eval_paths:
        held_corpus, held_sources, _ = _open_source(
            config, d.eval_paths, tokenizer, notes, what="data.eval_paths"
        )
        shared = sorted(set(sources) & set(held_sources))
        if shared:
            raise KilnError(
                f"data.eval_paths: {shared[0]} is also in data.paths (and "
                f"{plural(len(shared) - 1, 'more')}); allowed: inputs that are not trained on"
            )
        train_docs = np.arange(corpus.num_documents)
        eval_docs = np.arange(held_corpus.num_documents)
    else:
        held_corpus = corpus
        train_docs, eval_docs = split_documents(corpus.num_documents, d.eval_fraction)
    ids = (d.seq_len, tokenizer.eos_id, tokenizer.pad_id)
    train = StreamWindows(corpus, train_docs, *ids, vocab_size=config.model.vocab_size)
    held_out = StreamWindows(held_corpus, eval_docs, *ids, vocab_size=config.model.vocab_size)
    if train.num_windows == 0:
        raise KilnError(
            f"data.paths: {d.paths} give {train.num_tokens} training tokens; at least 2 are needed"
        )
    warnings = []
    if config.train.eval_every_steps > 0:
        if held_out.num_windows == 0:
            what = "data.eval_paths" if d.eval_paths else "data.eval_fraction"
            given = d.eval_paths if d.eval_paths else d.eval_fraction
            raise KilnError(
                f"{what}: {given} holds out no tokens of the {corpus.num_documents:,} documents; "
                f"{'give files with text' if d.eval_paths else 'raise it'} or set "
                "train.eval_every_steps: 0"
            )
        if held_out.num_windows < batch:
            warnings.append(small_eval_warning(held_out, batch, config.train.eval_batches))
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    inputs = {
        "corpus": {
            "files": len(identity) if d.source != "tokens" else sum(map(len, identity)),
            "digest": digest,
            "documents": corpus.num_documents,
            "tokens": corpus.num_tokens,
        },
        "split": {
            "eval_fraction": d.eval_fraction,
            "train_documents": train.num_documents,
            "eval_documents": held_out.num_documents,
        },
    }
    return Datasets(
        tokenizer, train, held_out, inputs=inputs, notes=notes, warnings=warnings, **common
    )


def small_eval_warning(held_out: StreamWindows, batch: int, eval_batches: int) -> str:
    """The held-out split fills less than one eval batch: its windows are repeated."""
    shown = eval_batches * batch
    return (
        f"the held-out set is {plural(held_out.num_documents, 'document')} "
        f"({plural(held_out.num_tokens, 'token')}, {plural(held_out.num_windows, 'sequence')} of "
        f"data.seq_len), fewer than one eval batch of {plural(batch, 'sequence')}: each eval "
        f"repeats them to fill {plural(shown, 'row')}, so eval/loss rests on little data; raise "
        "data.eval_fraction or name a held-out set with data.eval_paths"
    )


def _open_source(
    config: Any, paths: list[str], tokenizer: Tokenizer, notes: list[str], what="data.paths"
) -> tuple[Any, list[Path], list]:
    """The corpus of `paths`, what it was read from, and its identity for `inputs.json`:
    prepared directories (source=tokens), or raw files, tokenized into the cache on first use."""
    d = config.data
    if d.source == "tokens":
        dirs = [Path(p).expanduser() for p in paths]
        if not dirs:
            raise KilnError(f"{what}: empty; source=tokens needs `kiln prepare` output directories")
        corpus = open_corpus(
            dirs, tokenizer, config.model.vocab_size, what=what, verify=d.verify_shards
        )
        return corpus, [p.resolve() for p in dirs], [read_manifest(p)["shards"] for p in dirs]
    files = resolve_inputs(paths, what=what)
    # A FIFO or device would block or never end, and its (size, mtime) cannot key the
    # cache (`kiln prepare --input` streams one once, e.g. /dev/stdin).
    for f in files:
        if not f.is_file():
            raise KilnError(
                f"{what}: {str(f)!r} is not a regular file (a FIFO, socket or device); "
                "allowed: files, directories, globs, stdlib:GLOB"
            )
    if not any(f.stat().st_size for f in files):
        raise KilnError(f"{what}: {list(paths)} hold no text (every input file is empty)")
    fmt = record_format(d.format, tokenizer, d.chat_template)
    cache = cache_dir_for(config, files, tokenizer)
    manifest, _ = prepare(
        files,
        d.source,
        d.field,
        tokenizer,
        cache,
        progress=sys.stderr.isatty(),
        what="data.cache_dir",
        on_decode_error=d.on_decode_error,
        record_format=fmt,
    )
    note = decode_error_note(manifest)
    if note:
        notes.append(f"{what}: {note}")
    corpus = open_corpus(
        [cache], tokenizer, config.model.vocab_size, what="data.cache_dir", verify=d.verify_shards
    )
    identity = [(f["path"], f["size"]) for f in input_identity(files)]
    return corpus, [f.resolve() for f in files], identity


def cache_dir_for(config: Any, files: list[Path], tokenizer: Tokenizer) -> Path:
    """Where raw inputs are tokenized to: keyed by source, field, tokenizer and the
    (path, size, mtime) of every input file, so any change gives a fresh directory."""
    d = config.data
    key = {
        "source": d.source,
        "field": None if d.source == "text" else d.field,
        "tokenizer": tokenizer.sha256,
        "inputs": input_identity(files),
    }
    if d.on_decode_error != "error":  # skipped or replaced inputs make other shards
        key["on_decode_error"] = d.on_decode_error
    fmt = record_format(d.format, tokenizer, d.chat_template)
    if fmt is not None:  # absent for text, so the caches of text runs keep their names
        key["record_format"] = fmt.identity()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(d.cache_dir) if d.cache_dir else Path(config.train.output_dir) / ".cache"
    return root.expanduser() / f"{d.source}-{digest}"


def _process_layout(config: Any) -> tuple[int, int]:
    """(process index, process count): from JAX when it discovers the cluster itself."""
    dist = config.distributed
    if dist.auto:
        import jax

        return jax.process_index(), jax.process_count()
    return dist.process_id, dist.num_processes
