"""`kiln teacher-logits CONFIG --out DIR`: the teacher's top-k logits over a config's training stream.

The teacher of `distillation.teacher_run_dir` runs forward over the first `train.steps` global
batches of the config's training iterator (the batches `kiln distill` with the same config
sees, in the same order and packing), one micro-batch at a time as the student's step cuts
them. Per token it keeps the top-k of its (soft-capped) logits, their ids, and the
log-sum-exp at `distillation.temperature` of all of them. Shards are published whole (see
`kiln.distill.store`); a re-run with the same config and `--out` writes only the missing ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from kiln import losses
from kiln.config import Config
from kiln.data import make_datasets
from kiln.distill import checks
from kiln.distill.reader import batch_index
from kiln.distill.store import (
    DTYPES,
    MANIFEST,
    bytes_per_token,
    first_difference,
    read_manifest,
    remove_stale_staging,
    row_crcs,
    shard_complete,
    shards,
    write_json,
    write_shard,
)
from kiln.distill.teacher import abstract_teacher, load_teacher, read_teacher_config
from kiln.errors import KilnError, write_error
from kiln.parallel.distributed import initialize
from kiln.parallel.mesh import batch_sharding, in_mesh, make_mesh
from kiln.runs.checkpoint import complete_steps
from kiln.runs.lock import LOCK_NAME, RunLock
from kiln.runs.restore import restore_params
from kiln.training import train
from kiln.training.batches import micro_batches, place_batch
from kiln.util.files import check_creatable
from kiln.util.humanize import plural

SHARD_BYTES = 256 << 20  # default shard size per process


def topk_function(config: Config, teacher, mesh, top_k: int):
    """Jitted `(teacher params, batch) -> (values, ids, lse)` of one global batch, row order kept."""
    accum, rules = config.train.gradient_accumulation_steps, config.mesh.rules
    cap = teacher.config.model.logit_softcap
    temperature = config.distillation.temperature

    def run(params, batch):
        model = nnx.merge(teacher.graphdef, params, teacher.rest)

        def one(mb):
            out = model.hidden_states(mb["inputs"], mb["positions"], mb["segment_ids"])
            x = losses.logits(out.hidden, model.head_weight(), softcap=cap)  # float32 [b, S, V]
            values, ids = jax.lax.top_k(x, top_k)
            return values, ids.astype(np.int32), jax.nn.logsumexp(x / temperature, axis=-1)

        parts = jax.lax.map(one, micro_batches(batch, accum, mesh, rules))
        # Micro-batch a holds rows a, a + accum, ...: [accum, G/accum, ...] -> [G, ...].
        return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(-1, *y.shape[2:]), parts)

    data = batch_sharding(mesh, rules)
    jitted = jax.jit(
        run, in_shardings=(train.shardings_of(teacher.params), data), out_shardings=data
    )
    return in_mesh(jitted, mesh, rules)


def local_rows(x, first: int, count: int) -> np.ndarray:
    """Rows first .. first+count-1 of a global array, from this process's shards of it."""
    out = np.empty((count, *x.shape[1:]), x.dtype)
    for shard in x.addressable_shards:
        rows, *rest = shard.index
        lo, hi, _ = rows.indices(x.shape[0])
        out[(slice(lo - first, hi - first), *rest)] = np.asarray(shard.data)
    return out


