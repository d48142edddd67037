"""`kiln distill`: a frozen teacher from a run directory trains a student through the trainer's loop.

The teacher is the model of `distillation.teacher_run_dir` (its `config.yaml` and latest
checkpoint, parameters only), restored straight into its shardings on the student's mesh. It is
an argument of the jitted step, not part of the train state: no optimizer state, no gradients,
forward only. The student is an ordinary kiln train state; when `distillation.layer_map` pairs
layers of different widths, a learned `FeatureProjection` (one [D_student, D_teacher] map per
pair) is attached to the student model as `distill_projection`, so it is a trainable parameter
like any other, checkpointed and resumed with the student. Its keys sit beside the
Transformer's, so the student's checkpoints also serve `kiln train` with
`checkpoint.load_params_from` (which restores only the parameters it knows).

Losses (per token, weighted, `kiln.losses`): hard = student cross-entropy with z-loss,
soft = T^2 KL(teacher_T || student_T), feature = distance of the paired hidden states; their
per-token means over the *global* batch, H, S and F, give `total = distillation_loss(H, S, F)`.

Gradient accumulation. `total` is linear in (H, S, F) with coefficients
(c_H, c_S, c_F) = d total / d (H, S, F) that depend on the global means only through
stop-gradients (balance none: 1 - alpha, alpha, beta; dynamic: 1, alpha H/K, alpha (H/K)(S/F)
with K = S + (S/F) F). With W the global token weight and sums over micro-batches,

    d total = (c_H d sum(hard) + c_S d sum(soft) + c_F d sum(feature)) / W,

so every micro-batch differentiates `c . sums` and the gradient sums are divided once by W,
exactly as in pre-training. With balance none the coefficients are constants; with dynamic
balancing and one micro-batch they come from that batch's own sums (under stop_gradient).
With dynamic balancing and several micro-batches they need the global means first, so the step
makes two passes: a forward-only scan over the micro-batches for the global sums, then the
usual scan of forward and backward passes with the coefficients fixed. That costs one more
forward pass of both models per step, which is less than carrying three gradient trees (one
per loss) through the scan and combining them afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kiln import losses, pinned, train
from kiln.checkpoint import complete_steps, restore_params
from kiln.config import Config, DistillationConfig, read_run_config
from kiln.errors import KilnError
from kiln.mesh import sharded_abstract, sharded_init
from kiln.model import DTYPES, FAMILIES, LanguageModel, build_model, flops_per_token
from kiln.model.student import PROJECTION, FeatureProjection, student_class
from kiln.train import Batch, Objective, TrainState, token_mean

# Tags under distill/ that every step reports (besides the scheduled alpha, temperature, beta).
METRICS = (
    "hard_loss",
    "soft_loss",
    "feature_loss",
    "total_loss",
    "feature_mag_scale",
    "kd_mag_scale",
    "teacher_loss",
)
SUM_KEYS = ("hard_sum", "z_loss_sum", "soft_sum", "feature_sum", "teacher_loss_sum", "weight_sum")


# ---------------------------------------------------------------------------------------------
# Teacher and student


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


def read_teacher_config(config: Config) -> tuple[Config, Path, int]:
    """(teacher config, run directory, step), checked against the student; KilnError if not.

    The step is the teacher's latest for a new student run, and the one the run started with
    (pinned in its inputs.json) for a resumed one.
    """
    given = config.distillation.teacher_run_dir
    field = "distillation.teacher_run_dir"
    if not given:
        raise KilnError(f"{field}: not set; allowed: the run directory of a trained kiln model")
    run_dir = Path(given).expanduser()
    if not run_dir.is_dir():
        raise KilnError(f"{field}: {run_dir} is not a directory; train the teacher first")
    teacher = read_run_config(run_dir, field)
    check_teacher(config, teacher, run_dir)
    steps = complete_steps(run_dir / "checkpoints")
    if not steps:
        raise KilnError(f"{field}: no complete checkpoint in {run_dir / 'checkpoints'}")
    step = pinned.teacher_step(config)
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


def load_teacher(config: Config, mesh) -> Teacher:
    """The teacher's parameters, restored from its latest checkpoint into shardings on `mesh`."""
    teacher_cfg, run_dir, step = read_teacher_config(config)
    abstract = abstract_teacher(config, mesh, teacher_cfg, run_dir, step)
    # A pinned step must be intact; a new run falls back from a damaged latest (with a note).
    source = run_dir if pinned.teacher_step(config) is None else run_dir / "checkpoints" / str(step)
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


