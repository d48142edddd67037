"""The config schema: what is optimised and how: optimizer, loss, the training loop, checkpoints."""

from __future__ import annotations

import math
from typing import Literal

import pydantic
from pydantic import Field

from kiln.config.schema.base import INT32_MAX, Z_LOSS_MAX, Count, PositiveInt, Section, Seed
from kiln.data.eval_tasks import parse_tasks
from kiln.errors import KilnError
from kiln.util.storage import local_dir, local_or_url, scheme

# Bytes of one directory name that filesystems commonly allow (Linux, macOS, Windows' NTFS).
NAME_MAX = 255


class MuonConfig(Section):
    """Muon (optim.name: muon): momentum orthogonalised by Newton-Schulz iterations for the
    hidden matrices; AdamW (optim.b1, b2, eps) for the embedding, LM head and norms."""

    ns_steps: PositiveInt = Field(
        5, le=20, description="Newton-Schulz iterations per update (1..20)."
    )
    beta: float = Field(0.95, ge=0, lt=1, description="Momentum decay.")
    nesterov: bool = Field(True, description="Nesterov momentum.")
    rms_scale: float = Field(
        0.2,
        gt=0,
        le=10,
        allow_inf_nan=False,
        description="Update RMS matched to AdamW's: each orthogonalised update is scaled by rms_scale * sqrt(max(fan_in, fan_out)) (Moonlight's 0.2), so AdamW learning rates carry over.",
    )
    weight_decay: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Decoupled weight decay of the hidden matrices Muon updates; null = optim.weight_decay. optim.weight_decay stays the AdamW part's (LM head, router, projection, embedding).",
    )


class AdafactorConfig(Section):
    """Adafactor (optim.name: adafactor): second moments factored into row and column means."""

    factored: bool = Field(
        True, description="Factor the second moments of matrices (false: full, as Adam's)."
    )
    decay_rate: float = Field(
        0.8,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Second-moment decay 1 - (step + 1)^-decay_rate.",
    )
    min_dim_size_to_factor: PositiveInt = Field(
        128, description="A matrix is factored when its two largest dimensions are this or larger."
    )
    clipping_threshold: float | None = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Clip each update to this root-mean-square; null = no clipping.",
    )
    eps: float = Field(1e-30, gt=0, allow_inf_nan=False, description="Added to squared gradients.")


class LionConfig(Section):
    """Lion (optim.name: lion): the sign of an interpolated momentum. Its updates are +-1 per
    entry, so its learning rate is usually 3-10 times smaller than AdamW's."""

    b1: float = Field(0.9, ge=0, lt=1, description="Interpolation of momentum and gradient.")
    b2: float = Field(0.99, ge=0, lt=1, description="Momentum decay.")


