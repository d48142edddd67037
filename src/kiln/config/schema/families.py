"""The config schema: the sections of `model` that one family or a few read (`model.moe`,
`model.deepseek`, `model.gemma3`, `model.gpt_oss`; `FAMILY_SECTIONS` in
`kiln.config.schema.model` says which)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.config.schema.base import INT32_MAX, Z_LOSS_MAX, Count, PositiveInt, Section

# Routed (and shared) experts of one MoE layer: the largest published layers hold a few hundred.
# A step numbers its assignments' experts and each expert's padded blocks of rows (up to
# num_experts x 127 rows past the assignments) in int32.
MAX_EXPERTS = 2**16
# Rotary width of a latent-attention head: its frequency tables are built on the host.
MAX_ROPE_HEAD_DIM = 2**16
# The factors of these sections (capacity, buffer, YaRN's): far above any value in use, low
# enough that what they scale stays finite, and within int32 where it counts rows.
MAX_FACTOR = 1e3


class MoeConfig(Section):
    """The `moe` family's routed experts (docs/moe.md)."""

    num_experts: int = Field(
        8, gt=0, le=MAX_EXPERTS, description="Routed experts per MoE layer (E); at most 65536."
    )
    experts_per_token: int = Field(
        2,
        gt=0,
        le=MAX_EXPERTS,
        description="Experts each token is sent to (top-k); at most num_experts.",
    )
    d_ff_expert: PositiveInt = Field(
        256, description="Hidden width of one expert's SwiGLU MLP (and of each shared expert)."
    )
    num_shared_experts: int = Field(
        0,
        ge=0,
        le=MAX_EXPERTS,
        description="Experts every token passes through, ungated (DeepSeek style): one SwiGLU MLP of width num_shared_experts * d_ff_expert added to the routed experts' output; at most 65536.",
    )
    first_dense_layers: Count = Field(
        0,
        description="The first blocks keep a dense SwiGLU MLP of width model.d_ff (DeepSeek style); the rest route to experts. Less than model.num_layers.",
    )
    score: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="The router's scores of the experts: softmax over the experts (Qwen3-MoE, Mixtral) or an independent sigmoid per expert (DeepSeek-V3). The load-balance loss reads sigmoid scores normalised over the experts, as DeepSeek-V3's sequence-wise balance loss does.",
    )
    n_group: int = Field(
        1,
        gt=0,
        le=MAX_EXPERTS,
        description="Group-limited routing (DeepSeek-V3): the experts form n_group equal groups; a token first picks the topk_group groups with the highest sum of their two best scores (bias included), then its top-k experts within those. 1 = no groups. Must divide num_experts.",
    )
    topk_group: int = Field(
        1,
        gt=0,
        le=MAX_EXPERTS,
        description="Groups each token may route to (at most n_group); with n_group > 1 the top-k must fit in them (experts_per_token <= topk_group * num_experts / n_group).",
    )
    routed_scaling_factor: float = Field(
        1.0,
        gt=0,
        le=1e3,
        allow_inf_nan=False,
        description="Each token's expert weights are multiplied by this after the top-k (DeepSeek-V3: 2.5); 1 = none.",
    )
    norm_topk_prob: bool = Field(
        True,
        description="Divide each token's top-k router probabilities by their sum (Qwen3-MoE's norm_topk_prob; Mixtral's softmax over the top-k logits is the same); false = the raw softmax probabilities.",
    )
    router_z_loss: float = Field(
        0.0,
        ge=0,
        le=Z_LOSS_MAX,
        allow_inf_nan=False,
        description="Weight of the router z-loss (ST-MoE): per token logsumexp(router logits)^2, summed over MoE layers; 0 = not computed. ST-MoE uses 1e-3.",
    )
    load_balance_loss: float = Field(
        0.0,
        ge=0,
        le=1e3,
        allow_inf_nan=False,
        description="Weight of the load-balance loss (Switch/GShard): E * sum_e f_e P_e per MoE layer (f_e: fraction of assignments to expert e, P_e: its mean router probability), summed over layers; 0 = not computed. Switch uses 1e-2.",
    )
    balance: Literal["aux_loss", "aux_free"] = Field(
        "aux_loss",
        description="aux_loss = only the losses above balance the experts; aux_free = DeepSeek-V3's per-expert routing bias as well: added to the router scores when choosing experts (never to the weights), moved by bias_update_rate towards equal load after every step, outside the gradient, and saved in checkpoints.",
    )
    bias_update_rate: float = Field(
        1e-3,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="balance: aux_free: each step an expert's bias moves by this much, up if it got fewer tokens than the mean, down if more (DeepSeek-V3's gamma).",
    )
    capacity_factor: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="null = dropless (every token reaches its experts; grouped matmuls over exactly the routed tokens). A number = each expert takes at most capacity_factor * tokens * experts_per_token / num_experts tokens per device and group of tokens; the rest are dropped (their expert output is 0), reported as moe/dropped_fraction. At most 1000; from num_experts / experts_per_token up no token is dropped (an expert takes a token at most once).",
    )

    buffer_factor: float | None = Field(
        None,
        gt=0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="Expert parallelism (mesh.expert > 1): null = each device's receive buffer holds the worst case (dropless: every source's rows, P x T x K rows for P devices on the expert axis). A number = it holds buffer_factor * T * K rows (T tokens and K experts per token of a device: what arrives when the load is even, times the factor); rows past it are dropped (their expert output is 0), last source and last expert first, and reported as moe/dropped_fraction. At most 1000.",
    )
    expert_tensor_parallel: bool = Field(
        True,
        description="With mesh.tensor > 1: the experts' d_ff stays split over tensor inside the expert computation (the tensor group's tokens are all-gathered before routing and the expert outputs reduce-scattered back), so no device gathers an expert whole. false = each device gathers its experts whole over tensor and routes only its own tokens.",
    )
    grouped_matmul: Literal["auto", "ragged_dot", "blocked"] = Field(
        "auto",
        description="How the experts' grouped matmuls run: ragged_dot (jax.lax.ragged_dot: TPU compiles it into grouped-matmul kernels), blocked (each expert's tokens padded to blocks of up to 128 rows, a batched matmul per block; for CPU, where ragged_dot runs every expert over every row), auto = ragged_dot on TPU, blocked on CPU and GPU (no compile or run here showed GPU's ragged_dot to be a grouped kernel). Both are exact.",
    )

    @model_validator(mode="after")
    def _top_k(self) -> MoeConfig:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) exceeds num_experts "
                f"({self.num_experts}); allowed: 1..num_experts"
            )
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) does not divide num_experts ({self.num_experts}); "
                "allowed: a divisor of num_experts"
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group}); "
                "allowed: 1..n_group"
            )
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.experts_per_token > reachable:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) exceeds the {reachable} experts of "
                f"topk_group={self.topk_group} groups of {self.num_experts // self.n_group}; "
                "allowed: more groups (topk_group) or a smaller top-k"
            )
        return self