def init_student(config: Config, mesh, teacher_cfg: Config) -> TrainState:
    """The student's train state: a `Student` (with a feature projection if widths differ)."""
    model = sharded_init(student_builder(config, teacher_cfg), mesh, config.mesh.rules)
    return train.state_from_model(config, mesh, model)


def student_builder(config: Config, teacher_cfg: Config) -> Callable[[], LanguageModel]:
    """`build()` of the student model (with a feature projection if widths differ)."""
    pairs = len(config.distillation.layer_map)
    d_s, d_t = config.model.d_model, teacher_cfg.model.d_model
    seed = config.train.seed

    def build():
        projection = None
        if pairs and d_s != d_t:
            rngs = nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), 1))
            dtype = DTYPES[config.model.param_dtype]
            projection = FeatureProjection(pairs, d_s, d_t, rngs=rngs, dtype=dtype)
        student = student_class(FAMILIES[config.model.family])
        return student(config.model, rngs=nnx.Rngs(seed), projection=projection)

    return build


# ---------------------------------------------------------------------------------------------
# The distillation objective


def schedule_values(cfg: DistillationConfig, step, total_steps: int) -> dict[str, jax.Array]:
    """alpha, temperature and beta at a (0-based) step: start values moved to *_end by the last."""
    p = jnp.clip(jnp.asarray(step, jnp.float32) / max(1, total_steps - 1), 0.0, 1.0)
    if cfg.schedule == "linear":
        frac = p
    elif cfg.schedule == "cosine":
        frac = 0.5 * (1.0 - jnp.cos(jnp.pi * p))
    else:
        frac = jnp.zeros_like(p)
    out = {}
    for name in ("alpha", "temperature", "beta"):
        start = getattr(cfg, name)
        end = getattr(cfg, f"{name}_end")
        end = start if end is None else end
        out[name] = jnp.float32(start) + (end - start) * frac
    return out


