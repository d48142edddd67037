"""Training data: tokenizers, `kiln prepare` shards, and packed batches through grain.

Modules: `tokenizers`, `sources` (input files and URLs, the stdlib corpus), `chat` (chat and
prompt/completion records with loss weights), `prepare`, `manifest`, `upload` and `workers`
(`kiln prepare`), `corpus` and `remote_tokens` (reading shards), `pipeline`, `mixture` and
`synthetic` (packed batches), `resolve` (the config fields the data decides), `eval_tasks`
(eval task strings and their data). Nothing here imports JAX.

May import: `kiln.errors`, `kiln.util`. Config sections arrive as arguments, never imported:
the config layer sits above this one, since loading a config reads the data's tokenizer.

Public names: `make_datasets`, `Datasets`, `Batch`, `load_tokenizer`, `Tokenizer`,
`prepare.prepare`, `prepare.run_prepare`, `eval_tasks.parse_tasks`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.chat import record_format
from kiln.data.corpus import open_corpus, read_manifest, split_documents
from kiln.data.manifest import MANIFEST, DamagedShards
from kiln.data.mixture import MixedDatasets, SourceSplit, source_seed
from kiln.data.pipeline import Batch, Datasets, StreamWindows, SyntheticWindows
from kiln.data.prepare import decode_error_note, prepare
from kiln.data.resolve import rounded_vocab
from kiln.data.sources import check_regular, input_identity, resolve_inputs
from kiln.data.synthetic import markov_chain
from kiln.data.tokenizers import Tokenizer, load_tokenizer
from kiln.errors import KilnError
from kiln.util import storage
from kiln.util.humanize import plural

__all__ = [
    "Batch",
    "Datasets",
    "MixedDatasets",
    "Tokenizer",
    "cache_dir_for",
    "load_tokenizer",
    "make_datasets",
]


def make_datasets(config: Any) -> Datasets:
    """Datasets of this process for `config` (a kiln Config); tokenizes raw files into the
    cache on first use. Raises KilnError for bad paths, tokenizer or vocabulary size."""
    d = config.data
    if not d.sources and d.source == "none":
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
    notes: list[str] = []
    warnings: list[str] = []
    parts = [
        open_source(config, prefix, s, tokenizer, source_seed(d.seed, i), notes, warnings)
        for i, (prefix, s) in enumerate(d.mixture())
    ]
    if not d.sources:
        (one,) = parts
        return Datasets(
            tokenizer,
            one.train,
            one.held_out,
            entropy_rate=one.entropy_rate,
            inputs=one.inputs,
            notes=notes,
            warnings=warnings,
            **common,
        )
    _check_held_out_is_not_trained(parts)
    return MixedDatasets(
        tokenizer,
        [s.name for s in d.sources],
        [s.weight for s in d.sources],
        parts,
        notes=notes,
        warnings=warnings,
        **common,
    )


def open_source(
    config: Any,
    prefix: str,
    s: Any,
    tokenizer: Tokenizer,
    seed: int,
    notes: list[str],
    warnings: list[str],
) -> SourceSplit:
    """The train and held-out windows of one source `s` (data itself, or an entry of
    data.sources named by `prefix` in messages); `seed` makes synthetic tokens."""
    if s.source == "synthetic":
        v = tokenizer.vocab_size
        entropy = (
            markov_chain(v, seed).entropy_rate if s.synthetic_kind == "markov" else math.log(v)
        )
        train = SyntheticWindows(s.synthetic_kind, v, config.data.seq_len, seed, stream=0)
        held_out = SyntheticWindows(s.synthetic_kind, v, config.data.seq_len, seed, stream=1)
        return SourceSplit(train, held_out, seed, entropy_rate=entropy)

    batch = config.train.global_batch_size
    corpus, sources, identity = _open_source(
        config, s, s.paths, tokenizer, notes, warnings, f"{prefix}.paths"
    )
    if s.eval_paths:
        what = f"{prefix}.eval_paths"
        held_corpus, held_sources, _ = _open_source(
            config, s, s.eval_paths, tokenizer, notes, warnings, what
        )
        shared = sorted(set(sources) & set(held_sources), key=str)
        if shared:
            raise KilnError(
                f"{what}: {shared[0]} is also in {prefix}.paths (and "
                f"{plural(len(shared) - 1, 'more')}); allowed: inputs that are not trained on"
            )
        train_docs = np.arange(corpus.num_documents)
        eval_docs = np.arange(held_corpus.num_documents)
    else:
        held_corpus, held_sources = corpus, []
        train_docs, eval_docs = split_documents(corpus.num_documents, s.eval_fraction)
    ids = (config.data.seq_len, tokenizer.eos_id, tokenizer.pad_id)
    train = StreamWindows(corpus, train_docs, *ids, vocab_size=config.model.vocab_size)
    held_out = StreamWindows(held_corpus, eval_docs, *ids, vocab_size=config.model.vocab_size)
    if train.num_windows == 0:
        raise KilnError(
            f"{prefix}.paths: {s.paths} give {train.num_tokens} training tokens; at least 2 are "
            "needed"
        )
    if config.train.eval_every_steps > 0:
        if held_out.num_windows == 0:
            what = f"{prefix}.eval_paths" if s.eval_paths else f"{prefix}.eval_fraction"
            given = s.eval_paths if s.eval_paths else s.eval_fraction
            raise KilnError(
                f"{what}: {given} holds out no tokens of the {corpus.num_documents:,} documents; "
                f"{'give files with text' if s.eval_paths else 'raise it'} or set "
                "train.eval_every_steps: 0"
            )
        if held_out.num_windows < batch:
            warnings.append(small_eval_warning(held_out, batch, config.train.eval_batches, prefix))
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    inputs = {
        "corpus": {
            "files": len(identity) if s.source != "tokens" else sum(map(len, identity)),
            "digest": digest,
            "documents": corpus.num_documents,
            "tokens": corpus.num_tokens,
        },
        "split": {
            "eval_fraction": s.eval_fraction,
            "train_documents": train.num_documents,
            "eval_documents": held_out.num_documents,
        },
    }
    return SourceSplit(train, held_out, seed, inputs=inputs, trained=sources, held=held_sources)


def _check_held_out_is_not_trained(parts: list[SourceSplit]) -> None:
    """A file held out by one source's eval_paths must not train through another source."""
    trained = {f: i for i, part in enumerate(parts) for f in part.trained}
    for i, part in enumerate(parts):
        for f in part.held:
            if f in trained:
                raise KilnError(
                    f"data.sources.{i}.eval_paths: {f} is also in data.sources.{trained[f]}.paths; "
                    "allowed: inputs that no source trains on"
                )


