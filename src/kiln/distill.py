"""`kiln distill`: a frozen teacher from a run directory trains a student through the trainer's loop.

The teacher is the model of `distillation.teacher_run_dir` (its `config.yaml` and latest
checkpoint, parameters only), restored straight into its shardings on the student's mesh. It is
an argument of the jitted step, not part of the train state: no optimizer state, no gradients,
forward only. The student is an ordinary kiln train state; when `distillation.layer_map` pairs
layers of different widths, a learned `FeatureProjection` (one [D_student, D_teacher] map per
pair) is the `distill_projection` of the `Student` model, so it is a trainable parameter like
any other, checkpointed and resumed with the student. Its keys sit beside the backbone's, so
the student's checkpoints also serve `kiln train` with `checkpoint.load_params_from` (which
restores only the parameters it knows).

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

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kiln import losses, train
from kiln.checkpoint import latest_complete_step, restore_params
from kiln.config import Config, DistillationConfig, read_run_config
from kiln.errors import KilnError
from kiln.mesh import batch_sharding, in_mesh, make_mesh, sharded_abstract, sharded_init
from kiln.model import DTYPES, FAMILIES, LanguageModel, build_model, flops_per_token
from kiln.model.student import FeatureProjection, student_class
from kiln.train import BATCH_KEYS, Batch, TrainState

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

    def model(self, params: nnx.State | None = None) -> LanguageModel:
        return nnx.merge(self.graphdef, self.params if params is None else params, self.rest)


def read_teacher_config(config: Config) -> tuple[Config, Path, int]:
    """(teacher config, run directory, latest step), checked against the student; KilnError if not."""
    given = config.distillation.teacher_run_dir
    field = "distillation.teacher_run_dir"
    if not given:
        raise KilnError(f"{field}: not set; allowed: the run directory of a trained kiln model")
    run_dir = Path(given).expanduser()
    if not run_dir.is_dir():
        raise KilnError(f"{field}: {run_dir} is not a directory; train the teacher first")
    teacher = read_run_config(run_dir, field)
    check_teacher(config, teacher, run_dir)
    step = latest_complete_step(run_dir / "checkpoints")
    if step is None:
        raise KilnError(f"{field}: no complete checkpoint in {run_dir / 'checkpoints'}")
    return teacher, run_dir, step


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
    graphdef, abstract = sharded_abstract(
        lambda: build_model(teacher_cfg.model, rngs=nnx.Rngs(0)), mesh, config.mesh.rules
    )
    target, rest = nnx.split_state(abstract, nnx.Param, ...)
    params, _ = restore_params(run_dir, target)
    return Teacher(teacher_cfg, run_dir, step, graphdef, params, rest)


def init_student(
    config: Config, mesh, teacher_cfg: Config, *, load_params: bool
) -> tuple[TrainState, str | None]:
    """The student's train state (with a feature projection if widths differ), and a note."""
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

    model = sharded_init(build, mesh, config.mesh.rules)
    note = None
    source = config.checkpoint.load_params_from
    if load_params and source:
        # The backbone only: the projection starts fresh, whatever the source holds.
        backbone = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("distill_projection")))
        params, step = restore_params(source, nnx.state(model, backbone))
        nnx.update(model, params)
        note = f"student parameters from {source} (step {step})"
    return train.state_from_model(config, mesh, model), note


# ---------------------------------------------------------------------------------------------
# Loss sums and gradients


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


def _teacher_outputs(config: Config, teacher: Teacher, teacher_params, mb: Batch):
    """Teacher hidden states [B,S,E] and features [P,B,S,E] (or None): forward only."""
    model = teacher.model(jax.lax.stop_gradient(teacher_params))
    layers = [t for _, t in config.distillation.layer_map]
    out = model.hidden_states(mb["inputs"], mb["positions"], mb["segment_ids"], collect=layers)
    return jax.lax.stop_gradient((out.hidden, out.features, model.head_weight()))