def write_store(
    config: Config,
    out: str | Path,
    *,
    top_k: int = 64,
    dtype: str = "bfloat16",
    shard_steps: int | None = None,
) -> str:
    """Write (or finish) the store of `config`'s stream in `out`; returns a summary line.

    `out` is checked writable before any work, and process 0 holds its lock (one writer per
    store, as per run directory) from before the teacher is read to the end; directories this
    call made are removed again if it fails before writing into them.
    """
    initialize(config)  # before any device is touched
    out = Path(out).expanduser().absolute()
    if dtype not in DTYPES:
        raise KilnError(f"--dtype: {dtype!r}; allowed: {', '.join(DTYPES)}")
    vocab = config.model.vocab_size
    if not 1 <= top_k <= vocab:
        raise KilnError(f"--top-k: {top_k}; allowed: 1..{vocab} (model.vocab_size)")
    if out.exists() and not out.is_dir():
        raise KilnError(f"--out: {out} exists and is not a directory")
    check_creatable(out, "--out")
    held = out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir())
    if held and not (out / MANIFEST).is_file():
        raise KilnError(f"--out: {out} is not empty and holds no store of kiln teacher-logits")
    checks.check_constant_temperature(config)
    made = [p for p in (out, *out.parents) if not p.exists()]
    lock = RunLock(out, "kiln teacher-logits", field="--out", kind="store")
    written = False
    try:
        taken = None
        if jax.process_index() == 0:
            out.mkdir(parents=True, exist_ok=True)
            taken = lock.acquire()
        line = _write_store(config, out, top_k, dtype, shard_steps, taken)
        written = True
        return line
    finally:
        lock.release()
        for path in made if not written else ():
            with contextlib.suppress(OSError):  # not empty: a manifest or shards were written
                path.rmdir()