def small_eval_warning(
    held_out: StreamWindows, batch: int, eval_batches: int, prefix: str = "data"
) -> str:
    """The held-out split fills less than one eval batch: its windows are repeated."""
    shown = eval_batches * batch
    whose = "" if prefix == "data" else f" of {prefix}"
    return (
        f"the held-out set{whose} is {plural(held_out.num_documents, 'document')} "
        f"({plural(held_out.num_tokens, 'token')}, {plural(held_out.num_windows, 'sequence')} of "
        f"data.seq_len), fewer than one eval batch of {plural(batch, 'sequence')}: each eval "
        f"repeats them to fill {plural(shown, 'row')}, so eval/loss rests on little data; raise "
        f"{prefix}.eval_fraction or name a held-out set with {prefix}.eval_paths"
    )


def _open_source(
    config: Any,
    s: Any,
    paths: list[str],
    tokenizer: Tokenizer,
    notes: list[str],
    warnings: list[str],
    what: str,
) -> tuple[Any, list[storage.Location], list]:
    """The corpus of `paths` (local paths or URLs) of source `s`, what it was read from, and its
    identity for `inputs.json`: prepared directories (source=tokens), or raw files, tokenized
    into the cache on first use (and again if the cache is damaged, with a warning)."""
    d = config.data
    if s.source == "tokens":
        dirs = [storage.location(p, what) for p in paths]
        if not dirs:
            raise KilnError(f"{what}: empty; source=tokens needs `kiln prepare` output directories")
        corpus = open_corpus(
            dirs, tokenizer, config.model.vocab_size, what=what, verify=d.verify_shards
        )
        where = [p if storage.is_remote(p) else p.resolve() for p in dirs]
        return corpus, where, [read_manifest(p)["shards"] for p in dirs]
    files = resolve_inputs(paths, what=what)
    check_regular(files, what)  # `kiln prepare --input` streams one once, e.g. /dev/stdin
    if not any(storage.size(f) for f in files):
        raise KilnError(f"{what}: {list(paths)} hold no text (every input file is empty)")
    cache = cache_dir_for(config, files, tokenizer, s)
    try:
        manifest, corpus = _tokenized(config, s, files, tokenizer, cache)
    except DamagedShards as e:  # kiln's own copy of the inputs: made again from them
        _discard(cache, e.reason)
        warnings.append(f"data.cache_dir: {cache} was damaged ({e.reason}); rebuilt it from {what}")
        manifest, corpus = _tokenized(config, s, files, tokenizer, cache)
    note = decode_error_note(manifest)
    if note:
        notes.append(f"{what}: {note}")
    identity = [(f["path"], f["size"]) for f in input_identity(files)]
    return corpus, [f.resolve() if isinstance(f, Path) else f for f in files], identity


