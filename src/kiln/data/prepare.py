"""`kiln prepare`: raw text/JSONL/Parquet -> token shards (numpy .bin + document offsets) + manifest.

Layout of an output directory:
  shard-00000.bin   tokens of the shard's documents, each followed by EOS (uint16 or uint32)
  shard-00000.idx   int64 document offsets into the .bin, num_documents + 1 entries
  shard-00000.wts   chat and prompt/completion records only: one uint8 loss weight (0 or 1)
                    per token of the .bin, the weight of predicting that token
  manifest.json     written last: tokenizer identity, dtype, counts, shards, input files

Text shards are manifest version 1; shards with loss weights are version 2, so a kiln that
knows only version 1 refuses them instead of training on prompts it would not know to mask.

Everything is written into a hidden staging directory next to the output and renamed into
place in one step once the manifest is in it, so an interrupted run leaves nothing that looks
like a valid output (a killed run's staging directory is removed by the next run on the host).
An output URL (gs://, s3://, memory://, ...) is prepared in a local temporary directory and
uploaded, shards first and the manifest last, so the same holds there. Re-running with the
same inputs (path, size, mtime or a URL's version tag) and tokenizer is a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import shutil
import socket
import sys
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data import chat
from kiln.data.chat import RecordFormat, encode_records, eos_weight
from kiln.data.manifest import MANIFEST, identity_of, up_to_date
from kiln.data.sources import (
    OnDecodeError,
    Task,
    default_workers,
    input_identity,
    plan_tasks,
    read_documents,
    resolve_inputs,
)
from kiln.data.tokenizers import Tokenizer, load_tokenizer
from kiln.data.upload import prepare_to_url
from kiln.data.workers import signals_as_interrupt, worker_pool
from kiln.errors import KilnError, write_error
from kiln.util import storage
from kiln.util.files import check_creatable, pid_alive, write_array
from kiln.util.humanize import plural

_MIN_TASK_BYTES = 64 << 10
_MAX_TASK_BYTES = 64 << 20
# Below this much input a pool of processes costs more (start-up, imports) than it saves.
_SERIAL_BYTES = 8 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def prepare(
    files: Sequence[storage.Location],
    fmt: str,
    field: str,
    tokenizer: Tokenizer,
    output: storage.Location,
    *,
    workers: int | None = None,
    progress: bool = False,
    what: str = "--output",
    on_decode_error: OnDecodeError = "error",
    record_format: RecordFormat | None = None,
) -> tuple[dict[str, Any], bool]:
    """Tokenize `files` into shards under `output`; returns (manifest, whether work was done).

    workers: parallel workers; None = every core, or one for inputs under 8 MB.
    on_decode_error: what a text file or JSONL line that is not UTF-8 does (data.on_decode_error).
    record_format: JSONL records as chat or prompt/completion, with loss weights (data.format).
    """
    remote = storage.is_remote(output)
    if remote:
        storage.filesystem(str(output), what)  # a missing backend is named before any work
    inputs = input_identity(files)
    wanted = identity_of(fmt, field, tokenizer, inputs, on_decode_error, record_format)
    write = functools.partial(
        _write_shards, files, inputs, wanted, fmt, field, tokenizer, workers, progress, what,
        on_decode_error, record_format,
    )  # fmt: skip
    if remote:  # into a local temporary directory, then uploaded
        return prepare_to_url(write, wanted, str(output), what)
    return write(Path(output).absolute())


def _write_shards(
    files: Sequence[storage.Location],
    inputs: list[dict[str, Any]],
    wanted: dict[str, Any],
    fmt: str,
    field: str,
    tokenizer: Tokenizer,
    workers: int | None,
    progress: bool,
    what: str,
    on_decode_error: OnDecodeError,
    record_format: RecordFormat | None,
    output: Path,
) -> tuple[dict[str, Any], bool]:
    """`prepare` into the local directory `output`; `wanted` is the inputs' identity."""
    existing = up_to_date(output, wanted, what)
    if existing is not None:
        return existing, False
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise KilnError(
            f"{what} {output}: exists and is not an empty directory or a kiln prepare output"
        )
    check_creatable(output, what, beside=True)  # staged next to it: before any input is read
    total = sum(i["size"] for i in inputs)
    if workers is None:
        workers = 1 if total < _SERIAL_BYTES else default_workers()
    target = int(np.clip(total // (4 * workers), _MIN_TASK_BYTES, _MAX_TASK_BYTES))
    tasks = plan_tasks(fmt, files, [i["size"] for i in inputs], target)
    workers = max(1, min(workers, len(tasks)))

    # Directories this call makes, deepest first: removed again if it fails (a bad record
    # leaves nothing behind, not even an empty cache directory).
    made = [p for p in (output.parent, *output.parent.parents) if not p.exists()]
    staging = output.parent / f".{output.name}.partial-{socket.gethostname()}-{os.getpid()}"
    start = time.perf_counter()
    with signals_as_interrupt():
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_staging(output)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            shards = _run(
                tasks,
                (field, tokenizer.spec, str(staging), on_decode_error, record_format),
                staging,
                workers,
                progress,
                total,
            )
            manifest = {
                **wanted,
                "dtype": token_dtype(tokenizer.vocab_size).name,
                "documents_end_with_eos": True,
                "max_token_id": max((s["max_token_id"] for s in shards), default=-1),
                "num_tokens": sum(s["num_tokens"] for s in shards),
                "num_documents": sum(s["num_documents"] for s in shards),
                **_scored(shards, record_format),
                "num_input_bytes": total,
                "decode_errors": _decode_errors(shards),
                "seconds": round(time.perf_counter() - start, 3),
                "workers": workers,
                "shards": shards,
            }
            _write_json(staging / MANIFEST, manifest)
            _publish(staging, output)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            if isinstance(e, OSError):  # inputs are read through KilnErrors: a failed write
                raise write_error(e, output, then="prepare it") from None
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):
        return json.loads((output / MANIFEST).read_text()), True
    return manifest, True


def _scored(shards: list[dict[str, Any]], record_format: RecordFormat | None) -> dict[str, int]:
    """Tokens with loss weight 1, for manifests of weighted shards."""
    if record_format is None:
        return {}
    return {"num_scored_tokens": sum(s["num_scored_tokens"] for s in shards)}


def _decode_errors(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Inputs of all shards that were not UTF-8: how many were skipped or replaced, the first."""
    firsts = [s["decode_errors"]["first"] for s in shards if s["decode_errors"]["first"]]
    return {
        "skipped": sum(s["decode_errors"]["skipped"] for s in shards),
        "replaced": sum(s["decode_errors"]["replaced"] for s in shards),
        "first": firsts[0] if firsts else None,
    }


def decode_error_note(manifest: dict[str, Any]) -> str | None:
    """One line on the inputs that were not UTF-8, or None when there were none."""
    errors = manifest.get("decode_errors") or {}
    for verb in ("skipped", "replaced"):
        if n := errors.get(verb, 0):
            return (
                f"{verb} {plural(n, 'input')} that {'is' if n == 1 else 'are'} not UTF-8 "
                f"(on_decode_error: {manifest.get('on_decode_error')}; the first: "
                f"{errors.get('first')})"
            )
    return None


def _remove_stale_staging(output: Path) -> None:
    """Delete staging directories that killed runs on this host left behind."""
    prefix = f".{output.name}.partial-{socket.gethostname()}-"
    for path in output.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name.removeprefix(prefix)
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _publish(staging: Path, output: Path) -> None:
    """Move the finished staging directory to `output` in one rename."""
    try:
        os.replace(staging, output)
    except OSError:
        # Another process (e.g. a second host preparing the same cache) got there first.
        if not (output / MANIFEST).is_file():
            raise


def _run(
    tasks: list[Task],
    common: tuple,
    staging: Path,
    workers: int,
    progress: bool,
    total_bytes: int,
) -> list[dict[str, Any]]:
    """Every task tokenized (`_tokenize_task(task, name, *common)`); their manifest entries."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    jobs = [(t, f"shard-{i:05d}", *common) for i, t in enumerate(tasks)]
    # Built now, started (with its refresh thread) only once the workers exist: see worker_pool.
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        disable=not progress,
        transient=True,
    )
    done = bar.add_task("tokenizing", total=total_bytes)
    if workers == 1:
        with bar:
            results = []
            for task, job in zip(tasks, jobs):
                results.append(_tokenize_task(*job))
                bar.advance(done, task.num_bytes)
            return results
    results = [{} for _ in tasks]
    with worker_pool(workers, _tokenize_task, jobs) as futures, bar:
        index = {fut: i for i, fut in enumerate(futures)}
        for fut in as_completed(futures):
            results[index[fut]] = fut.result()
            bar.advance(done, tasks[index[fut]].num_bytes)
    return results


def _tokenize_task(
    task: Task,
    name: str,
    field: str,
    spec: str,
    staging: str,
    on_decode_error: OnDecodeError,
    record_format: RecordFormat | None,
) -> dict[str, Any]:
    """Read, tokenize and write one shard; returns its manifest entry."""
    tokenizer = load_tokenizer(spec)
    dtype = token_dtype(tokenizer.vocab_size)
    doc_weights = None
    if record_format is None:
        docs, errors = read_documents(task, field, tokenizer.kind == "byte", on_decode_error)
        encoded = tokenizer.encode_batch(docs) if docs else []
    else:
        encoded, doc_weights, errors = encode_records(
            task, record_format, tokenizer, on_decode_error
        )
    lengths = np.fromiter((len(e) + 1 for e in encoded), np.int64, len(encoded))
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype)
    for e, a, b in zip(encoded, offsets[:-1], offsets[1:]):
        tokens[a : b - 1] = e
        tokens[b - 1] = tokenizer.eos_id
    write_array(Path(staging) / f"{name}.bin", tokens)
    write_array(Path(staging) / f"{name}.idx", offsets)
    weighted = {}
    if doc_weights is not None:
        weights = np.empty(len(tokens), np.uint8)
        for w, a, b in zip(doc_weights, offsets[:-1], offsets[1:]):
            weights[a : b - 1] = w
            weights[b - 1] = eos_weight(record_format)
        write_array(Path(staging) / f"{name}.wts", weights)
        weighted = {
            "wts_crc32": f"{zlib.crc32(weights):08x}",
            "num_scored_tokens": int(weights.sum(dtype=np.int64)),
        }
    return {
        "name": name,
        # Checked when the shard is opened: bytes damaged after prepare are refused.
        "bin_crc32": f"{zlib.crc32(tokens):08x}",
        "idx_crc32": f"{zlib.crc32(offsets):08x}",
        "max_token_id": int(tokens.max()) if len(tokens) else -1,
        "num_tokens": int(offsets[-1]),
        "num_documents": len(encoded),
        "inputs": list(task.paths),
        "decode_errors": asdict(errors),
        **weighted,
    }


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def run_prepare(
    patterns: Sequence[str],
    fmt: str,
    field: str,
    tokenizer_spec: str,
    output: str,
    workers: int | None = None,
    on_decode_error: OnDecodeError = "error",
    record_kind: str = "text",
    chat_template: str | None = None,
) -> str:
    """`kiln prepare`: resolve inputs, tokenize (progress bar on a terminal); a summary line.
    record_kind / chat_template: --record-format and the file named by --chat-template."""
    if record_kind != "text" and fmt != "jsonl":
        raise KilnError(
            f"--record-format: {record_kind!r} reads JSONL records, but --format is {fmt!r}; "
            "allowed: --format jsonl"
        )
    if chat_template is not None and record_kind != "chat":
        raise KilnError("--chat-template: given without --record-format chat")
    files = resolve_inputs(patterns, what="--input")
    tokenizer = load_tokenizer(tokenizer_spec, what="--tokenizer")
    template = None
    if chat_template is not None:
        try:
            template = Path(chat_template).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise KilnError(f"--chat-template: cannot read {chat_template!r} ({e})") from None
    record_format = chat.record_format(
        record_kind,
        tokenizer,
        template,
        what=chat_template or "--chat-template",
        kind_field="--record-format",
    )
    start = time.perf_counter()
    manifest, did_work = prepare(
        files,
        fmt,
        field,
        tokenizer,
        storage.location(output, "--output"),
        workers=workers,
        progress=sys.stderr.isatty(),
        on_decode_error=on_decode_error,
        record_format=record_format,
    )
    counts = (
        f"{plural(manifest['num_documents'], 'document')}, "
        f"{plural(manifest['num_tokens'], 'token')} ({manifest['dtype']}) from "
        f"{plural(len(files), 'file')}"
    )
    if "num_scored_tokens" in manifest:
        counts += f", {plural(manifest['num_scored_tokens'], 'token')} with loss weight 1"
    note = decode_error_note(manifest)
    counts += f"; {note}" if note else ""
    if not did_work:
        return f"{output}: up to date ({counts})"
    seconds = time.perf_counter() - start
    mb = manifest["num_input_bytes"] / 1e6
    return (
        f"{output}: {counts}, {mb:,.1f} MB in {seconds:.1f} s "
        f"({mb / seconds:,.1f} MB/s with {plural(manifest['workers'], 'worker')})"
    )