def _write_store(
    config: Config,
    out: Path,
    top_k: int,
    dtype: str,
    shard_steps: int | None,
    taken: str | None,
) -> str:
    """`write_store` once `out` is locked; `taken`: the note of a stale lock taken over."""
    # The teacher's config is checked before any data is read; a new store takes its latest step.
    read_teacher_config(config, keep_pinned=False)
    existing = read_manifest(out, "--out") if (out / MANIFEST).is_file() else None
    mesh = make_mesh(config)
    datasets = make_datasets(config)
    teacher = _teacher(config, mesh, existing)
    writers, me = jax.process_count(), jax.process_index()
    block = config.train.global_batch_size // writers
    per_step = block * config.data.seq_len * bytes_per_token(top_k, dtype)
    if shard_steps is None:
        shard_steps = max(1, min(config.train.steps, SHARD_BYTES // per_step))
        shard_steps = existing["shard_steps"] if existing else shard_steps
    teacher_record = {
        "run_dir": checks.teacher_identity(config.distillation.teacher_run_dir),
        "step": teacher.step,
        "logit_softcap": teacher.config.model.logit_softcap,
        "model": teacher.config.model.model_dump(mode="json"),
    }
    manifest = checks.describe(
        config, datasets, teacher_record, top_k=top_k, dtype=dtype, shard_steps=shard_steps,
        writers=writers,
    )  # fmt: skip
    if existing is not None:
        diff = first_difference(manifest, existing)
        if diff:
            key, mine, stored = diff
            raise KilnError(
                f"--out: {out} holds a store with {key} {stored!r}, this run would write {mine!r}; "
                "finish it with the settings it was started with, or choose a new directory"
            )
    batches = datasets.train_iterator()
    next(batches)  # its token ids checked (data.verify_shards: false) before anything is written
    if writers > 1:  # every process has read `out` before process 0 writes into it
        multihost_utils.sync_global_devices("kiln: teacher-logits validated")
    if me == 0 and existing is None:
        try:
            write_json(out / MANIFEST, manifest)
        except OSError as e:
            raise write_error(e, out / MANIFEST, then="write the store") from None
    if writers > 1:
        multihost_utils.sync_global_devices("kiln: teacher-logits manifest written")
    remove_stale_staging(out)

    mine = [(s, r, n) for s, r, n in shards(manifest) if r[0] == me * block]
    missing = np.array([not shard_complete(out / n) for _, _, n in mine])
    # Every process runs the teacher over every step some process still needs (collectives).
    if writers > 1:
        missing = multihost_utils.process_allgather(missing).any(axis=0)
    todo = [m for m, needed in zip(mine, missing) if needed]
    fn = topk_function(config, teacher, mesh, top_k)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if me == 0 else (lambda _: None)
    if taken:
        say(f"kiln: {taken}")
    if len(todo) < len(mine):
        say(f"kiln: {plural(len(mine) - len(todo), 'shard')} of {out} already written; resuming")
    started, done_steps = time.perf_counter(), 0
    for steps, rows, name in todo:
        state = batches.get_state()
        if batch_index(state) != steps[0]:
            batches.set_state({**state, "next_index": steps[0]})
        parts: dict[str, list[np.ndarray]] = {"values": [], "ids": [], "lse": [], "row_crc": []}
        for _ in range(*steps):
            batch = next(batches)
            values, ids, lse = fn(teacher.params, place_batch(batch, mesh, config))
            values = local_rows(values, rows[0], block)
            parts["values"].append(_stored(values, dtype))
            parts["ids"].append(local_rows(ids, rows[0], block))
            parts["lse"].append(local_rows(lse, rows[0], block))
            parts["row_crc"].append(row_crcs(batch))
        if not shard_complete(out / name):
            write_shard(out, name, {k: np.stack(v) for k, v in parts.items()})
        done_steps += steps[1] - steps[0]
        tokens = done_steps * config.train.global_batch_size * config.data.seq_len
        rate = tokens / max(time.perf_counter() - started, 1e-9)
        say(
            f"teacher-logits: steps {steps[0]}..{steps[1] - 1} written "
            f"({done_steps}/{sum(s[1] - s[0] for s, _, _ in todo)} steps, {rate:,.0f} tokens/s)"
        )
    if writers > 1:
        multihost_utils.sync_global_devices("kiln: teacher-logits shards written")
    size = config.train.steps * config.train.global_batch_size * config.data.seq_len
    total = size * bytes_per_token(top_k, dtype)
    return (
        f"wrote {out}: {plural(config.train.steps, 'step')} x {config.train.global_batch_size} x "
        f"{config.data.seq_len} tokens, top-{top_k} {dtype} "
        f"({bytes_per_token(top_k, dtype)} bytes per token, {total / 1e9:.3g} GB), teacher "
        f"{teacher.run_dir} step {teacher.step}, {plural(math.ceil(config.train.steps / shard_steps), 'shard')}"
        f" per process"
    )


def _teacher(config: Config, mesh, existing: dict[str, Any] | None):
    """The teacher at its latest step, or for a store being finished, at the store's step (a
    student run of the config, and the step pinned in its inputs.json, play no part)."""
    if existing is None:
        return load_teacher(config, mesh, keep_pinned=False)
    teacher_cfg, run_dir, _ = read_teacher_config(config, keep_pinned=False)
    recorded = existing.get("teacher", {})
    if checks.teacher_identity(config.distillation.teacher_run_dir) != recorded.get("run_dir"):
        raise KilnError(
            f"distillation.teacher_run_dir: {config.distillation.teacher_run_dir}, but the store in --out was "
            f"started with the teacher {recorded.get('run_dir')}; finish it with that teacher, "
            "or choose a new --out"
        )
    step = recorded.get("step")
    if step not in complete_steps(run_dir / "checkpoints"):
        raise KilnError(
            f"distillation.teacher_run_dir: the store in --out was started with the teacher's "
            f"step {step}, which is no longer in {run_dir / 'checkpoints'}; choose a new --out"
        )
    abstract = abstract_teacher(config, mesh, teacher_cfg, run_dir, step)
    params, step, _ = restore_params(
        run_dir / "checkpoints" / str(step), abstract.params, what="distillation.teacher_run_dir",
        checksums=config.checkpoint.verify,
    )  # fmt: skip
    return dataclasses.replace(abstract, params=params, step=step)


def _stored(values_f32: np.ndarray, dtype: str) -> np.ndarray:
    """Values as stored: float32, or bfloat16 bits as uint16 (.npy has no bfloat16)."""
    if dtype == "float32":
        return values_f32.astype(np.float32)
    import ml_dtypes

    return values_f32.astype(ml_dtypes.bfloat16).view(np.uint16)


def run(config: Config, out: str | Path, **options: Any) -> str:
    """`kiln teacher-logits`: the store, written or finished."""
    return write_store(config, out, **options)
