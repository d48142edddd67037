"""`kiln distill`: a frozen teacher from a run directory trains a student through the trainer's loop.

The teacher is the model of `distillation.teacher_run_dir` (its `config.yaml` and latest
checkpoint, parameters only; `kiln.distill.teacher`), restored straight into its shardings on the
student's mesh. It is an argument of the jitted step, not part of the train state: no optimizer
state, no gradients, forward only. Offline (`distillation.teacher_logits_dir`) there is no
teacher model at all: each batch carries the teacher's stored top-k logits (`TOP_K_KEYS`), the
soft loss is `kiln.losses.top_k_distill_loss_sums` (a tail bucket, or renormalised), the feature
loss is refused, and `distill/teacher_loss` (the teacher's cross-entropy, which needs its whole
distribution at T = 1) is replaced by `distill/teacher_top_k_hit` (the fraction of tokens whose
target is among the stored ids) and `distill/teacher_tail_mass` (mean p_tail). The student is an ordinary kiln train state; when `distillation.layer_map` pairs
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
forward pass of both models (of the student, offline) per step, which is less than carrying three gradient trees (one
per loss) through the scan and combining them afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kiln import losses
from kiln.config import Config, DistillationConfig, read_run_config
from kiln.distill.teacher import (
    Teacher,
    abstract_teacher,
    check_teacher,
    load_teacher,
    read_teacher_config,
)
from kiln.errors import KilnError
from kiln.model import DTYPES, FAMILIES, LanguageModel, flops_per_token
from kiln.model.student import PROJECTION, FeatureProjection, student_class
from kiln.parallel.mesh import sharded_init
from kiln.runs.remote import local_run
from kiln.training import train
from kiln.training.batches import Batch
from kiln.training.objective import Objective, token_mean
from kiln.training.runner import execute
from kiln.training.train import TrainState

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
# Offline (distillation.teacher_logits_dir) the teacher's cross-entropy is not known (it needs
# its whole distribution at T = 1): these two tags replace distill/teacher_loss.
TOP_K_METRICS = ("teacher_top_k_hit", "teacher_tail_mass")
SUM_KEYS = ("hard_sum", "z_loss_sum", "soft_sum", "feature_sum", "teacher_loss_sum", "weight_sum")
TOP_K_SUM_KEYS = (
    *(k for k in SUM_KEYS if k != "teacher_loss_sum"),
    *(f"{m}_sum" for m in TOP_K_METRICS),
)
# The batch arrays of the stored top-k (kiln teacher-logits): [B, S, K], [B, S, K], [B, S].
TOP_K_KEYS = ("teacher_values", "teacher_ids", "teacher_lse")


# ---------------------------------------------------------------------------------------------
# Teacher and student


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
        student = student_class(FAMILIES[config.model.family].model)
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
    differentiated); its config and graph are static. Offline (`distillation.teacher_logits_dir`)
    there is no teacher model: the soft loss reads the stored top-k of each batch (`TOP_K_KEYS`).
    See the module docstring for how the balancing coefficients make the accumulated gradient
    exact.
    """

    extra_param_keys: ClassVar[tuple[str, ...]] = (PROJECTION,)

    teacher_params: nnx.State = None
    teacher_rest: nnx.State = None
    knobs: dict[str, jax.Array] | None = None  # alpha, temperature, beta at the step
    teacher_config: Config = struct.field(pytree_node=False, default=None)
    teacher_graphdef: nnx.GraphDef = struct.field(pytree_node=False, default=None)
    teacher_run: str = struct.field(pytree_node=False, default=None)
    teacher_step: int = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, config: Config, mesh, teacher: Teacher | None) -> DistillObjective:
        """The objective around a loaded teacher; offline, the teacher only names the store's
        (its parameters, if any, are not kept) and may be None. KilnError if offline cannot work."""
        if config.distillation.teacher_logits_dir:
            check_offline(config)
            if teacher is None:
                return cls(config=config, mesh=mesh)
            return cls(
                config=config, mesh=mesh, teacher_config=teacher.config,
                teacher_run=str(Path(teacher.run_dir).absolute()), teacher_step=teacher.step,
            )  # fmt: skip
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

    @property
    def offline(self) -> bool:
        return self.config.distillation.teacher_logits_dir is not None

    @property
    def sum_keys(self) -> tuple[str, ...]:
        return TOP_K_SUM_KEYS if self.offline else SUM_KEYS

    def pinned_inputs(self) -> dict:
        """The teacher's run and step: a resumed student keeps them."""
        if self.teacher_run is None:
            return {}
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

    def _soft_and_hard(self, model, hidden, batch: Batch, teacher, coefficients):
        """Hard and soft sums of one pass over the student's logits (`losses.distill_loss_sums`)."""
        config = self.config
        kw = dict(
            temperature=self.knobs["temperature"],
            z_loss_multiplier=config.loss.z_loss_multiplier,
            label_smoothing=config.loss.label_smoothing,
            student_softcap=config.model.logit_softcap,
            num_vocab_tiling=config.loss.num_vocab_tiling,
            vocab_chunk_size=config.loss.vocab_chunk_size,
            schedule=config.loss.schedule,
            mesh=self.mesh,
            rules=config.mesh.rules,
            coefficients=None if coefficients is None else coefficients[:2],
        )
        head, targets, weights = model.head_weight(), batch["targets"], batch["weights"]
        if self.offline:
            top = losses.TopK(*(batch[k] for k in TOP_K_KEYS))
            renormalize = config.distillation.top_k_renormalize
            return losses.top_k_distill_loss_sums(
                hidden, head, top, targets, weights, renormalize=renormalize, **kw
            )
        t_hidden, _, t_head = teacher
        cap = self.teacher_config.model.logit_softcap
        return losses.distill_loss_sums(
            hidden, head, t_hidden, t_head, targets, weights, teacher_softcap=cap, **kw
        )

    def collect(self) -> tuple[int, ...]:
        """The student blocks whose features the feature loss reads (`distillation.layer_map`)."""
        layers = tuple(s for s, _ in self.config.distillation.layer_map)
        if layers and self.offline:  # create_offline refuses it first: never dropped silently
            raise KilnError(OFFLINE_FEATURES.format(len(layers)))
        return layers

    def sums(self, model, out, batch: Batch, coefficients):
        """Weighted loss sums of one micro-batch and `c . (hard, soft, feature)` to differentiate.

        Hard and soft losses come from one pass over the student's logits. With coefficients
        known before the pass (given, or constant under balance=none) the pass makes one
        combined logit gradient; otherwise (dynamic balancing on one micro-batch) it makes
        both and the coefficients follow from this micro-batch's own sums. The student's own
        loss terms (an MoE router's) are added by `Objective`, outside the balance.
        """
        dist = self.config.distillation
        if coefficients is None and not self.needs_global_sums:
            # balance=none: the coefficients do not depend on the sums.
            coefficients = self.coefficients(dict.fromkeys(self.sum_keys, jnp.zeros(())))
        teacher = None if self.offline else self._teacher_outputs(batch)
        fused = self._soft_and_hard(model, out.hidden, batch, teacher, coefficients)
        feature_sum = jnp.zeros((), jnp.float32)
        if dist.layer_map:
            t_feats = teacher[1]
            per_token = losses.feature_loss(model.project(out.features), t_feats, dist.feature_loss)
            feature_sum = jnp.sum(per_token * batch["weights"].astype(jnp.float32))
        sums = {
            "hard_sum": fused["loss_sum"],
            "z_loss_sum": fused["z_loss_sum"],
            "weight_sum": fused["weight_sum"],
            "soft_sum": fused["soft_sum"],
            "feature_sum": feature_sum,
            **{k: fused[k] for k in self.sum_keys if k.startswith("teacher_")},
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

    def result(self, sums):
        hard, soft, feature = self._means(sums)
        total, scales = self._total(hard, soft, feature)
        aux = {
            "learning/z_loss": token_mean(sums["z_loss_sum"], sums),
            "learning/total_weights": sums["weight_sum"],
            "distill/hard_loss": hard,
            "distill/soft_loss": soft,
            "distill/feature_loss": feature,
            "distill/feature_mag_scale": scales["feature_mag_scale"],
            "distill/kd_mag_scale": scales["kd_mag_scale"],
            **{f"distill/{k[:-4]}": token_mean(sums[k], sums) for k in self.sum_keys
               if k.startswith("teacher_")},
            **{f"distill/{k}": v for k, v in self.knobs.items()},
        }  # fmt: skip
        return total, aux

    def finalize(self, sums):
        """The base's loss (with the student's own loss terms) is `distill/total_loss`."""
        loss, aux = super().finalize(sums)
        return loss, {**aux, "distill/total_loss": loss}

    def flops_per_token(self) -> float:
        """Student training FLOPs plus the teacher's forward pass (1/3 of its training FLOPs)."""
        config, teacher_cfg = self.config, self.teacher_config
        seq = config.data.seq_len
        student = flops_per_token(config.model, seq)
        if self.offline:
            return student  # the teacher ran once, when its logits were stored
        teacher = flops_per_token(teacher_cfg.model, seq) / 3.0
        pairs = len(config.distillation.layer_map)
        d_s, d_t = config.model.d_model, teacher_cfg.model.d_model
        return student + teacher + (6.0 * pairs * d_s * d_t if d_s != d_t else 0.0)


OFFLINE_FEATURES = (
    "distillation.layer_map: {} pairs given, but with distillation.teacher_logits_dir the "
    "teacher's hidden states are not stored, so the feature loss cannot be computed; allowed: "
    "an empty layer_map (or train online with distillation.teacher_run_dir)"
)


def check_offline(config: Config) -> None:
    """KilnError unless the distillation settings can train from stored top-k logits."""
    dist = config.distillation
    if not dist.teacher_logits_dir:
        raise KilnError(
            "distillation.teacher_logits_dir: not set; allowed: a directory written by "
            "kiln teacher-logits"
        )
    if dist.layer_map:
        raise KilnError(OFFLINE_FEATURES.format(len(dist.layer_map)))
    t_end = dist.temperature_end
    if dist.schedule != "constant" and t_end is not None and t_end != dist.temperature:
        raise KilnError(
            f"distillation.temperature_end: {t_end} with schedule {dist.schedule!r}, but the "
            "stored teacher log-normaliser was computed at one temperature "
            f"(distillation.temperature={dist.temperature}); allowed: null or {dist.temperature}"
        )


def loss_and_grads(config: Config, teacher: Teacher, state: TrainState, batch):
    """(total loss, aux, grads) of one global batch; aux holds learning/z_loss, learning/total_weights, distill/*."""
    objective = DistillObjective.create(config, train.mesh_of(state), teacher)
    return train.run_objective(objective, state, batch)


def make_distill_step(config: Config, teacher: Teacher, mesh, shardings: TrainState) -> Callable:
    """`step(state, batch) -> (state, metrics)`: jitted, donated student state, teacher untouched."""
    return train.make_step(DistillObjective.create(config, mesh, teacher), shardings)


# ---------------------------------------------------------------------------------------------
# The command


def run(config: Config, restart: bool = False, whole_process: bool = False) -> TrainState | None:
    """`kiln distill` from a teacher run: validate config, teacher, data and any earlier run; then
    distil and save."""
    # The teacher's config is checked before any data or parameters are touched.
    return execute(
        config,
        _distillation,
        command="kiln distill",
        check=read_teacher_config,
        restart=restart,
        whole_process=whole_process,
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
    given, field = config.distillation.teacher_run_dir, "distillation.teacher_run_dir"
    run_dir = local_run(given, field, config, only=("config.yaml",))
    teacher_cfg = read_run_config(run_dir, "distillation.teacher_run_dir")
    check_teacher(config, teacher_cfg, run_dir)
    teacher = abstract_teacher(config, mesh, teacher_cfg, run_dir, -1)
    builder = student_builder(config, teacher_cfg)
    state = train.abstract_train_state(config, mesh, builder)
    return DistillObjective.create(config, mesh, teacher), state


__all__ = [
    "METRICS",
    "TOP_K_KEYS",
    "TOP_K_METRICS",
    "DistillObjective",
    "FeatureProjection",
    "Teacher",
    "abstract_distillation",
    "abstract_teacher",
    "check_offline",
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