class OptimConfig(Section):
    """The optimizer, gradient clipping and the learning-rate schedule."""

    name: Literal["adamw", "muon", "adafactor", "lion"] = Field(
        "adamw",
        description="adamw; muon (Muon for hidden matrices, AdamW for the rest); adafactor; lion. Each one's own fields are in its section (optim.muon, optim.adafactor, optim.lion).",
    )
    learning_rate: float = Field(
        3e-4,
        gt=0,
        allow_inf_nan=False,
        description="Peak learning rate (> 0). Each optimizer's starting point differs (Lion's 3-10x smaller than AdamW's): docs/training.md.",
    )
    schedule: Literal["constant", "cosine", "wsd", "linear"] = Field(
        "cosine",
        description="constant, cosine (warmup then cosine to final_lr_fraction), wsd (warmup-stable-decay) or linear (warmup then linear to final_lr_fraction).",
    )
    warmup_steps: Count = Field(0, description="Linear warmup steps from 0 to learning_rate.")
    final_lr_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Learning rate at the end of cosine/linear/wsd, as a fraction of the peak.",
    )
    decay_fraction: float = Field(
        0.2,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="wsd: fraction of train.steps spent in the final decay.",
    )
    decay_shape: Literal["linear", "cosine"] = Field(
        "linear", description="wsd: shape of the final decay."
    )
    weight_decay: float = Field(
        0.1,
        ge=0,
        allow_inf_nan=False,
        description="Decoupled weight decay, by each parameter's declared role: hidden matrices, the LM head, the distillation projection and (decay_embeddings) the embedding; never norm scales or biases. With muon, optim.muon.weight_decay may give the hidden matrices their own.",
    )
    decay_embeddings: bool = Field(True, description="Weight-decay the token embedding too.")
    b1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1 (also Muon's AdamW part).")
    b2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2 (also Muon's AdamW part).")
    eps: float = Field(
        1e-8, gt=0, allow_inf_nan=False, description="AdamW epsilon (also Muon's AdamW part)."
    )
    grad_clip: float | None = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Clip gradients to this global norm; null = no clipping.",
    )
    muon: MuonConfig = Field(default_factory=MuonConfig, description="optim.name: muon.")
    adafactor: AdafactorConfig = Field(
        default_factory=AdafactorConfig, description="optim.name: adafactor."
    )
    lion: LionConfig = Field(default_factory=LionConfig, description="optim.name: lion.")

    def errors(self) -> list[str]:
        """A section of another optimizer than `name` set away from its defaults: it would be
        silently unused."""
        return [
            f"optim.{other}: set, but optim.name is {self.name}; "
            f"allowed: optim.name={other}, or optim.{other} at its defaults"
            for other in ("muon", "adafactor", "lion")
            if other != self.name and getattr(self, other) != type(getattr(self, other))()
        ]


class LossConfig(Section):
    """The language-model loss."""

    z_loss_multiplier: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description=f"Weight z of the z-loss z * logsumexp(logits)^2 per token (PaLM/ST-MoE use 1e-4); in [0, {Z_LOSS_MAX:g}], since larger weights overflow float32.",
    )
    num_vocab_tiling: PositiveInt = Field(
        1,
        description="Chunks of batch*sequence the loss is computed in, so full logits never exist; 1 = untiled. Must divide the tokens of one micro-batch on one data shard.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="Label smoothing eps: target = (1-eps) onehot + eps/V; in [0, 1).",
    )
    vocab_chunk_size: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Also cut each vocabulary shard into chunks of this many entries (online logsumexp), so loss memory stops growing with the vocabulary; costs 4/3 of the loss matmuls. Must divide vocab_size / vocabulary shards. null = whole vocabulary.",
    )
    schedule: Literal["auto", "whole", "cpu_blocked"] = Field(
        "auto",
        description="How the tiled loss walks each shard's tokens: whole = num_vocab_tiling's chunks, each chunk's logits whole (the GPU/TPU schedule); cpu_blocked = chunks of about 32 MiB of logits, their element-wise work in row blocks of about 1 MiB that stay in CPU caches; auto = cpu_blocked on CPU devices, whole otherwise. The same values either way, up to summation order. With vocab_chunk_size set, the vocabulary chunks set the schedule (auto or whole only).",
    )

    @pydantic.field_validator("z_loss_multiplier")
    @classmethod
    def _z_bound(cls, z: float) -> float:
        if z > Z_LOSS_MAX:
            raise ValueError(
                f"allowed: 0 <= z <= {Z_LOSS_MAX:g}; a larger weight makes z * logsumexp^2 "
                "overflow float32, so every step is skipped (PaLM and MaxText use 1e-4)"
            )
        return z


class PipelineConfig(Section):
    """Pipeline parallelism over the `stage` mesh axis (mesh.stage > 1; docs/pipeline.md)."""

    microbatches: PositiveInt | None = Field(
        None,
        le=65_536,
        description="Micro-batches each step's batch (each gradient-accumulation micro-batch, when train.gradient_accumulation_steps > 1 and this is set) is cut into for the pipeline, at least mesh.stage; null = train.gradient_accumulation_steps's micro-batches become the pipeline's (no accumulation loop). The bubble is (stage - 1) / (repeats x microbatches + stage - 1) of the iterations.",
    )
    repeats: PositiveInt = Field(
        1,
        le=1024,
        description="Circular (interleaved) stages: each stage runs repeats groups of consecutive layers of the staged stack (of L / (stage x repeats) layers each), a micro-batch passing every stage repeats times; the bubble shrinks by this factor. L (model.num_layers; with model.moe.first_dense_layers, the MoE layers after them) must be divisible by stage x repeats.",
    )