def _tokenized(
    config: Any, s: Any, files: list[storage.Location], tokenizer: Tokenizer, cache: Path
) -> tuple[dict[str, Any], Any]:
    """The manifest and corpus of `cache`, tokenizing `files` into it unless it holds them;
    DamagedShards if what it holds is not what was written there."""
    if cache.is_dir() and any(cache.iterdir()) and not (cache / MANIFEST).is_file():
        raise DamagedShards(f"{cache}: no {MANIFEST}")  # published with one, in one rename
    manifest, _ = prepare(
        files,
        s.source,
        s.field,
        tokenizer,
        cache,
        progress=sys.stderr.isatty(),
        what="data.cache_dir",
        on_decode_error=s.on_decode_error,
        record_format=record_format(s.format, tokenizer, s.chat_template),
    )
    corpus = open_corpus(
        [cache],
        tokenizer,
        config.model.vocab_size,
        what="data.cache_dir",
        verify=config.data.verify_shards,
    )
    return manifest, corpus


def _discard(cache: Path, reason: str) -> None:
    """Remove a damaged cache directory: renamed aside in one step (so the cache is either the
    damaged directory or absent, never half-deleted), then deleted."""
    aside = cache.with_name(f".{cache.name}.damaged-{os.getpid()}")
    try:
        os.replace(cache, aside)
    except FileNotFoundError:
        return  # another process of the run got there first
    except OSError as e:
        raise KilnError(
            f"data.cache_dir: {cache} is damaged ({reason}) and cannot be rebuilt: "
            f"{e.strerror}; delete it, or set data.cache_dir to a directory kiln can write"
        ) from None
    shutil.rmtree(aside, ignore_errors=True)


def cache_dir_for(
    config: Any, files: list[storage.Location], tokenizer: Tokenizer, s: Any = None
) -> Path:
    """Where raw inputs of source `s` (default: data itself) are tokenized to: keyed by source,
    field, tokenizer and the (path, size, mtime) of every input file, so any change gives a
    fresh directory."""
    d = config.data
    s = d if s is None else s
    key = {
        "source": s.source,
        "field": None if s.source == "text" else s.field,
        "tokenizer": tokenizer.sha256,
        "inputs": input_identity(files),
    }
    if s.on_decode_error != "error":  # skipped or replaced inputs make other shards
        key["on_decode_error"] = s.on_decode_error
    fmt = record_format(s.format, tokenizer, s.chat_template)
    if fmt is not None:  # absent for text, so the caches of text runs keep their names
        key["record_format"] = fmt.identity()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(d.cache_dir) if d.cache_dir else config.local_output_dir / ".cache"
    return root.expanduser() / f"{s.source}-{digest}"


def _process_layout(config: Any) -> tuple[int, int]:
    """(process index, process count): from JAX when it discovers the cluster itself."""
    dist = config.distributed
    if dist.auto:
        import jax

        return jax.process_index(), jax.process_count()
    return dist.process_id, dist.num_processes