class YarnConfig(Section):
    """YaRN's rescaling of the rotary frequencies (Hugging Face rope_type "yarn", as
    DeepSeek-V3 uses it): wavelengths longer than the context trained for are interpolated,
    short ones kept, a linear ramp between."""

    factor: float = Field(
        40.0,
        gt=0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="How much the context is extended; at most 1000.",
    )
    original_max_position_embeddings: PositiveInt = Field(
        4096, description="Context length the unscaled frequencies were trained for."
    )
    beta_fast: float = Field(
        32.0,
        ge=1 / MAX_FACTOR,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="Rotations over the original context above which a frequency is kept; 0.001..1000.",
    )
    beta_slow: float = Field(
        1.0,
        ge=1 / MAX_FACTOR,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="Rotations over the original context below which a frequency is interpolated fully; 0.001..1000.",
    )
    mscale: float = Field(
        1.0,
        ge=0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="With mscale_all_dim: the rotary cos/sin are scaled by (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1). At most 1000.",
    )
    mscale_all_dim: float = Field(
        1.0,
        ge=0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="The softmax scale is multiplied by (0.1 mscale_all_dim ln(factor) + 1)^2 (0 = not); DeepSeek-V3: 1. At most 1000.",
    )


class DeepseekConfig(Section):
    """The `deepseek` family's multi-head latent attention and multi-token prediction (its
    routed experts are model.moe; docs/moe.md)."""

    q_lora_rank: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Width of the queries' low-rank bottleneck (projection down, RMSNorm, projection up); null = one full-rank query projection. DeepSeek-V3: 1536.",
    )
    kv_lora_rank: PositiveInt = Field(
        64,
        description="Width of the compressed latent the keys and values are projected from (and the decode cache holds). DeepSeek-V3: 512.",
    )
    qk_nope_head_dim: PositiveInt = Field(
        32, description="Per-head query/key width without rotary embedding. DeepSeek-V3: 128."
    )
    qk_rope_head_dim: int = Field(
        16,
        gt=0,
        le=MAX_ROPE_HEAD_DIM,
        description="Per-head query width with rotary embedding; the rotary key of this width is shared by every head. Even, at most 65536. DeepSeek-V3: 64.",
    )
    v_head_dim: PositiveInt = Field(32, description="Per-head value width. DeepSeek-V3: 128.")
    yarn: YarnConfig | None = Field(
        None,
        description="null = plain rotary frequencies; {factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim} = YaRN (DeepSeek-V3's long-context extension), which also scales the softmax.",
    )
    mtp_num_layers: Count = Field(
        0,
        le=16,
        description="Multi-token prediction modules (DeepSeek-V3): module d combines the previous depth's hidden state with the embedding of the token d ahead and predicts the token d+1 ahead through the shared LM head; trained with the model, not run by kiln generate. 0 = none.",
    )
    mtp_loss_weight: float = Field(
        0.3,
        ge=0,
        le=1e3,
        allow_inf_nan=False,
        description="Weight of the mean of the modules' losses in the loss (DeepSeek-V3's lambda: 0.3, then 0.1); logged as learning/mtp_loss before weighting.",
    )

    @model_validator(mode="after")
    def _even_rope(self) -> DeepseekConfig:
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) is odd; allowed: an even width "
                "(rotary pairs)"
            )
        return self