class TrainConfig(Section):
    """The training loop."""

    run_name: str = Field(
        "run",
        min_length=1,
        description="Name of the run directory under output_dir: one path component (no '/', not '.' or '..'), at most 255 bytes.",
    )
    output_dir: str = Field(
        "runs",
        min_length=1,
        description="Parent directory of run directories: a local path, a file:// URL (recorded as the path it names), or a URL (gs://, s3://, ...) whose run directories kiln works on in a local mirror (train.mirror_dir) and uploads after every checkpoint and at the end of the run.",
    )
    mirror_dir: str | None = Field(
        None,
        min_length=1,
        description="Local directory that stands for a URL train.output_dir (run directories, data and compile caches); null = ~/.cache/kiln/runs/<hash of the URL>. Unused when train.output_dir is local.",
    )
    steps: PositiveInt = Field(100, description="Total optimizer steps.")
    global_batch_size: PositiveInt = Field(
        8,
        description="Sequences per optimizer step, over all devices and micro-batches.",
    )
    gradient_accumulation_steps: PositiveInt = Field(
        1,
        description="Micro-batches per step; gradients are summed and divided once by the global token weight.",
    )
    seed: Seed = Field(
        0,
        description="Seed of parameter initialisation; 0 <= seed < 2^32.",
    )
    log_every_steps: PositiveInt = Field(
        10,
        description="Steps between metric writes (TensorBoard, metrics.jsonl, console).",
    )
    eval_every_steps: Count = Field(
        0,
        description="Steps between evaluations on held-out data; 0 = never.",
    )
    eval_batches: PositiveInt = Field(4, description="Global batches per evaluation.")
    eval_tasks: tuple[str, ...] = Field(
        (),
        description="Tasks scored every eval_every_steps beside the held-out loss (never when it is 0), logged as eval/<task>/<metric>: [NAME=]perplexity:PATH (text/JSONL/Parquet files, stdlib:GLOB) or [NAME=]choice:FILE.jsonl; kiln:FILE is a task shipped with kiln (see docs/generate.md).",
    )
    grad_reduce_dtype: Literal["float32", "compute"] = Field(
        "float32",
        description=(
            "Dtype in which each Transformer block's weight gradients, and the LM head's, are "
            "summed across data/fsdp devices: float32, or compute (model.dtype, e.g. bfloat16: half "
            "the gradient reduce-scatter/all-reduce bytes, but each device's partial gradient "
            "is rounded to 8 mantissa bits before the sum). Same computation when "
            "model.dtype is float32."
        ),
    )
    max_consecutive_skips: PositiveInt = Field(
        10,
        description="Stop the run after this many consecutive steps with a non-finite loss or gradient.",
    )
    hang_timeout_s: float | Literal["auto"] = Field(
        "auto",
        description="Seconds within which a training step must finish, else every process writes the Python stacks of its threads to {run_dir}/hangs/<host>-<pid>.txt and exits with code 75 (restart); compilation, checkpoint saves, evaluation and profiler traces are not timed. auto = 10 x the median time of the last 100 steps, at least 300; 0 = off.",
    )
    profile_steps: tuple[int, int] | None = Field(
        None,
        description="[start, stop]: write a jax.profiler trace of steps start..stop (both included, start <= stop <= train.steps) into the run's tensorboard/ directory (TensorBoard's profile plugin, or Perfetto); null = no trace. Start after step 1 to leave compilation out.",
    )
    compilation_cache_dir: str | None = Field(
        ".jax_cache",
        min_length=1,
        description="Persistent compilation cache, so that a restarted or resumed run does not compile again; a relative path is under train.output_dir (its local mirror when it is a URL); null = off.",
    )

    @pydantic.field_validator("profile_steps")
    @classmethod
    def _ordered(cls, window: tuple[int, int] | None) -> tuple[int, int] | None:
        allowed = "allowed: [start, stop] with 1 <= start <= stop <= train.steps, or null"
        if window is not None and window[0] < 1:
            raise ValueError(f"start {window[0]} is before step 1; {allowed}")
        if window is not None and window[0] > window[1]:
            raise ValueError(f"start {window[0]} is after stop {window[1]}; {allowed}")
        return window

    @pydantic.field_validator("hang_timeout_s", mode="plain")
    @classmethod
    def _seconds_or_auto(cls, value):
        # One error line for either form (a union would report one per member).
        number = type(value) in (int, float) and math.isfinite(value) and value >= 0
        if value == "auto" or number:
            return value if value == "auto" else float(value)
        raise ValueError("allowed: a number of seconds >= 0 (0 = off), or auto")

    @pydantic.field_validator("eval_tasks")
    @classmethod
    def _tasks_parse(cls, tasks: tuple[str, ...]) -> tuple[str, ...]:
        try:
            parse_tasks(tasks, "task")
        except KilnError as e:
            raise ValueError(str(e).removeprefix("task: ")) from None
        return tasks

    @pydantic.field_validator("output_dir")
    @classmethod
    def _local_output(cls, value: str) -> str:
        return local_or_url(value)

    @pydantic.field_validator("mirror_dir")
    @classmethod
    def _local_mirror(cls, value: str | None) -> str | None:
        return local_dir(value, "train.mirror_dir")

    @pydantic.field_validator("run_name")
    @classmethod
    def _one_component(cls, name: str) -> str:
        if name in (".", "..") or any(c in name for c in "/\\\0"):
            raise ValueError(
                "allowed: a single directory name, without '/', '\\' or NUL, not '.' or '..'; "
                "the run directory stays inside train.output_dir"
            )
        size = len(name.encode("utf-8", "surrogateescape"))
        if size > NAME_MAX:
            raise ValueError(
                f"{size} bytes long; allowed: at most {NAME_MAX} bytes (UTF-8), the usual "
                "filesystem limit of one directory name"
            )
        return name


