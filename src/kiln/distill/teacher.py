"""The frozen teacher of `kiln distill`: its run's config checked against the student, and its
parameters restored into shardings on the student's mesh (forward only, never trained)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flax import nnx

from kiln.config import Config, read_run_config
from kiln.errors import KilnError
from kiln.model import LanguageModel, build_model
from kiln.parallel.mesh import sharded_abstract
from kiln.runs import pinned
from kiln.runs.checkpoint import complete_steps
from kiln.runs.remote import local_run
from kiln.runs.restore import restore_params


@dataclasses.dataclass(frozen=True)
class Teacher:
    """The frozen teacher: its run's config, and its model split into graph and parameters."""

    config: Config
    run_dir: Path
    step: int
    graphdef: nnx.GraphDef
    params: nnx.State
    rest: nnx.State
    notes: tuple[str, ...] = ()  # damaged teacher checkpoints skipped

    def model(self, params: nnx.State | None = None) -> LanguageModel:
        return nnx.merge(self.graphdef, self.params if params is None else params, self.rest)


def read_teacher_config(config: Config, *, keep_pinned: bool = True) -> tuple[Config, Path, int]:
    """(teacher config, run directory, step), checked against the student; KilnError if not.

    The step is the teacher's latest for a new student run, and with `keep_pinned` the one a
    resumed student run started with (pinned in its inputs.json). `kiln teacher-logits` writes a
    store of its own and passes False: a new store takes the latest step whatever student runs
    exist for the config (a store being finished keeps its manifest's step).
    """
    given = config.distillation.teacher_run_dir
    field = "distillation.teacher_run_dir"
    if not given:
        raise KilnError(f"{field}: not set; allowed: the run directory of a trained kiln model")
    # A teacher at a URL: its config.yaml is checked before its checkpoints are fetched.
    run_dir = local_run(given, field, config, only=("config.yaml",))
    if not run_dir.is_dir():
        raise KilnError(f"{field}: {run_dir} is not a directory; train the teacher first")
    teacher = read_run_config(run_dir, field)
    check_teacher(config, teacher, run_dir)
    run_dir = local_run(given, field, config)
    steps = complete_steps(run_dir / "checkpoints")
    if not steps:
        raise KilnError(f"{field}: no complete checkpoint in {run_dir / 'checkpoints'}")
    step = pinned.teacher_step(config) if keep_pinned else None
    if step is not None and step not in steps:
        raise KilnError(
            f"{field}: this run was started with the teacher's step {step}, which is no longer "
            f"in {run_dir / 'checkpoints'} (it has {sorted(steps)}); a resumed student keeps its "
            "teacher step (keep it in the teacher run with checkpoint.keep_every, or start a new "
            "train.run_name)"
        )
    return teacher, run_dir, steps[0] if step is None else step


def check_teacher(config: Config, teacher: Config, run_dir: Path) -> None:
    """Tokenizer, vocabulary, sequence length and layer_map of the student against the teacher."""
    if config.model.vocab_size != teacher.model.vocab_size:
        raise KilnError(
            f"model.vocab_size: the student has {config.model.vocab_size}, the teacher in "
            f"{run_dir} has {teacher.model.vocab_size}; distillation compares their output "
            "distributions, so they must be equal"
        )
    if not _same_tokenizer(config.data.tokenizer, teacher.data.tokenizer):
        raise KilnError(
            f"data.tokenizer: the student uses {config.data.tokenizer!r}, the teacher in "
            f"{run_dir} used {teacher.data.tokenizer!r}; they must be the same tokenizer"
        )
    if config.data.seq_len > teacher.model.max_seq_len:
        raise KilnError(
            f"data.seq_len: {config.data.seq_len} exceeds the teacher's model.max_seq_len="
            f"{teacher.model.max_seq_len} ({run_dir})"
        )
    layers = teacher.model.num_layers
    for s, t in config.distillation.layer_map:
        if not 0 <= t < layers:
            raise KilnError(
                f"distillation.layer_map: teacher layer {t} in [{s}, {t}] is out of range; "
                f"the teacher in {run_dir} has model.num_layers={layers} (allowed: 0..{layers - 1})"
            )


def _same_tokenizer(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_file() and pb.is_file() and pa.read_bytes() == pb.read_bytes()


def load_teacher(config: Config, mesh, *, keep_pinned: bool = True) -> Teacher:
    """The teacher's parameters, restored into shardings on `mesh` from its latest checkpoint
    (or the one a resumed student keeps: see `read_teacher_config`)."""
    teacher_cfg, run_dir, step = read_teacher_config(config, keep_pinned=keep_pinned)
    abstract = abstract_teacher(config, mesh, teacher_cfg, run_dir, step)
    # A pinned step must be intact; a new run falls back from a damaged latest (with a note).
    pinned_step = pinned.teacher_step(config) if keep_pinned else None
    source = run_dir if pinned_step is None else run_dir / "checkpoints" / str(step)
    params, step, notes = restore_params(
        source, abstract.params, what="distillation.teacher_run_dir",
        checksums=config.checkpoint.verify,
    )  # fmt: skip
    return dataclasses.replace(abstract, params=params, step=step, notes=tuple(notes))


def abstract_teacher(
    config: Config, mesh, teacher_cfg: Config, run_dir: Path, step: int
) -> Teacher:
    """The teacher with sharded ShapeDtypeStructs for parameters (the restore target)."""
    graphdef, abstract = sharded_abstract(
        lambda: build_model(teacher_cfg.model, rngs=nnx.Rngs(0)), mesh, config.mesh.rules
    )
    target, rest = nnx.split_state(abstract, nnx.Param, ...)
    return Teacher(teacher_cfg, run_dir, step, graphdef, target, rest)
