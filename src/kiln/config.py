"""The run configuration: a frozen pydantic schema, YAML loading with `base_config`, overrides."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from kiln.errors import KilnError

MESH_AXES = ("data", "fsdp", "tensor", "sequence")

DEFAULT_AXIS_RULES: dict[str, list[str]] = {
    # Parameters.
    "vocab": ["tensor"],
    "embed": ["fsdp"],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": [],
    "mlp": ["tensor"],
    "layers": [],
    "norm": [],
    # Activations.
    "batch": ["data", "fsdp"],
    "length": ["sequence"],
    "act_embed": [],
    "act_heads": ["tensor"],
    "act_kv_heads": ["tensor"],
    "act_mlp": ["tensor"],
    "act_vocab": ["tensor"],
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Section):
    """Shape and numerics of the decoder-only Transformer."""

    family: Literal["llama"] = Field(
        "llama",
        description="Model family (the implementation in kiln.model.FAMILIES): llama = pre-norm RMSNorm blocks, grouped-query attention with rotary embeddings, SwiGLU MLP.",
    )
    vocab_size: int = Field(
        384,
        gt=0,
        description="Vocabulary size of the embedding and LM head; >= the tokenizer's vocabulary (a multiple of 128 is fastest).",
    )
    d_model: int = Field(256, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(4, gt=0, description="Number of Transformer blocks.")
    num_heads: int = Field(4, gt=0, description="Number of query heads.")
    num_kv_heads: int | None = Field(
        None,
        gt=0,
        description="Number of key/value heads (grouped-query attention); null = num_heads.",
    )
    head_dim: int | None = Field(
        None, gt=0, description="Width of one attention head; null = d_model / num_heads."
    )
    d_ff: int = Field(688, gt=0, description="Hidden width of the SwiGLU MLP.")
    tie_embeddings: bool = Field(
        False,
        description="Compute logits with the token-embedding matrix instead of a separate LM head.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Compute dtype of activations and matmuls."
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Storage dtype of parameters (and optimizer moments)."
    )
    logits_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="Input dtype of the LM head matmul (forward and both backward products; float32 accumulation either way); null = the compute dtype `dtype`, float32 = keep the head in full precision.",
    )
    remat: Literal["none", "full", "save_dots"] = Field(
        "none",
        description="Activation rematerialisation per block: none, full (recompute everything), save_dots (keep matmul outputs).",
    )
    qk_norm: bool = Field(
        False, description="RMS-normalise queries and keys per head before attention."
    )
    logit_softcap: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="If set, logits = cap * tanh(logits / cap)."
    )
    max_seq_len: int = Field(
        2048, gt=0, description="Longest sequence the model supports (rotary tables)."
    )
    rope_theta: float = Field(
        10000.0,
        gt=0,
        allow_inf_nan=False,
        description="Base of the rotary position embedding frequencies.",
    )
    norm_eps: float = Field(
        1e-5, gt=0, allow_inf_nan=False, description="Epsilon of every RMSNorm."
    )
    init_std: float = Field(
        0.02,
        gt=0,
        allow_inf_nan=False,
        description="Standard deviation of the normal initialiser of embeddings and projections.",
    )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


class MeshConfig(_Section):
    """Device mesh sizes and the logical-axis -> mesh-axis rules."""

    data: int = Field(
        1, description="Data-parallel size (replicated params); -1 = fill the remaining devices."
    )
    fsdp: int = Field(
        -1, description="Fully-sharded data-parallel size (params sharded, batch split); -1 = fill."
    )
    tensor: int = Field(
        1, description="Tensor-parallel size (heads, MLP and vocab split); -1 = fill."
    )
    sequence: int = Field(
        1, description="Sequence-parallel size (activations split along length); -1 = fill."
    )
    rules: dict[str, list[Literal["data", "fsdp", "tensor", "sequence"]]] = Field(
        default_factory=lambda: {k: list(v) for k, v in DEFAULT_AXIS_RULES.items()},
        description="Logical axis name -> mesh axes that shard it ([] = replicated). Keys given here replace the defaults one by one.",
    )

    @pydantic.field_validator("data", "fsdp", "tensor", "sequence")
    @classmethod
    def _size(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"got {v}; a mesh size is a positive integer or -1 (fill)")
        return v

    @pydantic.field_validator("rules")
    @classmethod
    def _rules(cls, rules: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, axes in rules.items():
            if len(set(axes)) != len(axes):
                raise ValueError(f"rule {name!r} repeats a mesh axis: {axes}")
        return {**{k: list(v) for k, v in DEFAULT_AXIS_RULES.items()}, **rules}

    def sizes(self, num_devices: int) -> dict[str, int]:
        """Mesh axis sizes with -1 resolved against `num_devices`."""
        given = {a: getattr(self, a) for a in MESH_AXES}
        fill = [a for a, s in given.items() if s == -1]
        known = math.prod(s for s in given.values() if s != -1)
        if fill:
            if num_devices % known:
                raise KilnError(
                    f"mesh: sizes {given} leave {num_devices} devices / {known} = "
                    f"{num_devices / known:g} for mesh.{fill[0]}=-1; it must be a whole number"
                )
            given[fill[0]] = num_devices // known
        elif known != num_devices:
            raise KilnError(
                f"mesh: data*fsdp*tensor*sequence = {known} but {num_devices} devices are "
                "present; make the product equal the device count or set one size to -1"
            )
        return given


class DataConfig(_Section):
    """Where tokens come from and how they are cut into sequences."""

    source: Literal["synthetic", "text", "jsonl", "parquet", "tokens"] = Field(
        "synthetic",
        description="synthetic (generated tokens), text/jsonl/parquet (raw files, tokenized into a cache on first use) or tokens (shards from `kiln prepare`).",
    )
    synthetic_kind: Literal["uniform", "markov"] = Field(
        "markov",
        description="For source=synthetic: uniform random tokens, or a fixed random Markov chain whose entropy is known (learnable).",
    )
    paths: list[str] = Field(
        default_factory=list,
        description="Input files, directories or globs; 'stdlib:GLOB' globs the running Python's standard library (site-packages excluded), e.g. 'stdlib:**/*.py'. For source=tokens: `kiln prepare` output directories.",
    )
    field: str = Field("text", description="JSONL/Parquet field holding the document text.")
    tokenizer: str = Field(
        "byte",
        description="'byte' (built-in byte-level), or a local path to a tokenizer.json or sentencepiece .model file.",
    )
    seq_len: int = Field(256, gt=1, description="Tokens per training sequence.")
    seed: int = Field(0, description="Seed of shuffling and of synthetic data.")
    eval_fraction: float = Field(
        0.01,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="Fraction of documents held out for evaluation.",
    )
    cache_dir: str | None = Field(
        None, description="Where raw sources are tokenized to; null = {train.output_dir}/.cache."
    )
    prefetch_batches: int = Field(
        4,
        ge=1,
        le=64,
        description="Batches each process prepares ahead of the trainer, on background threads.",
    )


class OptimConfig(_Section):
    """AdamW, gradient clipping and the learning-rate schedule."""

    learning_rate: float = Field(3e-4, allow_inf_nan=False, description="Peak learning rate (> 0).")
    schedule: Literal["constant", "cosine", "wsd", "linear"] = Field(
        "cosine",
        description="constant, cosine (warmup then cosine to final_lr_fraction), wsd (warmup-stable-decay) or linear (warmup then linear to final_lr_fraction).",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps from 0 to learning_rate.")
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
        description="Decoupled weight decay (norm scales and biases are excluded).",
    )
    b1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    b2: float = Field(0.95, ge=0, lt=1, description="Adam beta2.")
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False, description="Adam epsilon.")
    grad_clip: float | None = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Clip gradients to this global norm; null = no clipping.",
    )


class LossConfig(_Section):
    """The language-model loss."""

    z_loss_multiplier: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Weight z of the z-loss z * logsumexp(logits)^2 per token (PaLM/ST-MoE use 1e-4); finite, >= 0.",
    )
    num_vocab_tiling: int = Field(
        1,
        ge=1,
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
        description="Also cut each vocabulary shard into chunks of this many entries (online logsumexp), so loss memory stops growing with the vocabulary; costs 4/3 of the loss matmuls. Must divide vocab_size / vocabulary shards. null = whole vocabulary.",
    )


class TrainConfig(_Section):
    """The training loop."""

    run_name: str = Field(
        "run", min_length=1, description="Name of the run directory under output_dir."
    )
    output_dir: str = Field(
        "runs", min_length=1, description="Parent directory of run directories."
    )
    steps: int = Field(100, gt=0, description="Total optimizer steps.")
    global_batch_size: int = Field(
        8, gt=0, description="Sequences per optimizer step, over all devices and micro-batches."
    )
    gradient_accumulation_steps: int = Field(
        1,
        gt=0,
        description="Micro-batches per step; gradients are summed and divided once by the global token weight.",
    )
    seed: int = Field(0, description="Seed of parameter initialisation.")
    log_every_steps: int = Field(
        10, gt=0, description="Steps between metric writes (TensorBoard, metrics.jsonl, console)."
    )
    eval_every_steps: int = Field(
        0, ge=0, description="Steps between evaluations on held-out data; 0 = never."
    )
    eval_batches: int = Field(4, gt=0, description="Global batches per evaluation.")
    max_consecutive_skips: int = Field(
        10,
        gt=0,
        description="Stop the run after this many consecutive steps with a non-finite loss or gradient.",
    )


class CheckpointConfig(_Section):
    """Orbax checkpoints of the train state and data iterator."""

    every_steps: int = Field(
        0, ge=0, description="Steps between checkpoints; 0 = only at the end (and on SIGTERM)."
    )
    keep: int = Field(3, gt=0, description="How many latest checkpoints to keep.")
    keep_every: int | None = Field(
        None,
        gt=0,
        description="Also keep every checkpoint whose step is a multiple of this, forever.",
    )
    async_save: bool = Field(
        True, description="Write checkpoints in the background while training goes on."
    )
    load_params_from: str | None = Field(
        None,
        description="Initialise parameters (only) from this run directory or checkpoint; the optimizer starts fresh.",
    )


class DistillationConfig(_Section):
    """Teacher -> student post-training."""

    teacher_run_dir: str | None = Field(
        None,
        description="kiln run directory of the teacher (its config.yaml and latest checkpoint).",
    )
    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Weight of the distillation term, in [0, 1].",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Softmax temperature T of the soft loss (> 0); the soft loss is scaled by T^2.",
    )
    beta: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Weight of the feature loss with balance=none (>= 0).",
    )
    balance: Literal["none", "dynamic"] = Field(
        "none",
        description="none: (1-alpha) hard + alpha soft + beta feature; dynamic: magnitudes balanced against the hard loss.",
    )
    layer_map: list[tuple[int, int]] = Field(
        default_factory=list,
        description="[student_layer, teacher_layer] pairs whose hidden states the feature loss compares.",
    )
    feature_loss: Literal["cosine", "mse"] = Field(
        "cosine", description="Distance of the feature loss."
    )
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="How alpha, temperature and beta move to their *_end values over train.steps: constant (no change), linear or cosine.",
    )
    alpha_end: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="alpha at the last step with schedule linear/cosine; null = alpha.",
    )
    temperature_end: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="temperature at the last step with schedule linear/cosine; null = temperature.",
    )
    beta_end: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="beta at the last step with schedule linear/cosine; null = beta.",
    )


class DistributedConfig(_Section):
    """Multi-process runs through jax.distributed."""

    coordinator_address: str | None = Field(
        None,
        description="host:port of process 0's coordinator; null = single process (unless auto).",
    )
    num_processes: int = Field(1, gt=0, description="Total number of processes.")
    process_id: int = Field(0, ge=0, description="This process's index in [0, num_processes).")
    auto: bool = Field(
        False,
        description="Let jax.distributed.initialize() detect the cluster (SLURM, TPU pods, GKE, Open MPI).",
    )
    init_timeout_s: int = Field(
        300, gt=0, description="Seconds to wait for all processes before giving up with an error."
    )
    heartbeat_timeout_s: int = Field(
        100,
        gt=0,
        description="Seconds without a heartbeat after which a process counts as dead and every other process stops.",
    )


class LoggingConfig(_Section):
    """Console and performance reporting."""

    peak_tflops_per_device: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Peak TFLOP/s of one device for perf/mfu; null = look up known GPUs/TPUs (on CPU, MFU is then relative to 1 TFLOP/s).",
    )
    progress: bool = Field(True, description="Show a progress bar when the console is a terminal.")


class Config(_Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model shape and numerics.")
    mesh: MeshConfig = Field(
        default_factory=MeshConfig, description="Device mesh and sharding rules."
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Training data.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and schedule.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Loss function.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    distillation: DistillationConfig = Field(
        default_factory=DistillationConfig, description="Distillation."
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Multi-process setup."
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig, description="Console and performance reporting."
    )

    @pydantic.model_validator(mode="after")
    def _cross_field(self) -> Config:
        for msg in _cross_field_errors(self, num_devices=None):
            raise ValueError(msg)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_dir) / self.train.run_name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _cross_field_errors(c: Config, num_devices: int | None) -> Iterable[str]:
    """Every rule that relates two fields; `num_devices` resolves mesh -1 sizes when known."""
    m, t, loss = c.model, c.train, c.loss
    z = loss.z_loss_multiplier
    if not math.isfinite(z) or z < 0:
        yield f"loss.z_loss_multiplier: got {z}; allowed: a finite number >= 0"
    if m.head_dim is None and m.d_model % m.num_heads:
        yield (
            f"model.num_heads: {m.num_heads} does not divide model.d_model={m.d_model}; "
            "choose a divisor or set model.head_dim"
        )
    if m.num_heads % m.kv_heads:
        yield f"model.num_kv_heads: {m.kv_heads} does not divide model.num_heads={m.num_heads}"
    if m.resolved_head_dim % 2:
        yield f"model.head_dim: rotary embeddings need an even head width, got {m.resolved_head_dim}"
    if c.data.seq_len > m.max_seq_len:
        yield f"data.seq_len: {c.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}"
    if not c.optim.learning_rate > 0:
        yield f"optim.learning_rate: got {c.optim.learning_rate}; allowed: a number > 0"
    if c.optim.warmup_steps > t.steps:
        yield f"optim.warmup_steps: {c.optim.warmup_steps} exceeds train.steps={t.steps}"
    yield from _distillation_errors(c)
    if t.global_batch_size % t.gradient_accumulation_steps:
        yield (
            f"train.global_batch_size: {t.global_batch_size} is not divisible by "
            f"train.gradient_accumulation_steps={t.gradient_accumulation_steps}"
        )
        return
    yield from _distributed_errors(c.distributed)
    mesh = {a: getattr(c.mesh, a) for a in MESH_AXES}
    if sum(s == -1 for s in mesh.values()) > 1:
        yield f"mesh: at most one size may be -1, got {mesh}"
        return
    if num_devices is not None:
        try:
            mesh = c.mesh.sizes(num_devices)
        except KilnError as e:
            yield str(e)
            return
    elif -1 in mesh.values():
        return  # the batch rules below are checked again once the device count is known
    micro = t.global_batch_size // t.gradient_accumulation_steps
    batch_shards = math.prod(mesh[a] for a in c.mesh.rules["batch"])
    if micro % batch_shards:
        yield (
            f"train.global_batch_size: micro-batch of {micro} sequences (global_batch_size "
            f"{t.global_batch_size} / gradient_accumulation_steps {t.gradient_accumulation_steps}) "
            f"is not divisible by the {batch_shards} batch shards of the mesh ({mesh})"
        )
        return
    seq_shards = math.prod(mesh[a] for a in c.mesh.rules["length"])
    if c.data.seq_len % seq_shards:
        yield f"data.seq_len: {c.data.seq_len} is not divisible by the {seq_shards} sequence shards of the mesh"
        return
    shard_tokens = (micro // batch_shards) * (c.data.seq_len // seq_shards)
    if shard_tokens % loss.num_vocab_tiling:
        yield (
            f"loss.num_vocab_tiling: {loss.num_vocab_tiling} does not divide the "
            f"{shard_tokens} tokens of one micro-batch on one shard "
            f"({micro // batch_shards} sequences x {c.data.seq_len // seq_shards} tokens); "
            "allowed: a divisor of that number"
        )
    vocab_shards = math.prod(mesh[a] for a in c.mesh.rules["vocab"])
    chunk = loss.vocab_chunk_size
    if chunk is not None and (
        m.vocab_size % vocab_shards or (m.vocab_size // vocab_shards) % chunk
    ):
        yield (
            f"loss.vocab_chunk_size: {chunk} does not divide the vocabulary of one shard "
            f"(model.vocab_size {m.vocab_size} / {vocab_shards} vocabulary shards); "
            "allowed: a divisor of that number, or null"
        )


def _distillation_errors(c: Config) -> Iterable[str]:
    """Distillation fields against each other and the student (the teacher is checked on load)."""
    dist = c.distillation
    if dist.schedule == "constant":
        for name in ("alpha_end", "temperature_end", "beta_end"):
            if getattr(dist, name) is not None:
                yield (
                    f"distillation.{name}: set to {getattr(dist, name)}, but "
                    "distillation.schedule is constant; allowed: schedule linear or cosine, "
                    f"or no {name}"
                )
    for student, teacher in dist.layer_map:
        if not 0 <= student < c.model.num_layers:
            yield (
                f"distillation.layer_map: student layer {student} in [{student}, {teacher}] "
                f"is out of range; allowed: 0..{c.model.num_layers - 1} "
                f"(model.num_layers={c.model.num_layers})"
            )
        if teacher < 0:
            yield (
                f"distillation.layer_map: teacher layer {teacher} in [{student}, {teacher}] "
                "is negative; allowed: 0..(the teacher's num_layers - 1)"
            )


def _distributed_errors(d: DistributedConfig) -> Iterable[str]:
    if d.auto:
        if d.num_processes != 1 or d.process_id != 0:
            yield (
                "distributed.auto: true takes num_processes and process_id from the cluster; "
                f"got num_processes={d.num_processes}, process_id={d.process_id} (remove them)"
            )
        return
    if d.process_id >= d.num_processes:
        yield f"distributed.process_id: {d.process_id} must be < distributed.num_processes={d.num_processes}"
    if d.coordinator_address is not None:
        host, _, port = d.coordinator_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            yield (
                f"distributed.coordinator_address: {d.coordinator_address!r}; allowed: host:port "
                "with a port in 1..65535, e.g. 10.0.0.1:8476"
            )


def check_devices(config: Config, num_devices: int) -> dict[str, int]:
    """Validate the config against the devices present; returns the resolved mesh sizes."""
    for msg in _cross_field_errors(config, num_devices):
        raise KilnError(msg)
    return config.mesh.sizes(num_devices)


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read YAML (following `base_config`), apply `a.b=c` overrides, validate; raises KilnError."""
    raw = _load_yaml_tree(Path(path), stack=())
    for item in overrides:
        _apply_override(raw, item)
    return config_from_dict(raw)