def _student_sums(
    config: Config, teacher: Teacher, state: TrainState, params, mb, outs, temp, mesh
):
    """Weighted loss sums of one micro-batch (float32 scalars), differentiable in `params`."""
    dist, loss = config.distillation, config.loss
    t_hidden, t_feats, t_head = outs
    model = state.model(params)
    layers = [s for s, _ in dist.layer_map]
    out = model.hidden_states(mb["inputs"], mb["positions"], mb["segment_ids"], collect=layers)
    hidden, head = out.hidden, model.head_weight()
    hard = train.hidden_loss_sums(config, hidden, head, mb, mesh)
    soft = losses.soft_loss_sums(
        hidden,
        head,
        t_hidden,
        t_head,
        mb["targets"],
        mb["weights"],
        temperature=temp,
        student_softcap=config.model.logit_softcap,
        teacher_softcap=teacher.config.model.logit_softcap,
        num_vocab_tiling=loss.num_vocab_tiling,
        mesh=mesh,
        rules=config.mesh.rules,
    )
    feature_sum = jnp.zeros((), jnp.float32)
    if layers:
        per_token = losses.feature_loss(model.project(out.features), t_feats, dist.feature_loss)
        feature_sum = jnp.sum(per_token * mb["weights"].astype(jnp.float32))
    return {
        "hard_sum": hard["loss_sum"],
        "z_loss_sum": hard["z_loss_sum"],
        "weight_sum": hard["weight_sum"],
        "soft_sum": soft["soft_sum"],
        "teacher_loss_sum": soft["teacher_loss_sum"],
        "feature_sum": feature_sum,
    }


def _means(sums):
    w = sums["weight_sum"]
    denom = jnp.where(w > 0, w, 1.0)
    return sums["hard_sum"] / denom, sums["soft_sum"] / denom, sums["feature_sum"] / denom