class CheckpointConfig(Section):
    """Orbax checkpoints of the train state and data iterator."""

    every_steps: Count = Field(
        0,
        description="Steps between checkpoints; 0 = only at the end (and on SIGTERM).",
    )
    keep: PositiveInt = Field(3, description="How many latest checkpoints to keep.")
    keep_every: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Also keep every checkpoint whose step is a multiple of this, forever.",
    )
    async_save: bool = Field(
        True, description="Write checkpoints in the background while training goes on."
    )
    verify: bool = Field(
        True,
        description="At restore, check every file of a checkpoint against the CRC-32 recorded "
        "when it was saved (false: only that each file is there with its size).",
    )
    local_dir: str | None = Field(
        None,
        description="Node-local directory (each host its own, e.g. a local SSD) for frequent checkpoints beside the persistent ones: each process saves the shards it holds, with the data iterator's state, to local_dir/<train.run_name>/process_<i>/<step>/. A resume takes the newest step complete on every process in either tier. A local path, not a URL.",
    )
    local_every_steps: Count = Field(
        0,
        description="Steps between local checkpoints (needs checkpoint.local_dir); 0 = none. A step that is also a persistent save (checkpoint.every_steps) is saved to the persistent tier only.",
    )
    local_keep: PositiveInt = Field(
        2, description="How many latest local checkpoints each process keeps."
    )
    load_params_from: str | None = Field(
        None,
        description="Initialise parameters (only) from this run directory or checkpoint; a URL (gs://, s3://, ...) is mirrored into {train.output_dir}/.cache/remote-runs/ first. The optimizer starts fresh.",
    )

    @pydantic.field_validator("load_params_from")
    @classmethod
    def _source(cls, value: str | None) -> str | None:
        return local_or_url(value)

    @pydantic.field_validator("local_dir")
    @classmethod
    def _node_local(cls, value: str | None) -> str | None:
        if value is not None and scheme(value) not in (None, "file"):
            raise ValueError(
                f"a {scheme(value)}:// URL; allowed: a directory on this host's own disk (a "
                "local path or file:// URL), the persistent tier being checkpoint.every_steps "
                "under train.output_dir"
            )
        return local_dir(value, "checkpoint.local_dir")

    @pydantic.model_validator(mode="after")
    def _local_tier(self) -> CheckpointConfig:
        if self.local_every_steps and self.local_dir is None:
            raise ValueError(
                f"checkpoint.local_every_steps is {self.local_every_steps} but "
                "checkpoint.local_dir is not set; allowed: a node-local checkpoint.local_dir, or "
                "checkpoint.local_every_steps: 0"
            )
        return self