class DistillObjective(Objective):
    """Distillation: hard, soft and feature losses of the student against a frozen teacher.

    The teacher's parameters are pytree fields (arguments of the compiled step, never
    differentiated); its config and graph are static. See the module docstring for how the
    balancing coefficients make the accumulated gradient exact.
    """

    sum_keys: ClassVar[tuple[str, ...]] = SUM_KEYS
    extra_param_keys: ClassVar[tuple[str, ...]] = (PROJECTION,)

    teacher_params: nnx.State = None
    teacher_rest: nnx.State = None
    knobs: dict[str, jax.Array] | None = None  # alpha, temperature, beta at the step
    teacher_config: Config = struct.field(pytree_node=False, default=None)
    teacher_graphdef: nnx.GraphDef = struct.field(pytree_node=False, default=None)
    teacher_run: str = struct.field(pytree_node=False, default=None)
    teacher_step: int = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, config: Config, mesh, teacher: Teacher) -> DistillObjective:
        return cls(
            config=config,
            mesh=mesh,
            teacher_params=teacher.params,
            teacher_rest=teacher.rest,
            teacher_config=teacher.config,
            teacher_graphdef=teacher.graphdef,
            teacher_run=str(Path(teacher.run_dir).absolute()),
            teacher_step=teacher.step,
        )

    def pinned_inputs(self) -> dict:
        """The teacher's run and step: a resumed student keeps them."""
        return {"teacher": {"run_dir": self.teacher_run, "step": self.teacher_step}}

    @property
    def needs_global_sums(self) -> bool:
        return self.config.distillation.balance == "dynamic"

    def for_step(self, step):
        cfg = self.config
        return self.replace(knobs=schedule_values(cfg.distillation, step, cfg.train.steps))

    def _teacher_outputs(self, batch: Batch):
        """Teacher hidden states [B,S,E], features [P,B,S,E] (or None) and head: forward only."""
        params = jax.lax.stop_gradient(self.teacher_params)
        model = nnx.merge(self.teacher_graphdef, params, self.teacher_rest)
        layers = [t for _, t in self.config.distillation.layer_map]
        out = model.hidden_states(
            batch["inputs"], batch["positions"], batch["segment_ids"], collect=layers
        )
        return jax.lax.stop_gradient((out.hidden, out.features, model.head_weight()))

    def loss_sums(self, model, batch: Batch, coefficients):
        """Weighted loss sums of one micro-batch and `c . (hard, soft, feature)` to differentiate.

        Hard and soft losses come from one pass over the student's logits. With coefficients
        known before the pass (given, or constant under balance=none) the pass makes one
        combined logit gradient; otherwise (dynamic balancing on one micro-batch) it makes
        both and the coefficients follow from this micro-batch's own sums.
        """
        config, dist = self.config, self.config.distillation
        if coefficients is None and not self.needs_global_sums:
            # balance=none: the coefficients do not depend on the sums.
            coefficients = self.coefficients(dict.fromkeys(self.sum_keys, jnp.zeros(())))
        t_hidden, t_feats, t_head = self._teacher_outputs(batch)
        layers = [s for s, _ in dist.layer_map]
        out = model.hidden_states(
            batch["inputs"], batch["positions"], batch["segment_ids"], collect=layers
        )
        fused = losses.distill_loss_sums(
            out.hidden,
            model.head_weight(),
            t_hidden,
            t_head,
            batch["targets"],
            batch["weights"],
            temperature=self.knobs["temperature"],
            z_loss_multiplier=config.loss.z_loss_multiplier,
            label_smoothing=config.loss.label_smoothing,
            student_softcap=config.model.logit_softcap,
            teacher_softcap=self.teacher_config.model.logit_softcap,
            num_vocab_tiling=config.loss.num_vocab_tiling,
            vocab_chunk_size=config.loss.vocab_chunk_size,
            mesh=self.mesh,
            rules=config.mesh.rules,
            coefficients=None if coefficients is None else coefficients[:2],
        )
        feature_sum = jnp.zeros((), jnp.float32)
        if layers:
            per_token = losses.feature_loss(model.project(out.features), t_feats, dist.feature_loss)
            feature_sum = jnp.sum(per_token * batch["weights"].astype(jnp.float32))
        sums = {
            "hard_sum": fused["loss_sum"],
            "z_loss_sum": fused["z_loss_sum"],
            "weight_sum": fused["weight_sum"],
            "soft_sum": fused["soft_sum"],
            "teacher_loss_sum": fused["teacher_loss_sum"],
            "feature_sum": feature_sum,
        }
        if coefficients is None:
            c = self.coefficients(sums)
            value = c[0] * sums["hard_sum"] + c[1] * sums["soft_sum"] + c[2] * feature_sum
        else:
            value = fused["objective_sum"] + coefficients[2] * feature_sum
        return value, sums

    def _means(self, sums):
        return tuple(token_mean(sums[k], sums) for k in ("hard_sum", "soft_sum", "feature_sum"))

    def _total(self, hard, soft, feature):
        knobs, dist = self.knobs, self.config.distillation
        return losses.distillation_loss(
            hard,
            soft,
            feature,
            alpha=knobs["alpha"],
            beta=knobs["beta"],
            balance=dist.balance,
            max_kd_scale=dist.max_kd_scale,
        )

    def coefficients(self, sums):
        """d total / d (hard, soft, feature) at the per-token means (see the module docstring)."""
        means = self._means(jax.lax.stop_gradient(sums))
        return jax.grad(lambda *m: self._total(*m)[0], argnums=(0, 1, 2))(*means)

    def finalize(self, sums):
        hard, soft, feature = self._means(sums)
        total, scales = self._total(hard, soft, feature)
        aux = {
            "z_loss": token_mean(sums["z_loss_sum"], sums),
            "total_weights": sums["weight_sum"],
            "distill/hard_loss": hard,
            "distill/soft_loss": soft,
            "distill/feature_loss": feature,
            "distill/total_loss": total,
            "distill/feature_mag_scale": scales["feature_mag_scale"],
            "distill/kd_mag_scale": scales["kd_mag_scale"],
            "distill/teacher_loss": token_mean(sums["teacher_loss_sum"], sums),
            **{f"distill/{k}": v for k, v in self.knobs.items()},
        }
        return total, aux

    def flops_per_token(self) -> float:
        """Student training FLOPs plus the teacher's forward pass (1/3 of its training FLOPs)."""
        config, teacher_cfg = self.config, self.teacher_config
        seq = config.data.seq_len
        student = flops_per_token(config.model, seq)
        teacher = flops_per_token(teacher_cfg.model, seq) / 3.0
        pairs = len(config.distillation.layer_map)
        d_s, d_t = config.model.d_model, teacher_cfg.model.d_model
        return student + teacher + (6.0 * pairs * d_s * d_t if d_s != d_t else 0.0)