class Gemma3Config(Section):
    """The `gemma3` family's own numbers (docs/gemma3.md); its norms, embedding scale and GeGLU
    MLP come with the family."""

    query_pre_attn_scalar: int | None = Field(
        None,
        gt=0,
        le=INT32_MAX,
        description="Attention scores are q.k / sqrt(query_pre_attn_scalar) (Hugging Face's query_pre_attn_scalar; Gemma 3 27B: 168 with head_dim 128); null = head_dim.",
    )


class GptOssYarnConfig(YarnConfig):
    """GPT-OSS's YaRN: DeepSeek-V3's rescaling with its own defaults, the ramp's ends as
    computed (truncate: false), and no change to the softmax scale."""

    factor: float = Field(
        32.0,
        gt=0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="How much the context is extended; at most 1000.",
    )
    mscale: float = Field(
        0.0,
        ge=0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="With mscale_all_dim: the rotary cos/sin are scaled by (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1); 0 (GPT-OSS) = by 0.1 ln(factor) + 1. At most 1000.",
    )
    mscale_all_dim: float = Field(
        0.0,
        ge=0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="See mscale; 0 = not given (GPT-OSS). The softmax scale stays 1/sqrt(head_dim). At most 1000.",
    )
    truncate: bool = Field(
        False,
        description="Round the ends of the ramp between kept and interpolated frequencies outwards to whole dimensions (Hugging Face's default when absent); GPT-OSS: false.",
    )


class GptOssConfig(Section):
    """The `gpt_oss` family's own numbers (docs/gpt-oss.md); its routed experts are model.moe,
    its sinks model.attention_sinks, its sliding-window layers model.layer_types."""

    swiglu_alpha: float = Field(
        1.702,
        gt=0,
        allow_inf_nan=False,
        description="The experts' gate is gate * sigmoid(swiglu_alpha * gate) (Hugging Face's swiglu_alpha).",
    )
    swiglu_limit: float = Field(
        7.0,
        gt=0,
        allow_inf_nan=False,
        description="Before the gate, the gate projection is clipped above at swiglu_limit and the up projection to [-swiglu_limit, swiglu_limit] (Hugging Face's swiglu_limit).",
    )
    yarn: GptOssYarnConfig | None = Field(
        default_factory=GptOssYarnConfig,
        description="The rotary frequencies' YaRN rescaling in every layer (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, truncate; GPT-OSS: 32, 4096, 32, 1, 0, 0, false); null = plain rotary frequencies.",
    )