def read_run_config(run_dir: str | Path, context: str) -> Config:
    """The resolved `config.yaml` of a run directory; a KilnError starting with `context`."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise KilnError(f"{context}: {run_dir} has no config.yaml; is it a kiln run directory?")
    try:
        return load_config(path)
    except KilnError as e:
        raise KilnError(f"{context}: unreadable config {path}: {str(e).splitlines()[0]}") from None


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    """Validate a nested dict into a Config; raises KilnError with one line per problem."""
    try:
        return Config.model_validate(dict(raw))
    except pydantic.ValidationError as e:
        raise KilnError(_format_validation_error(e)) from None


def _load_yaml_tree(path: Path, stack: tuple[Path, ...]) -> dict[str, Any]:
    path = path.expanduser()
    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(str(p) for p in (*stack, resolved))
        raise KilnError(f"base_config: loop detected: {chain}")
    if not path.is_file():
        raise KilnError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise KilnError(f"{path}:{where}: invalid YAML: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read config {path}: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise KilnError(
            f"{path}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    base = data.pop("base_config", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise KilnError(f"{path}: base_config must be a path string, got {base!r}")
    parent = _load_yaml_tree(path.parent / base, (*stack, resolved))
    return _deep_merge(parent, data)


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise KilnError(f"override {item!r}: expected KEY=VALUE, e.g. loss.z_loss_multiplier=1e-4")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise KilnError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _format_validation_error(e: pydantic.ValidationError) -> str:
    lines = []
    for err in e.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(_unknown_key(err["loc"]))
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:
            lines.append(msg)
            continue
        allowed = _describe_allowed(err)
        lines.append(f"{loc}: got {_short(err.get('input'))}; {msg}{allowed}")
    if len(e.errors()) > 3:
        lines.append(f"... and {len(e.errors()) - 3} more problems")
    return "\n".join(lines)


def _describe_allowed(err: Mapping[str, Any]) -> str:
    expected = (err.get("ctx") or {}).get("expected")
    return "" if expected is None or expected in err["msg"] else f" (allowed: {expected})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unknown_key(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            break
        model = ann
    name = str(loc[-1])
    dotted = ".".join(str(p) for p in loc)
    known = list(model.model_fields)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key {dotted!r}: {hint}allowed: {', '.join(known)}"


# ---------------------------------------------------------------------------------------------
# Schema listing


def schema_rows(
    model: type[BaseModel] = Config, prefix: str = ""
) -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, description) of every field, sections expanded."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        dotted = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(schema_rows(ann, prefix=f"{dotted}."))
            continue
        default = field.get_default(call_default_factory=True)
        rows.append(
            (
                dotted,
                _type_name(ann),
                yaml.safe_dump(default, default_flow_style=True)
                .strip()
                .removesuffix("\n...")
                .removesuffix("..."),
                field.description or "",
            )
        )
    return rows


def _type_name(ann: Any) -> str:
    text = repr(ann) if not isinstance(ann, type) else ann.__name__
    return text.replace("typing.", "").replace("NoneType", "None")