def loss_and_grads(config: Config, teacher: Teacher, state: TrainState, batch):
    """(total loss, aux, grads) of one global batch; aux holds z_loss, total_weights, distill/*."""
    objective = DistillObjective.create(config, train.mesh_of(state), teacher)
    return train.run_objective(objective, state, batch)


def make_distill_step(config: Config, teacher: Teacher, mesh, shardings: TrainState) -> Callable:
    """`step(state, batch) -> (state, metrics)`: jitted, donated student state, teacher untouched."""
    return train.make_step(DistillObjective.create(config, mesh, teacher), shardings)


# ---------------------------------------------------------------------------------------------
# The command


def run(config: Config, restart: bool = False) -> TrainState | None:
    """`kiln distill`: validate config, teacher, data and any earlier run; then distil and save."""
    from kiln.runner import execute

    if config.distillation.teacher_logits_dir:
        from kiln.offline import distill as offline

        return offline.run(config, restart)
    # The teacher's config is checked before any data or parameters are touched.
    return execute(
        config, _distillation, command="kiln distill", check=read_teacher_config, restart=restart
    )


def _distillation(config: Config, mesh) -> tuple[DistillObjective, TrainState, list[str]]:
    """The distillation objective around the loaded teacher, and a fresh student state."""
    teacher = load_teacher(config, mesh)
    state = init_student(config, mesh, teacher.config)
    note = f"teacher {teacher.run_dir} (step {teacher.step})"
    return DistillObjective.create(config, mesh, teacher), state, [*teacher.notes, note]


def abstract_distillation(config: Config, mesh) -> tuple[DistillObjective, TrainState]:
    """`kiln distill`'s objective and student state with abstract arrays (`kiln compile`).

    Needs the teacher run's config.yaml, not its checkpoint: no parameter is read.
    """
    run_dir = Path(config.distillation.teacher_run_dir).expanduser()
    teacher_cfg = read_run_config(run_dir, "distillation.teacher_run_dir")
    check_teacher(config, teacher_cfg, run_dir)
    teacher = abstract_teacher(config, mesh, teacher_cfg, run_dir, -1)
    builder = student_builder(config, teacher_cfg)
    state = train.abstract_train_state(config, mesh, builder)
    return DistillObjective.create(config, mesh, teacher), state


__all__ = [
    "METRICS",
    "DistillObjective",
    "FeatureProjection",
    "Teacher",
    "abstract_distillation",
    "abstract_teacher",
    "check_teacher",
    "init_student",
    "load_teacher",
    "loss_and_grads",
    "make_distill_step",
    "read_teacher_config",
    "run",
    "schedule_values",
    "student_builder",
]
