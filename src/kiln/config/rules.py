"""The rules between fields of a Config (e.g. heads that divide the width, a batch that the
mesh splits evenly), each broken rule one line naming the fields, the values and what is allowed."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

from kiln.config.axes import MESH_AXES, resolve, shards_per_dim, without_axis
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.config.loader import Config
    from kiln.config.schema import DistillationConfig, DistributedConfig, ModelConfig


def cross_field_errors(
    c: Config, valid: Collection[str] | None = None, num_devices: int | None = None
) -> Iterator[str]:
    """Every rule that relates two fields, each one line.

    A rule is skipped when a section it reads is not in `valid` (None: all are valid; that
    section's own errors are reported instead); `num_devices` resolves mesh -1 sizes when known.
    """

    def ok(*sections: str) -> bool:
        return valid is None or all(s in valid for s in sections)

    m, t = c.model, c.train
    if ok("model"):
        if m.head_dim is None and m.d_model % m.num_heads:
            yield (
                f"model.num_heads: {m.num_heads} does not divide model.d_model={m.d_model}; "
                "choose a divisor or set model.head_dim"
            )
        if m.num_heads % m.kv_heads:
            yield f"model.num_kv_heads: {m.kv_heads} does not divide model.num_heads={m.num_heads}"
        if m.resolved_head_dim % 2:
            yield f"model.head_dim: rotary embeddings need an even head width, got {m.resolved_head_dim}"
        if m.moe is not None and m.moe.first_dense_layers >= m.num_layers:
            yield (
                f"model.moe.first_dense_layers: {m.moe.first_dense_layers} leaves no MoE layer "
                f"of model.num_layers={m.num_layers}; allowed: 0..{m.num_layers - 1}"
            )
    if ok("data", "model") and c.data.seq_len > m.max_seq_len:
        yield f"data.seq_len: {c.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}"
    if ok("data"):
        yield from c.data.errors()
    if ok("optim"):
        yield from c.optim.errors()
    if ok("optim", "train") and c.optim.warmup_steps > t.steps:
        yield (
            f"optim.warmup_steps: {c.optim.warmup_steps} exceeds train.steps={t.steps}; "
            f"allowed: at most train.steps (e.g. optim.warmup_steps={t.steps // 4})"
        )
    if ok("train") and t.profile_steps is not None and t.profile_steps[1] > t.steps:
        yield (
            f"train.profile_steps: {list(t.profile_steps)} ends after train.steps={t.steps}; "
            "allowed: [start, stop] with 1 <= start <= stop <= train.steps, or null"
        )
    if ok("distillation"):
        yield from _distillation_schedule_errors(c.distillation)
    if ok("distillation", "model"):
        yield from _layer_map_errors(c.distillation, m)
    if ok("distributed"):
        yield from _distributed_errors(c.distributed)
    if ok("loss") and c.loss.schedule == "cpu_blocked" and c.loss.vocab_chunk_size is not None:
        yield (
            f"loss.schedule: cpu_blocked cuts rows of whole-vocabulary chunks, but "
            f"loss.vocab_chunk_size={c.loss.vocab_chunk_size} cuts the vocabulary; allowed: "
            "loss.schedule auto or whole, or loss.vocab_chunk_size null"
        )
    divisible = t.global_batch_size % t.gradient_accumulation_steps == 0
    if ok("train") and not divisible:
        yield (
            f"train.global_batch_size: {t.global_batch_size} is not divisible by "
            f"train.gradient_accumulation_steps={t.gradient_accumulation_steps}"
        )
    if ok("mesh", "model"):
        yield from _expert_errors(c, num_devices)
    if ok("mesh", "model", "train", "pipeline", "distillation"):
        yield from _pipeline_errors(c, num_devices)
    sizes = {a: getattr(c.mesh, a) for a in MESH_AXES}
    if ok("mesh") and sum(s == -1 for s in sizes.values()) > 1:
        yield f"mesh: at most one size may be -1, got {sizes}"
    elif divisible and ok("mesh", "train", "data", "loss", "model"):
        yield from _mesh_errors(c, num_devices)


def _mesh_errors(c: Config, num_devices: int | None) -> Iterator[str]:
    """The batch, sequence and vocabulary of one step against the shards the mesh gives them."""
    mesh = {a: getattr(c.mesh, a) for a in MESH_AXES}
    if num_devices is not None:
        try:
            mesh = c.mesh.sizes(num_devices)
        except KilnError as e:
            yield str(e)
            return
    elif -1 in mesh.values():
        return  # checked again once the device count is known
    t, loss, seq_len = c.train, c.loss, c.data.seq_len
    accum, pieces = pipeline_split(c, mesh["stage"])
    if t.global_batch_size % (accum * pieces):
        return  # reported by _pipeline_errors
    # One accumulation micro-batch is what the embedding, the LM head and the loss see; in
    # pipeline stages it is cut into `pieces`, each on every stage's devices at once (the batch
    # rule without `stage`, kiln.parallel.pipeline).
    outside = t.global_batch_size // accum
    micro = outside // pieces
    # Shards as the resolver gives them to the logits [batch, length, vocab] (the token arrays
    # [batch, length] get the same first two): an axis claimed by batch is not length's too.
    spec = resolve(("batch", "length", "vocab"), c.mesh.rules)
    batch_shards, seq_shards, vocab_shards = shards_per_dim(spec, mesh)
    [stage_shards] = shards_per_dim(resolve(("batch",), without_axis(c.mesh.rules, "stage")), mesh)
    rows, cols = outside // batch_shards, seq_len // seq_shards  # the loss's part on one shard
    if outside % batch_shards:
        yield (
            f"train.global_batch_size: micro-batch of {outside} sequences (global_batch_size "
            f"{t.global_batch_size} / {accum} accumulation micro-batches) is not divisible by "
            f"the {batch_shards} batch shards of the mesh ({mesh})"
        )
    elif pieces > 1 and micro % stage_shards:
        yield (
            f"train.global_batch_size: pipeline micro-batch of {micro} sequences ({outside} / "
            f"{pieces} micro-batches) is not divisible by the {stage_shards} batch shards "
            f"of one stage ({mesh})"
        )
    elif seq_len % seq_shards:
        yield f"data.seq_len: {seq_len} is not divisible by the {seq_shards} sequence shards of the mesh"
    elif c.model.context_parallel == "ring" and seq_shards == 1:
        yield (
            "model.context_parallel: 'ring' passes keys and values around the sequence shards, "
            f"but the mesh {mesh} has none (mesh.rules.length={c.mesh.rules['length']}); "
            "allowed: all_gather, or mesh.sequence > 1"
        )
    elif c.model.balances_context(seq_shards) and seq_len % (2 * seq_shards):
        yield (
            f"data.seq_len: {seq_len} is not divisible by 2 x the {seq_shards} sequence shards "
            "of the mesh, which model.context_load_balance needs (each shard holds two "
            f"chunks); allowed: a multiple of {2 * seq_shards}, or "
            "model.context_load_balance: false"
        )
    elif seq_len % (residual_shards := _residual_length_shards(c, mesh)):
        yield (
            f"data.seq_len: {seq_len} is not divisible by the {residual_shards} shards of the "
            f"residual stream's length (mesh.rules.act_length={c.mesh.rules['act_length']} on "
            f"mesh {mesh}); allowed: a multiple of {residual_shards}, or set "
            "mesh.rules.act_length to [sequence]"
        )
    elif (rows * cols) % loss.num_vocab_tiling:
        yield (
            f"loss.num_vocab_tiling: {loss.num_vocab_tiling} does not divide the "
            f"{rows * cols} tokens of one micro-batch on one shard "
            f"({rows} sequences x {cols} tokens); allowed: a divisor of that number"
        )
    vocab, chunk = c.model.vocab_size, loss.vocab_chunk_size
    if vocab == "auto":
        return  # checked once the tokenizer has set it (kiln.data.resolve)
    if chunk is not None and (vocab % vocab_shards or (vocab // vocab_shards) % chunk):
        yield (
            f"loss.vocab_chunk_size: {chunk} does not divide the vocabulary of one shard "
            f"(model.vocab_size {vocab} / {vocab_shards} vocabulary shards); "
            "allowed: a divisor of that number, or null"
        )


def pipeline_split(c: Config, stages: int) -> tuple[int, int]:
    """(gradient-accumulation micro-batches of a step, pipeline micro-batches each is cut into)
    on a mesh of `stages` pipeline stages: without stages (1, or -1 unresolved) the
    accumulation's alone; with them, pipeline.microbatches inside each accumulation
    micro-batch, or (null) the accumulation's micro-batches become the pipeline's."""
    accum, pieces = c.train.gradient_accumulation_steps, c.pipeline.microbatches
    if stages in (1, -1):
        return accum, 1
    return (1, accum) if pieces is None else (accum, pieces)


def _pipeline_errors(c: Config, num_devices: int | None) -> Iterator[str]:
    """Pipeline stages against the model, the batch and each other."""
    p, m, t = c.pipeline, c.model, c.train
    stages = c.mesh.stage
    if num_devices is not None and stages == -1:
        try:
            stages = c.mesh.sizes(num_devices)["stage"]
        except KilnError:
            return  # reported by the mesh's own check
    if stages == 1:
        for name, value, default in (
            ("repeats", p.repeats, 1),
            ("microbatches", p.microbatches, None),
        ):
            if value != default:
                yield (
                    f"pipeline.{name}: {value} sets up pipeline stages, but mesh.stage is 1; "
                    f"allowed: {'null' if default is None else default}, or mesh.stage > 1"
                )
        return
    if stages == -1:
        return  # checked again once the device count is known
    d = c.distillation
    if d.teacher_run_dir is not None or d.teacher_logits_dir is not None:
        yield (
            f"mesh.stage: {stages} pipeline stages do not run distillation's teacher and "
            "student features; allowed: mesh.stage 1 for distillation"
        )
    groups = stages * p.repeats
    staged = m.staged_layers()
    if staged % groups and staged != m.num_layers:
        yield (
            f"model.moe.first_dense_layers: {m.num_layers - staged} leaves {staged} MoE layers "
            f"of model.num_layers={m.num_layers}, not divisible by mesh.stage x "
            f"pipeline.repeats = {stages} x {p.repeats} = {groups} (the MoE stack runs in the "
            "stages, each stage and repeat as many layers); allowed: a multiple of it"
        )
    elif staged % groups:
        yield (
            f"model.num_layers: {m.num_layers} is not divisible by mesh.stage x "
            f"pipeline.repeats = {stages} x {p.repeats} = {groups} (each stage and repeat runs "
            "as many layers); allowed: a multiple of it"
        )
    accum, pieces = pipeline_split(c, stages)
    field, note = "pipeline.microbatches", ""  # where the pipeline's micro-batches come from
    if p.microbatches is None:
        field = "train.gradient_accumulation_steps"
        note = " (its micro-batches are the pipeline's while pipeline.microbatches is null)"
    if pieces < stages:
        yield (
            f"{field}: {pieces} micro-batches for mesh.stage={stages} pipeline stages{note}; "
            f"allowed: at least {stages} (every stage needs one to work on)"
        )
    elif t.global_batch_size % (accum * pieces) and p.microbatches is not None:
        yield (
            f"train.global_batch_size: {t.global_batch_size} is not divisible by {accum} "
            f"accumulation x {pieces} pipeline micro-batches (pipeline.microbatches)"
        )


def _expert_errors(c: Config, num_devices: int | None) -> Iterator[str]:
    """The experts against the mesh axes that split them (mesh.rules.experts).

    A mesh axis of a family without experts (mesh.expert > 1 with llama) is allowed: it splits
    the batch and shards parameters as fsdp does, and a dense student distilled from an MoE
    teacher shares the teacher's expert-parallel mesh.
    """
    axes = c.mesh.rules["experts"]
    if len(axes) > 1:
        yield (
            f"mesh.rules.experts: {axes}; allowed: at most one mesh axis (the all-to-all that "
            "sends tokens to their experts runs over one axis)"
        )
        return
    moe = c.model.moe
    if moe is None or not axes:
        return
    sizes = {a: getattr(c.mesh, a) for a in MESH_AXES}
    if num_devices is not None:
        try:
            sizes = c.mesh.sizes(num_devices)
        except KilnError:
            return  # reported by the mesh's own check
    axis, size = axes[0], sizes[axes[0]]
    if size == 1 and moe.buffer_factor is not None:
        yield (
            f"model.moe.buffer_factor: {moe.buffer_factor} bounds expert parallelism's receive "
            f"buffer, but mesh.{axis} is 1 (no experts are sent anywhere); allowed: null, or "
            f"mesh.{axis} > 1"
        )
    if size != -1 and moe.num_experts % size:
        divisors = [d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]
        yield (
            f"mesh.{axis}: {size} does not divide model.moe.num_experts={moe.num_experts} "
            f"(mesh.rules.experts: [{axis}]); allowed: a divisor of {moe.num_experts} "
            f"({', '.join(map(str, divisors))})"
        )


def _residual_length_shards(c: Config, mesh: dict[str, int]) -> int:
    """Shards of the residual stream's length dimension (kiln.model.llama.ACT_BSD)."""
    spec = resolve(("batch", "act_length", "act_embed"), c.mesh.rules)
    return shards_per_dim(spec, mesh)[1]


def _distillation_schedule_errors(dist: DistillationConfig) -> Iterator[str]:
    if dist.schedule == "constant":
        for name in ("alpha_end", "temperature_end", "beta_end"):
            if getattr(dist, name) is not None:
                yield (
                    f"distillation.{name}: set to {getattr(dist, name)}, but "
                    "distillation.schedule is constant; allowed: schedule linear or cosine, "
                    f"or no {name}"
                )


def _layer_map_errors(dist: DistillationConfig, model: ModelConfig) -> Iterator[str]:
    """Student layers against the student (the teacher's are checked when it is loaded)."""
    for student, teacher in dist.layer_map:
        if student >= model.num_layers:
            yield (
                f"distillation.layer_map: student layer {student} in [{student}, {teacher}] "
                f"is out of range; allowed: 0..{model.num_layers - 1} "
                f"(model.num_layers={model.num_layers})"
            )


def _distributed_errors(d: DistributedConfig) -> Iterator[str]:
    if d.auto and (d.num_processes != 1 or d.process_id != 0):
        yield (
            "distributed.auto: true takes num_processes and process_id from the cluster; "
            f"got num_processes={d.num_processes}, process_id={d.process_id} (remove them)"
        )
    elif d.process_id >= d.num_processes:
        yield f"distributed.process_id: {d.process_id} must be < distributed.num_processes={d.num_processes}"