def _coefficients(config: Config, sums, knobs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """d total / d (hard, soft, feature) at the per-token means of `sums` (see module docstring)."""
    dist = config.distillation

    def total(h, s, f):
        kw = {"alpha": knobs["alpha"], "beta": knobs["beta"], "balance": dist.balance}
        return losses.distillation_loss(h, s, f, **kw)[0]

    return jax.grad(total, argnums=(0, 1, 2))(*_means(jax.lax.stop_gradient(sums)))


def _loss_and_grads(config, teacher, state, teacher_params, batch, mesh, param_shardings):
    """(total loss, aux, grads) of a global batch; sums accumulated, divided once by the weight."""
    accum = config.train.gradient_accumulation_steps
    knobs = schedule_values(config.distillation, state.step, config.train.steps)
    f32 = jnp.float32

    def forward_sums(mb):
        outs = _teacher_outputs(config, teacher, teacher_params, mb)
        return _student_sums(
            config, teacher, state, state.params, mb, outs, knobs["temperature"], mesh
        )

    def sums_and_grads(mb, coefs):
        outs = _teacher_outputs(config, teacher, teacher_params, mb)

        def objective(params):
            sums = _student_sums(
                config, teacher, state, params, mb, outs, knobs["temperature"], mesh
            )
            c = _coefficients(config, sums, knobs) if coefs is None else coefs
            value = c[0] * sums["hard_sum"] + c[1] * sums["soft_sum"] + c[2] * sums["feature_sum"]
            return value, sums

        (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        return sums, jax.tree.map(lambda g: g.astype(f32), grads)

    if accum == 1:
        sums, grads = sums_and_grads(batch, None)
    else:
        micro = train._micro_batches(batch, accum, mesh, config.mesh.rules)
        zero_sums = {k: jnp.zeros((), f32) for k in SUM_KEYS}
        coefs = None
        if config.distillation.balance == "dynamic":
            # First pass: the global means that fix the balancing coefficients.
            def add_sums(acc, mb):
                sums = forward_sums(mb)
                return {k: acc[k] + sums[k] for k in acc}, None

            global_sums, _ = jax.lax.scan(add_sums, zero_sums, micro)
            coefs = _coefficients(config, global_sums, knobs)
        sums, grads = train.accumulate(
            lambda mb: sums_and_grads(mb, coefs), micro, state.params, param_shardings, SUM_KEYS
        )
    w = sums["weight_sum"]
    denom = jnp.where(w > 0, w, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    hard, soft, feature = _means(sums)
    total, scales = losses.distillation_loss(
        hard,
        soft,
        feature,
        alpha=knobs["alpha"],
        beta=knobs["beta"],
        balance=config.distillation.balance,
    )
    aux = {
        "z_loss": sums["z_loss_sum"] / denom,
        "total_weights": w,
        "distill/hard_loss": hard,
        "distill/soft_loss": soft,
        "distill/feature_loss": feature,
        "distill/total_loss": total,
        "distill/feature_mag_scale": scales["feature_mag_scale"],
        "distill/kd_mag_scale": scales["kd_mag_scale"],
        "distill/teacher_loss": sums["teacher_loss_sum"] / denom,
        "distill/alpha": knobs["alpha"],
        "distill/temperature": knobs["temperature"],
        "distill/beta": knobs["beta"],
    }
    return total, aux, grads


def loss_and_grads(config: Config, teacher: Teacher, state: TrainState, batch):
    """(total loss, aux, grads) of one global batch; aux holds z_loss, total_weights, distill/*."""
    mesh = jax.tree.leaves(state.params)[0].sharding.mesh
    shardings = jax.tree.map(lambda x: x.sharding, state.params)
    batch = train.place_batch(batch, mesh, config)

    def fn(s, tp, b):
        return _loss_and_grads(config, teacher, s, tp, b, mesh, shardings)

    return in_mesh(jax.jit(fn), mesh, config.mesh.rules)(state, teacher.params, batch)


def make_distill_step(config: Config, teacher: Teacher, mesh, shardings: TrainState) -> Callable:
    """`step(state, batch) -> (state, metrics)`: jitted, donated student state, teacher untouched."""
    update = train.make_update(config)

    def distill_step(state: TrainState, teacher_params, batch: Batch):
        loss, aux, grads = _loss_and_grads(
            config, teacher, state, teacher_params, batch, mesh, shardings.params
        )
        state, metrics = update(state, loss, aux, grads)
        return state, {**metrics, **{k: v for k, v in aux.items() if k.startswith("distill/")}}

    data = batch_sharding(mesh, config.mesh.rules)
    teacher_shardings = jax.tree.map(lambda x: x.sharding, teacher.params)
    jitted = jax.jit(
        distill_step,
        in_shardings=(shardings, teacher_shardings, {k: data for k in BATCH_KEYS}),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    jitted = in_mesh(jitted, mesh, config.mesh.rules)
    return lambda state, batch: jitted(state, teacher.params, batch)


def distill_flops_per_token(config: Config, teacher_cfg: Config) -> float:
    """Student training FLOPs plus the teacher's forward pass (1/3 of its training FLOPs)."""
    seq = config.data.seq_len
    student = flops_per_token(config.model, seq)
    teacher = flops_per_token(teacher_cfg.model, seq) / 3.0
    pairs = len(config.distillation.layer_map)
    d_s, d_t = config.model.d_model, teacher_cfg.model.d_model
    return student + teacher + (6.0 * pairs * d_s * d_t if d_s != d_t else 0.0)


# ---------------------------------------------------------------------------------------------
# The run


def run(config: Config) -> TrainState:
    """`kiln distill`: validate config, teacher, data and any earlier run; then distil and save."""
    from kiln.data import make_datasets
    from kiln.distributed import initialize
    from kiln.runner import restore_latest, resume_notes

    initialize(config)  # before any device is touched
    mesh = make_mesh(config)
    read_teacher_config(config)  # cheap checks before any data or parameters are touched
    datasets = make_datasets(config)
    notes = resume_notes(config)
    teacher = load_teacher(config, mesh)
    notes.append(f"teacher {teacher.run_dir} (step {teacher.step})")
    fresh = latest_complete_step(config.run_dir / "checkpoints") is None
    state, note = init_student(config, mesh, teacher.config, load_params=fresh)
    if note:
        notes.insert(0, note)
    train_iter = datasets.train_iterator()
    state, resumed = restore_latest(config, state, train_iter)
    if resumed:
        notes.insert(0, resumed)
    return train.run_loop(
        config,
        mesh,
        state,
        step_fn=make_distill_step(config, teacher, mesh, train.shardings_of(state)),
        datasets=datasets,
        batches=train_iter,
        notes=notes,
        flops_per_token=distill_flops_per_token(config, teacher.config),
    )


__all__ = [
    "METRICS",
    "FeatureProjection",
    "Teacher",
    "check_teacher",
    "distill_flops_per_token",
    "init_student",
    "load_teacher",
    "loss_and_grads",
    "make_distill_step",
    "read_teacher_config",
    "run",
    "schedule_values",
    "student_class",
]
