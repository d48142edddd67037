"""What a store of `kiln teacher-logits` was written for, and its checks against a student's config.

The manifest records everything the stored rows depend on: the teacher (run, step, soft-cap),
the token stream (the data section, the corpus it resolved to, the tokenizer), the batch layout
(global batch, sequence length), how many steps it covers, the vocabulary, k, the dtype and
the temperature of its log-sum-exps. A student whose config differs in any of them would read
rows that are not its batches' teacher outputs, so it is refused (exit 2, the field named).
The gradient accumulation layout needs no record: the store is indexed by global row, and the
student's step cuts the global batch into micro-batches itself.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kiln.config import Config
from kiln.distill.store import FIELD, VERSION, first_difference
from kiln.errors import KilnError
from kiln.util import storage

# Fields of the data section that do not change the training stream.
_NOT_STREAM = ("prefetch_batches", "cache_dir", "verify_shards", "eval_paths", "tokenizer")


def teacher_identity(given: str) -> str:
    """How a store names its teacher run: the resolved local path, or the URL as given."""
    if storage.is_remote(storage.location(given)):
        return given.rstrip("/")
    return str(Path(storage.location(given)).expanduser().resolve())


def data_record(config: Config, datasets) -> dict[str, Any]:
    """The token stream of a config: data fields, resolved corpus and split, tokenizer."""
    data = {k: v for k, v in config.data.model_dump(mode="json").items() if k not in _NOT_STREAM}
    record = {
        "data": data,
        "inputs": datasets.inputs,
        "tokenizer": {"spec": datasets.tokenizer.spec, "sha256": datasets.tokenizer.sha256},
    }
    record["data_hash"] = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    return record


def describe(
    config: Config,
    datasets,
    teacher: dict[str, Any],
    *,
    top_k: int,
    dtype: str,
    shard_steps: int,
    writers: int,
) -> dict[str, Any]:
    """The manifest of a store of `config`'s stream; `teacher` = run_dir, step, logit_softcap."""
    return {
        "version": VERSION,
        "teacher": teacher,
        **data_record(config, datasets),
        "seq_len": config.data.seq_len,
        "global_batch_size": config.train.global_batch_size,
        "steps": config.train.steps,
        "vocab_size": config.model.vocab_size,
        "top_k": top_k,
        "dtype": dtype,
        "temperature": config.distillation.temperature,
        "shard_steps": shard_steps,
        "writer_processes": writers,
    }


def check_constant_temperature(config: Config, stored: float | None = None) -> None:
    """The soft loss runs at one temperature, `stored` if given (the store's); else KilnError."""
    dist = config.distillation
    moving = dist.schedule != "constant" and dist.temperature_end not in (None, dist.temperature)
    if moving:
        raise KilnError(
            f"distillation.temperature_end: {dist.temperature_end} moves the temperature from "
            f"{dist.temperature} during the run (schedule {dist.schedule}); offline teacher "
            "logits hold log-sum-exps at one temperature; allowed: temperature_end null or "
            f"{dist.temperature}, or schedule constant"
        )
    if stored is not None and dist.temperature != stored:
        raise KilnError(
            f"distillation.temperature: {dist.temperature}, but the store in "
            f"{dist.teacher_logits_dir} was written at temperature {stored}; allowed: {stored} "
            "(or write a store at this temperature)"
        )


def check_config(config: Config, manifest: dict[str, Any]) -> None:
    """The student's config against the store, before any data is read; KilnError naming the field."""
    directory = config.distillation.teacher_logits_dir
    if config.distillation.layer_map:
        raise KilnError(
            f"distillation.layer_map: {[list(p) for p in config.distillation.layer_map]}; the "
            "feature loss compares hidden states of the teacher, which a store of top-k logits "
            f"({FIELD}) does not hold; allowed: [] (or distil online, {FIELD}: null)"
        )
    check_constant_temperature(config, manifest.get("temperature"))
    named = config.distillation.teacher_run_dir
    stored = manifest.get("teacher", {}).get("run_dir")
    if named and teacher_identity(named) != stored:
        raise KilnError(
            f"distillation.teacher_run_dir: {named}, but the store in {directory} holds the "
            f"logits of the teacher {stored}; allowed: that run, or null (the store names it)"
        )
    pairs = (
        ("data.seq_len", config.data.seq_len, manifest.get("seq_len")),
        (
            "train.global_batch_size",
            config.train.global_batch_size,
            manifest.get("global_batch_size"),
        ),
        ("model.vocab_size", config.model.vocab_size, manifest.get("vocab_size")),
    )
    for field, mine, stored in pairs:
        if mine != stored:
            raise _mismatch(field, mine, stored, directory)
    data = {k: v for k, v in config.data.model_dump(mode="json").items() if k not in _NOT_STREAM}
    diff = first_difference(data, manifest.get("data", {}))
    if diff:
        key, mine, stored = diff
        raise _mismatch(f"data.{key}", mine, stored, directory)
    if config.train.steps > manifest.get("steps", 0):
        raise KilnError(
            f"train.steps: {config.train.steps}, but the store in {directory} covers "
            f"{manifest.get('steps')} steps; allowed: <= {manifest.get('steps')} (or write a "
            "store with more train.steps)"
        )


def check_stream(config: Config, manifest: dict[str, Any], datasets) -> None:
    """The student's resolved corpus and tokenizer against the store's; KilnError naming the field."""
    record = data_record(config, datasets)
    directory = config.distillation.teacher_logits_dir
    if record["tokenizer"]["sha256"] != manifest.get("tokenizer", {}).get("sha256"):
        stored = manifest.get("tokenizer", {}).get("spec")
        raise _mismatch("data.tokenizer", config.data.tokenizer, stored, directory)
    diff = first_difference(record["inputs"], manifest.get("inputs"))
    if diff:
        key, mine, stored = diff
        raise KilnError(
            f"data.paths: the corpus differs from the one the store in {directory} was written "
            f"from ({key}: {mine!r}, the store has {stored!r}); the stored rows would not be this "
            "stream's teacher outputs"
        )


def _mismatch(field: str, mine: Any, stored: Any, directory: str | Path | None) -> KilnError:
    return KilnError(
        f"{field}: {mine!r}, but the store in {directory} was written with {stored!r}; "
        f"allowed: {stored!r} (the store holds the teacher's logits of that token stream)"
    )
