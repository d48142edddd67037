"""The config schema: shape and numerics of the model (the family sections are in
`kiln.config.schema.families`)."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, model_validator

from kiln.config.schema.base import INT32_MAX, PositiveInt, Section
from kiln.config.schema.families import (
    DeepseekConfig,
    Gemma3Config,
    GptOssConfig,
    MoeConfig,
)

# RopeScalingConfig's llama3-only fields, with their values when a llama3 scaling omits them.
LLAMA3_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class RopeScalingConfig(Section):
    """A rescaling of the rotary frequencies (Hugging Face's rope_type "llama3" or "linear")."""

    rope_type: Literal["llama3", "linear"] = Field(
        "llama3",
        description="llama3 (Llama 3.1): wavelengths above original_max_position_embeddings / low_freq_factor are stretched by factor, those below original_max_position_embeddings / high_freq_factor kept, the band between interpolated. linear (Gemma 3's global layers): every frequency divided by factor.",
    )
    factor: float = Field(
        8.0, gt=0, allow_inf_nan=False, description="How much long wavelengths are stretched."
    )
    low_freq_factor: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="llama3 (default 1.0): original_max_position_embeddings / low_freq_factor = the shortest stretched wavelength. null with linear.",
    )
    high_freq_factor: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="llama3 (default 4.0): original_max_position_embeddings / high_freq_factor = the longest wavelength kept; > low_freq_factor. null with linear.",
    )
    original_max_position_embeddings: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="llama3 (default 8192): context length the unscaled frequencies were trained for. null with linear.",
    )

    @model_validator(mode="before")
    @classmethod
    def _llama3_defaults(cls, data):
        if isinstance(data, dict) and data.get("rope_type", "llama3") == "llama3":
            data = {**LLAMA3_DEFAULTS, **{k: v for k, v in data.items() if v is not None}}
        return data

    @model_validator(mode="after")
    def _bands(self) -> RopeScalingConfig:
        if self.rope_type == "linear":
            for field in LLAMA3_DEFAULTS:
                if getattr(self, field) is not None:
                    raise ValueError(
                        f"{field} is {getattr(self, field)} with rope_type linear; allowed: "
                        "null (only llama3 reads it)"
                    )
            return self
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )
        return self

    def hf_fields(self) -> dict:
        """The fields Hugging Face's rope_scaling / rope_parameters hold for this rope_type."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return self.model_dump()


# model.family -> the sections of ModelConfig it reads besides the shared fields (a family may
# read another's: one with routed experts reads `moe`). kiln.model.FAMILIES holds the
# implementations under the same names.
FAMILY_SECTIONS: dict[str, tuple[str, ...]] = {
    "llama": (),
    "moe": ("moe",),
    "deepseek": ("moe", "deepseek"),
    "gemma3": ("gemma3",),
    "gpt_oss": ("moe", "gpt_oss"),
}
FAMILY_HELP = {
    "llama": "pre-norm RMSNorm blocks, grouped-query attention with rotary embeddings, SwiGLU MLP",
    "moe": "llama's blocks with the MLP replaced by routed experts (model.moe)",
    "deepseek": "DeepSeek-V3: multi-head latent attention (model.deepseek), routed experts "
    "(model.moe), multi-token prediction",
    "gemma3": "Gemma 3 (text): llama's attention with per-head query/key norms, four (1 + w) "
    "RMSNorms per block, a GeGLU MLP, embeddings times sqrt(d_model), scores scaled by "
    "model.gemma3.query_pre_attn_scalar",
    "gpt_oss": "GPT-OSS: llama's attention with biases, sinks (model.attention_sinks) and YaRN "
    "rope (model.gpt_oss.yarn), routed experts (model.moe) with biases and a clamped SwiGLU",
}
# model.attention -> what the kernel is; kiln.model.attention.IMPLEMENTATIONS holds the kernels
# under the same names, and `auto` chooses among them per platform.
ATTENTION_KERNELS: dict[str, str] = {
    "xla": "blocked; key blocks above the causal diagonal skipped",
    "cudnn": "cuDNN fused attention via jax.nn.dot_product_attention; NVIDIA GPU, bf16/fp16",
    "splash": "Pallas splash-attention kernel; TPU",
}


def _one_of(value: str, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"allowed: {', '.join(allowed)}")
    return value


class ModelConfig(Section):
    """Shape and numerics of the decoder-only Transformer."""

    family: str = Field(
        "llama",
        description="Model family (the implementation in kiln.model.FAMILIES): "
        + "; ".join(f"{k} = {v}" for k, v in FAMILY_HELP.items())
        + ".",
    )
    vocab_size: PositiveInt | Literal["auto"] = Field(
        384,
        description="Vocabulary size of the embedding and LM head; >= the tokenizer's vocabulary (a multiple of 128 is fastest). auto = the tokenizer's size rounded up to a multiple of 128, set when the config is loaded (config.yaml of the run records the number).",
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
        "none",
        "save_dots",
        "save_projections",
        "minimal",
        "save_qkv_proj",
        "save_out_proj",
        "offload",
        "full",
    ] = Field(
        "none",
        description="What a block keeps for its backward pass (the rest is recomputed), most memory first: none (everything), save_dots (outputs of the q/k/v, wo, gate and up projections; attention's scores and probs @ v are recomputed), save_projections (the same tensors chosen by name: MaxText's minimal), minimal (q/k/v projections, attention output, wo output; kiln's minimal is not MaxText's), save_qkv_proj (q/k/v projections), save_out_proj (wo output), full (only the block input); offload = save_dots' tensors moved to host memory (on CPU they stay in RAM as save_dots). See docs/performance.md.",
    )
    qk_norm: bool = Field(
        False, description="RMS-normalise queries and keys per head before attention."
    )
    attention: str = Field(
        "auto",
        description="Attention implementation: "
        + ", ".join(f"{k} ({v})" for k, v in ATTENTION_KERNELS.items())
        + ", auto = splash on TPU, cudnn on GPU with a bf16/fp16 dtype, else xla. See docs/attention.md.",
    )
    sliding_window: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Keys a query of a sliding_attention layer sees: itself and the sliding_window - 1 before it (Hugging Face's sliding_window); null = no sliding-window layers. See docs/attention.md.",
    )
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = Field(
        None,
        description="Each layer's attention, repeated from the start when shorter than num_layers (five sliding_attention then one full_attention is Gemma 3's pattern); null = every layer sliding_attention when sliding_window is set, else full_attention.",
    )
    local_rope_theta: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Rotary base of the sliding_attention layers (Gemma 3's rope_local_base_freq); null = rope_theta. Their rotary frequencies are never rescaled by rope_scaling.",
    )
    attention_sinks: bool = Field(
        False,
        description="A learned logit per query head in every softmax's denominator, with no value (GPT-OSS's sinks): a head can attend to nothing.",
    )
    context_parallel: Literal["all_gather", "ring"] = Field(
        "all_gather",
        description="How the queries of each sequence shard (mesh.sequence > 1) reach the keys of all: all_gather = keys and values gathered whole once per layer, then model.attention; ring = keys and values passed around the sequence shards one block per hop (ppermute) and merged with an online softmax, so no device holds more than two blocks (kiln's own attention on every platform: model.attention must be auto or xla). See docs/sharding.md.",
    )
    context_load_balance: bool | None = Field(
        None,
        description="Place each sequence so that every sequence shard does the same attention work under the causal mask: of 2P equal chunks, shard p of P holds chunks p and 2P-1-p (zigzag), its tokens, targets, positions, segment ids and loss weights alike; the loss does not change. null = on when the mesh shards the sequence and the model has no multi-token prediction module (whose shifted targets need the sequence in order). See docs/sharding.md.",
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
    rope_scaling: RopeScalingConfig | None = Field(
        None,
        description="null = plain rotary frequencies; {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} = Llama 3.1/3.2's long-context rescaling, {rope_type: linear, factor} = every frequency divided by factor (Gemma 3 4B and larger: 8); as Hugging Face's rope_scaling. Never applied to the sliding_attention layers of a model with local_rope_theta.",
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
    moe: MoeConfig | None = Field(
        None,
        description="family: moe or deepseek only: the routed experts (num_experts, experts_per_token, d_ff_expert, ...; see docs/moe.md); null with those families = the defaults.",
    )
    deepseek: DeepseekConfig | None = Field(
        None,
        description="family: deepseek only: multi-head latent attention and multi-token prediction (kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, yarn, mtp_num_layers, mtp_loss_weight; see docs/deepseek.md); null with family deepseek = the defaults.",
    )

    gemma3: Gemma3Config | None = Field(
        None,
        description="family: gemma3 only: query_pre_attn_scalar (see docs/gemma3.md); null with family gemma3 = the defaults.",
    )
    gpt_oss: GptOssConfig | None = Field(
        None,
        description="family: gpt_oss only: the experts' clamped SwiGLU and the YaRN rope (swiglu_alpha, swiglu_limit, yarn; see docs/gpt-oss.md); null with family gpt_oss = the defaults.",
    )

    @pydantic.field_validator("family")
    @classmethod
    def _family(cls, value: str) -> str:
        return _one_of(value, FAMILY_SECTIONS)

    @pydantic.field_validator("attention")
    @classmethod
    def _attention(cls, value: str) -> str:
        return _one_of(value, ("auto", *ATTENTION_KERNELS))

    @model_validator(mode="after")
    def _family_section(self) -> ModelConfig:
        own = FAMILY_SECTIONS[self.family]
        for family, sections in FAMILY_SECTIONS.items():
            for section in sections:
                if section not in own and getattr(self, section) is not None:
                    raise ValueError(
                        f"model.{section} is set but model.family is {self.family}; allowed: "
                        f"model.family: {family} with model.{section}, or no model.{section}"
                    )
        return self

    @model_validator(mode="after")
    def _attention_layers(self) -> ModelConfig:
        types = self.layer_types or ()
        if self.layer_types is not None and not types:
            raise ValueError(
                "model.layer_types is empty; allowed: a list of full_attention and "
                "sliding_attention (repeated over the layers), or null"
            )
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError(
                "model.layer_types has sliding_attention layers but model.sliding_window is "
                "null; allowed: a window of keys (an integer >= 1), or only full_attention"
            )
        if self.sliding_window is not None and types and "sliding_attention" not in types:
            raise ValueError(
                f"model.sliding_window is {self.sliding_window} but model.layer_types has no "
                "sliding_attention layer; allowed: sliding_attention in model.layer_types, or "
                "model.sliding_window: null"
            )
        if self.local_rope_theta is not None and not any(self.local_layers()):
            raise ValueError(
                f"model.local_rope_theta is {self.local_rope_theta} but no layer is "
                "sliding_attention; allowed: null, or a model.sliding_window"
            )
        if self.context_parallel == "ring" and self.attention not in ("auto", "xla"):
            raise ValueError(
                f"model.context_parallel: 'ring' runs kiln's own attention blocks, but "
                f"model.attention is {self.attention!r}; allowed: model.attention auto or xla, "
                "or model.context_parallel: all_gather"
            )
        mtp = self.deepseek.mtp_num_layers if self.deepseek else 0
        if self.context_load_balance and mtp:
            raise ValueError(
                f"model.context_load_balance is true with model.deepseek.mtp_num_layers {mtp}; "
                "allowed: false or null (the prediction modules' targets are shifted along the "
                "sequence, which must stay in order)"
            )
        if self.layer_types is not None and len(self.layer_types) > self.num_layers:
            raise ValueError(
                f"model.layer_types has {len(self.layer_types)} entries for "
                f"model.num_layers={self.num_layers}; allowed: at most num_layers (a shorter "
                "list repeats)"
            )
        return self

    def balances_context(self, sequence_shards: int) -> bool:
        """Whether a step over `sequence_shards` places its sequences for load balance."""
        if sequence_shards <= 1:
            return False
        if self.context_load_balance is None:
            return not self.deepseek or not self.deepseek.mtp_num_layers
        return self.context_load_balance

    def staged_layers(self) -> int:
        """The layers pipeline stages split: the main stack's (the moe family's first dense
        blocks run outside the stages, docs/pipeline.md)."""
        return self.num_layers - (self.moe.first_dense_layers if self.moe is not None else 0)

    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it is a sliding_attention layer (`layer_types`, repeated)."""
        if self.layer_types is None:
            return (self.sliding_window is not None,) * self.num_layers
        types = self.layer_types
        return tuple(types[i % len(types)] == "sliding_attention" for i in range(self.num_layers))

    @model_validator(mode="after")
    def _latent_attention(self) -> ModelConfig:
        # Multi-head latent attention sets its own head widths and rotary scaling.
        if self.family != "deepseek":
            return self
        given = (
            ("num_kv_heads", self.num_kv_heads, "null (every head reads the shared latent)"),
            ("head_dim", self.head_dim, "null (model.deepseek sets the head widths)"),
            ("qk_norm", self.qk_norm or None, "false (the latents have their own RMSNorms)"),
            ("rope_scaling", self.rope_scaling, "null (use model.deepseek.yarn)"),
            ("sliding_window", self.sliding_window, "null (latent attention is global)"),
            ("attention_sinks", self.attention_sinks or None, "false"),
        )
        for field, value, allowed in given:
            if value is not None:
                raise ValueError(
                    f"model.{field} is {value} with model.family deepseek; allowed: {allowed}"
                )
        return self

    @model_validator(mode="after")
    def _gemma3(self) -> ModelConfig:
        # Every Gemma 3 attention normalises its query and key heads (its q_norm / k_norm).
        if self.family == "gemma3" and not self.qk_norm:
            raise ValueError(
                "model.qk_norm is false with model.family gemma3; allowed: true (Gemma 3 "
                "normalises every query and key head)"
            )
        return self

    @model_validator(mode="after")
    def _yarn_theta(self) -> ModelConfig:
        # YaRN's ramp between kept and interpolated frequencies divides by ln(rope_theta).
        for section in ("deepseek", "gpt_oss"):
            own = getattr(self, section)
            if own is not None and own.yarn is not None and self.rope_theta <= 1:
                raise ValueError(
                    f"model.rope_theta is {self.rope_theta} with model.{section}.yarn; "
                    "allowed: a base above 1 (YaRN's ramp divides by ln(rope_theta))"
                )
        return self

    @model_validator(mode="after")
    def _gpt_oss(self) -> ModelConfig:
        # GPT-OSS: sinks in every attention, routed experts in every layer, YaRN in its section.
        if self.family != "gpt_oss":
            return self
        moe = self.moe
        given = (
            ("attention_sinks", self.attention_sinks, True, "true (every GPT-OSS head has a sink)"),
            ("qk_norm", self.qk_norm, False, "false"),
            ("rope_scaling", self.rope_scaling, None, "null (use model.gpt_oss.yarn)"),
            ("local_rope_theta", self.local_rope_theta, None, "null (one rotary in every layer)"),
            ("moe.first_dense_layers", moe.first_dense_layers, 0, "0 (experts in every layer)"),
            ("moe.num_shared_experts", moe.num_shared_experts, 0, "0"),
        )
        for field, value, want, allowed in given:
            if value != want:
                raise ValueError(
                    f"model.{field} is {value} with model.family gpt_oss; allowed: {allowed}"
                )
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_section(cls, data):
        # The family's own section with its defaults when not given, so config.yaml records
        # every value the run used.
        if isinstance(data, dict):
            for own in FAMILY_SECTIONS.get(data.get("family", "llama"), ()):
                if data.get(own) is None:
                    data = {**data, own: {}}
        return data

    @pydantic.field_validator("vocab_size", mode="plain")
    @classmethod
    def _size_or_auto(cls, value):
        # One error line for either form (a union would report one per member).
        if value == "auto" or (type(value) is int and 0 < value <= INT32_MAX):
            return value
        raise ValueError(f"allowed: an integer in 1..{INT32_MAX}, or auto")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads
