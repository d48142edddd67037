"""The config sections: every field with its type, bounds, default and description.

A constraint on one field lives on that field (bounds, `Literal`, a field validator); rules
that relate several fields are in `kiln.config`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

# Token ids, positions and the step counter are int32 on the device; sizes and counts stay
# below its limit so they fit wherever they are used.
INT32_MAX = 2**31 - 1
PositiveInt = Annotated[int, Field(gt=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
# numpy refuses negative seeds, and the data pipeline's shuffle takes 32 bits.
Seed = Annotated[int, Field(ge=0, lt=2**32)]
# z * logsumexp^2 in float32: PaLM and MaxText use 1e-4; with z <= 1 the term stays finite
# for any |logsumexp| below 1e19, while z = 1e38 overflows at the first step.
Z_LOSS_MAX = 1.0
# Cap of distill/kd_mag_scale = hard / kd under dynamic balancing (see DistillationConfig).
DEFAULT_MAX_KD_SCALE = 100.0


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, and a loaded config is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(Section):
    """Shape and numerics of the decoder-only Transformer."""

    family: Literal["llama"] = Field(
        "llama",
        description="Model family (the implementation in kiln.model.FAMILIES): llama = pre-norm RMSNorm blocks, grouped-query attention with rotary embeddings, SwiGLU MLP.",
    )
    vocab_size: PositiveInt = Field(
        384,
        description="Vocabulary size of the embedding and LM head; >= the tokenizer's vocabulary (a multiple of 128 is fastest).",
    )
    d_model: PositiveInt = Field(256, description="Width of the residual stream.")
    num_layers: PositiveInt = Field(4, description="Number of Transformer blocks.")
    num_heads: PositiveInt = Field(4, description="Number of query heads.")
    num_kv_heads: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Number of key/value heads (grouped-query attention); null = num_heads.",
    )
    head_dim: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Width of one attention head; null = d_model / num_heads.",
    )
    d_ff: PositiveInt = Field(688, description="Hidden width of the SwiGLU MLP.")
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
    remat: Literal[
        "none", "save_dots", "minimal", "save_qkv_proj", "save_out_proj", "offload", "full"
    ] = Field(
        "none",
        description="What a block keeps for its backward pass (the rest is recomputed), most memory first: none (everything), save_dots (outputs of the q/k/v, wo, gate and up projections; attention's scores and probs @ v are recomputed), minimal (q/k/v projections, attention output, wo output), save_qkv_proj (q/k/v projections), save_out_proj (wo output), full (only the block input); offload = save_dots' tensors moved to host memory (on CPU they stay in RAM as save_dots). See docs/performance.md.",
    )
    qk_norm: bool = Field(
        False, description="RMS-normalise queries and keys per head before attention."
    )
    attention: Literal["auto", "xla", "cudnn", "splash"] = Field(
        "auto",
        description="Attention implementation: xla (blocked; key blocks above the causal diagonal skipped), cudnn (cuDNN fused attention via jax.nn.dot_product_attention; NVIDIA GPU, bf16/fp16), splash (Pallas splash-attention kernel; TPU), auto = splash on TPU, cudnn on GPU with a bf16/fp16 dtype, else xla. See docs/attention.md.",
    )
    logit_softcap: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="If set, logits = cap * tanh(logits / cap)."
    )
    max_seq_len: PositiveInt = Field(
        2048,
        description="Longest sequence the model supports (rotary tables).",
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


class DataConfig(Section):
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
    seq_len: int = Field(256, gt=1, le=INT32_MAX, description="Tokens per training sequence.")
    seed: Seed = Field(
        0,
        description="Seed of shuffling and of synthetic data; 0 <= seed < 2^32.",
    )
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


class OptimConfig(Section):
    """AdamW, gradient clipping and the learning-rate schedule."""

    learning_rate: float = Field(
        3e-4, gt=0, allow_inf_nan=False, description="Peak learning rate (> 0)."
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

    @pydantic.field_validator("z_loss_multiplier")
    @classmethod
    def _z_bound(cls, z: float) -> float:
        if z > Z_LOSS_MAX:
            raise ValueError(
                f"allowed: 0 <= z <= {Z_LOSS_MAX:g}; a larger weight makes z * logsumexp^2 "
                "overflow float32, so every step is skipped (PaLM and MaxText use 1e-4)"
            )
        return z


class TrainConfig(Section):
    """The training loop."""

    run_name: str = Field(
        "run",
        min_length=1,
        description="Name of the run directory under output_dir: one path component (no '/', not '.' or '..').",
    )
    output_dir: str = Field(
        "runs", min_length=1, description="Parent directory of run directories."
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
    grad_reduce_dtype: Literal["float32", "compute"] = Field(
        "float32",
        description=(
            "Dtype in which each Transformer block's weight gradients are computed and summed "
            "across data/fsdp devices: float32, or compute (model.dtype, e.g. bfloat16: half "
            "the gradient reduce-scatter/all-reduce bytes, but each device's partial gradient "
            "is rounded to 8 mantissa bits before the sum). Same computation when "
            "model.dtype is float32."
        ),
    )
    max_consecutive_skips: PositiveInt = Field(
        10,
        description="Stop the run after this many consecutive steps with a non-finite loss or gradient.",
    )
    profile_steps: tuple[int, int] | None = Field(
        None,
        description="[start, stop]: write a jax.profiler trace of steps start..stop (both included, start <= stop <= train.steps) into the run's tensorboard/ directory (TensorBoard's profile plugin, or Perfetto); null = no trace. Start after step 1 to leave compilation out.",
    )
    compilation_cache_dir: str | None = Field(
        ".jax_cache",
        min_length=1,
        description="Persistent compilation cache, so that a restarted or resumed run does not compile again; a relative path is under train.output_dir; null = off.",
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

    @pydantic.field_validator("run_name")
    @classmethod
    def _one_component(cls, name: str) -> str:
        if name in (".", "..") or any(c in name for c in "/\\\0"):
            raise ValueError(
                "allowed: a single directory name, without '/', '\\' or NUL, not '.' or '..'; "
                "the run directory stays inside train.output_dir"
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
    load_params_from: str | None = Field(
        None,
        description="Initialise parameters (only) from this run directory or checkpoint; the optimizer starts fresh.",
    )


class DistillationConfig(Section):
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
        description="Weight of the feature loss (>= 0): beta * feature with balance=none, beta * (soft/feature) * feature inside kd with balance=dynamic; 0 switches it off.",
    )
    balance: Literal["none", "dynamic"] = Field(
        "none",
        description="none: (1-alpha) hard + alpha soft + beta feature; dynamic: magnitudes balanced against the hard loss.",
    )
    max_kd_scale: float = Field(
        DEFAULT_MAX_KD_SCALE,
        gt=0,
        allow_inf_nan=False,
        description="balance=dynamic: cap of kd_mag_scale = hard / kd (> 0), so a student near its teacher (kd -> 0) does not get its distillation gradient amplified without bound; 100 leaves balancing untouched while kd >= hard / 100.",
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

    @pydantic.field_validator("layer_map")
    @classmethod
    def _layers_not_negative(cls, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        for pair in pairs:
            if min(pair) < 0:
                raise ValueError(
                    f"layer {min(pair)} in {list(pair)} is negative; allowed: "
                    "[student_layer, teacher_layer] with 0 <= layer < that model's num_layers"
                )
        return pairs


class DistributedConfig(Section):
    """Multi-process runs through jax.distributed."""

    coordinator_address: str | None = Field(
        None,
        description="host:port of process 0's coordinator; null = single process (unless auto).",
    )
    num_processes: PositiveInt = Field(1, description="Total number of processes.")
    process_id: Count = Field(0, description="This process's index in [0, num_processes).")
    auto: bool = Field(
        False,
        description="Let jax.distributed.initialize() detect the cluster (SLURM, TPU pods, GKE, Open MPI).",
    )
    init_timeout_s: PositiveInt = Field(
        300,
        description="Seconds to wait for all processes before giving up with an error.",
    )
    heartbeat_timeout_s: PositiveInt = Field(
        100,
        description="Seconds without a heartbeat after which a process counts as dead and every other process stops.",
    )

    @pydantic.field_validator("coordinator_address")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        if address is not None:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("allowed: host:port with a port in 1..65535, e.g. 10.0.0.1:8476")
        return address


class LoggingConfig(Section):
    """Console and performance reporting."""

    peak_tflops_per_device: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Peak TFLOP/s of one device for perf/mfu; null = look up known GPUs/TPUs (on CPU, MFU is then relative to 1 TFLOP/s).",
    )
    progress: bool = Field(True, description="Show a progress bar when the console is a terminal.")
