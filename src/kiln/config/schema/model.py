"""The config schema: shape and numerics of the model."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, model_validator

from kiln.config.schema.base import INT32_MAX, PositiveInt, Section


class RopeScalingConfig(Section):
    """Llama 3.1's rescaling of rotary frequencies (Hugging Face rope_type "llama3")."""

    rope_type: Literal["llama3"] = Field(
        "llama3",
        description="llama3: wavelengths above original_max_position_embeddings / low_freq_factor are stretched by factor, those below original_max_position_embeddings / high_freq_factor kept, the band between interpolated.",
    )
    factor: float = Field(
        8.0, gt=0, allow_inf_nan=False, description="How much long wavelengths are stretched."
    )
    low_freq_factor: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="original_max_position_embeddings / low_freq_factor = the shortest stretched wavelength.",
    )
    high_freq_factor: float = Field(
        4.0,
        gt=0,
        allow_inf_nan=False,
        description="original_max_position_embeddings / high_freq_factor = the longest wavelength kept; > low_freq_factor.",
    )
    original_max_position_embeddings: PositiveInt = Field(
        8192, description="Context length the unscaled frequencies were trained for."
    )

    @model_validator(mode="after")
    def _bands(self) -> RopeScalingConfig:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )
        return self


class ModelConfig(Section):
    """Shape and numerics of the decoder-only Transformer."""

    family: Literal["llama"] = Field(
        "llama",
        description="Model family (the implementation in kiln.model.FAMILIES): llama = pre-norm RMSNorm blocks, grouped-query attention with rotary embeddings, SwiGLU MLP.",
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
    rope_scaling: RopeScalingConfig | None = Field(
        None,
        description="null = plain rotary frequencies; {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} = Llama 3.1/3.2's long-context rescaling (as Hugging Face's rope_scaling).",
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
