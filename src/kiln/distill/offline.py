"""`kiln distill` with `distillation.teacher_logits_dir`: the student learns from a stored teacher.

No teacher parameters are restored: the teacher is known by its stored model config (for the
student's FLOPs and checks) and its outputs arrive in the batches (`kiln.distill.reader`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kiln.config import Config, config_from_dict
from kiln.distill import reader
from kiln.distill.online import DistillObjective, init_student, student_builder
from kiln.distill.teacher import Teacher
from kiln.parallel.mesh import batch_sharding
from kiln.training import train
from kiln.training.runner import execute


def stored_teacher(config: Config, manifest: dict[str, Any]):
    """The store's teacher as a `Teacher` without a model: its config, run and step only."""
    recorded = manifest["teacher"]
    teacher_cfg = config_from_dict({**config.model_dump(mode="json"), "model": recorded["model"]})
    return Teacher(teacher_cfg, Path(recorded["run_dir"]), recorded["step"], None, None, None)


def run(config: Config, restart: bool = False, whole_process: bool = False):
    """Validate the store against the config, then distil from it like `kiln distill`."""

    return execute(
        config,
        _distillation,
        command="kiln distill",
        check=reader.check,
        restart=restart,
        wrap_batches=reader.with_teacher_logits,
        whole_process=whole_process,
    )


def _distillation(config: Config, mesh):

    manifest = reader.check(config)
    teacher = stored_teacher(config, manifest)
    state = init_student(config, mesh, teacher.config)
    note = (
        f"teacher logits from {config.distillation.teacher_logits_dir} (teacher {teacher.run_dir} "
        f"step {teacher.step}, top-{manifest['top_k']} {manifest['dtype']})"
    )
    return DistillObjective.create(config, mesh, teacher), state, [note]


def abstract_offline(config: Config, mesh):
    """`kiln distill`'s objective and student state from a store, abstract (`kiln compile`):
    the store's manifest gives the teacher's config; no shard is read."""

    manifest = reader.check(config)
    teacher = stored_teacher(config, manifest)
    state = train.abstract_train_state(config, mesh, student_builder(config, teacher.config))
    return DistillObjective.create(config, mesh, teacher), state


def abstract_teacher_rows(config: Config, mesh, top_k: int) -> dict:
    """The store's batch keys as ShapeDtypeStructs, sharded like the token batch."""

    rows = (config.train.global_batch_size, config.data.seq_len)
    sharding = batch_sharding(mesh, config.mesh.rules)
    return {
        "teacher_values": jax.ShapeDtypeStruct((*rows, top_k), jnp.float32, sharding=sharding),
        "teacher_ids": jax.ShapeDtypeStruct((*rows, top_k), jnp.int32, sharding=sharding),
        "teacher_lse": jax.ShapeDtypeStruct(rows, jnp.float32, sharding=sharding),
    }
