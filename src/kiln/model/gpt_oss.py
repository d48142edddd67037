"""The `gpt_oss` family: GPT-OSS on llama's attention and the `moe` family's routed experts, and
its Hugging Face format (`GptOssForCausalLM`, model_type gpt_oss).

What differs (transformers' modeling_gpt_oss.py is the reference): the q, k, v and o
projections have biases; every head has a sink (model.attention_sinks); the rotary
frequencies are YaRN's in every layer (model.gpt_oss.yarn, cos and sin scaled as YaRN
does); sliding-window and full layers alternate (model.layer_types). Every MLP is routed:
the router has a bias, each token takes the experts of its top-k logits weighted by the
softmax over those k (kiln's softmax over all experts, renormalised over the top-k, is the
same); the experts' projections have biases and their gate is a clamped SwiGLU
(`clamped_swiglu`). No shared experts, untied embeddings.

Einsum letters as in `kiln.model.llama` and `kiln.model.moe`.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from kiln.config import ModelConfig
from kiln.model.deepseek.hf import YARN_KEYS
from kiln.model.deepseek.mla import rotate, yarn_settings
from kiln.model.hf import Tensor, export_error, require, unsupported
from kiln.model.interface import DTYPES
from kiln.model.llama import ATTENTION_TENSORS, Attention, Block
from kiln.model.moe import (
    ExpertWeights,
    MoeBlock,
    MoeHF,
    MoeMlp,
    MoeTransformer,
    check_routing,
)


def _bias(cfg: ModelConfig, shape: tuple[int, ...], names: tuple) -> nnx.Param:
    """A bias of `shape` in the parameter dtype, zeros (the logical `names` shard it)."""
    zeros = jnp.zeros(shape, DTYPES[cfg.param_dtype])
    return nnx.Param(zeros, out_sharding=names, eager_sharding=False, role="bias")


def clamped_swiglu(gate, up, *, alpha: float, limit: float):
    """GPT-OSS's gate: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class GptOssAttention(Attention):
    """llama's attention (with model.attention_sinks) plus biases on its four projections and
    YaRN's rotary frequencies in every layer."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
        self.bq = _bias(cfg, (n, h), ("heads", "head_dim"))
        self.bk = _bias(cfg, (k, h), ("kv_heads", "head_dim"))
        self.bv = _bias(cfg, (k, h), ("kv_heads", "head_dim"))
        self.bo = _bias(cfg, (d,), ("norm",))
        # In the parameter dtype, as GPT-OSS's checkpoints store them (read as float32 inside).
        sinks = self.sinks[...].astype(DTYPES[cfg.param_dtype])
        self.sinks = nnx.Param(sinks, out_sharding=("heads",), eager_sharding=False, role="bias")
        yarn = cfg.gpt_oss.yarn
        truncate = True if yarn is None else yarn.truncate
        self.rope_settings = (h, cfg.rope_theta, yarn_settings(yarn), truncate)

    def _rope(self, x_BSNH, positions_BS, local):
        return rotate(x_BSNH, positions_BS, self.rope_settings)

    def _projections(self, x_BSD):
        q_BSNH, k_BSKH, v_BSKH = super()._projections(x_BSD)
        dt = self.dtype
        return (
            q_BSNH + self.bq[...].astype(dt),
            k_BSKH + self.bk[...].astype(dt),
            v_BSKH + self.bv[...].astype(dt),
        )

    def _output(self, out_BSNH):
        return super()._output(out_BSNH) + self.bo[...].astype(self.dtype)


class GptOssMlp(MoeMlp):
    """The `moe` family's routed experts with a router bias, expert biases and the clamped
    SwiGLU gate."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        d, e, f = cfg.d_model, cfg.moe.num_experts, cfg.moe.d_ff_expert
        self.router_bias = _bias(cfg, (e,), (None,))
        self.gate_bias = _bias(cfg, (e, f), ("experts", "mlp"))
        self.up_bias = _bias(cfg, (e, f), ("experts", "mlp"))
        self.down_bias = _bias(cfg, (e, d), ("experts", None))
        self.swiglu = (cfg.gpt_oss.swiglu_alpha, cfg.gpt_oss.swiglu_limit)

    def _router_bias(self):
        return self.router_bias[...]

    def _experts(self) -> ExpertWeights:
        return ExpertWeights(
            *super()._experts()[:3],
            self.gate_bias[...],
            self.up_bias[...],
            self.down_bias[...],
        )

    def _act(self):
        alpha, limit = self.swiglu
        return functools.partial(clamped_swiglu, alpha=alpha, limit=limit)


class GptOssBlock(MoeBlock):
    """The `moe` family's routed block with GPT-OSS's attention and experts."""

    def _make_attention(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return GptOssAttention(cfg, rngs=rngs)

    def _make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return GptOssMlp(cfg, rngs=rngs)


class GptOssTransformer(MoeTransformer):
    """The `gpt_oss` family (implements `kiln.model.LanguageModel`): the `moe` family's
    Transformer with GPT-OSS's blocks in every layer (model.moe.first_dense_layers is 0)."""

    moe_block: ClassVar[type[Block]] = GptOssBlock


# ---------------------------------------------------------------------------------------------
# Hugging Face: GptOssForCausalLM

# HF name inside layer i, kiln path inside the stack, leading kiln dims that are HF's input
# dims (as llama's tables; 0: HF's bias is kiln's flattened), the part of HF's last axis.
# HF stores an expert's projections as [in, out] (kiln's layout), the gate and up projections
# in one tensor whose even columns are the gate's and odd ones the up's.
LAYER_TENSORS = (
    *((name, path, n_in, None) for name, path, n_in in ATTENTION_TENSORS),
    ("self_attn.q_proj.bias", ("attn", "bq"), 0, None),
    ("self_attn.k_proj.bias", ("attn", "bk"), 0, None),
    ("self_attn.v_proj.bias", ("attn", "bv"), 0, None),
    ("self_attn.o_proj.bias", ("attn", "bo"), None, None),
    ("self_attn.sinks", ("attn", "sinks"), None, None),
    ("mlp.router.weight", ("mlp", "router"), 1, None),
    ("mlp.router.bias", ("mlp", "router_bias"), None, None),
    ("mlp.experts.gate_up_proj", ("mlp", "w_gate"), None, (0, 2)),
    ("mlp.experts.gate_up_proj", ("mlp", "w_up"), None, (1, 2)),
    ("mlp.experts.gate_up_proj_bias", ("mlp", "gate_bias"), None, (0, 2)),
    ("mlp.experts.gate_up_proj_bias", ("mlp", "up_bias"), None, (1, 2)),
    ("mlp.experts.down_proj", ("mlp", "w_down"), None, None),
    ("mlp.experts.down_proj_bias", ("mlp", "down_bias"), None, None),
)
# GptOssConfig's defaults where they differ from what `common_section` assumes of a missing
# field (a config.json may leave them out).
HF_DEFAULTS = {
    "head_dim": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
}
LAYER_TYPES = ("full_attention", "sliding_attention")
# GptOssConfig's rotary settings when a config.json has none.
HF_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def hf_rope(hf, path) -> tuple[float, dict | None]:
    """(rope_theta, kiln's model.gpt_oss.yarn or None) as transformers reads a GPT-OSS
    config.json: the legacy rope_scaling before rope_parameters, GptOssConfig's YaRN when
    neither is given, truncate true when absent (transformers' default)."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    given = hf.get(field)
    found = dict(HF_ROPE if given is None else given)
    theta = float(found.pop("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"])))
    kind = found.pop("rope_type", found.pop("type", "default"))
    if kind == "default" and not found:
        return theta, None
    allowed = "rope_type 'default' or 'yarn' (" + ", ".join(YARN_KEYS) + ", truncate)"
    extra = set(found) - {*YARN_KEYS, "truncate"}
    if kind != "yarn" or found.get("factor") is None or extra:
        raise unsupported(path, field, given, allowed)
    found.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    yarn = {k: found[k] for k in YARN_KEYS if found.get(k) is not None}
    return theta, {**yarn, "truncate": bool(found.get("truncate", True))}


class GptOssHF(MoeHF):
    """GPT-OSS (GptOssForCausalLM): layers alternate sliding-window and full attention as
    layer_types says; kiln's `blocks` are its layers, all routed (no dense stack)."""

    architectures: ClassVar[dict[str, str]] = {"gpt_oss": "GptOssForCausalLM"}

    def model_type(self, m) -> str:
        return "gpt_oss"

    def check_exportable(self, m, kind: str) -> None:
        arch = self.architectures[kind]
        self.check_no_softcap(m, kind)
        check_routing(m.moe, arch)
        if not m.moe.norm_topk_prob:
            raise export_error(
                "model.moe.norm_topk_prob",
                "false",
                f"Hugging Face {arch} weights the top-k experts by a softmax over their logits",
                "model.moe.norm_topk_prob=true",
            )

    def config_fields(self, m, kind: str) -> dict:
        moe, own = m.moe, m.gpt_oss
        yarn = None
        if own.yarn is not None:
            fields = own.yarn.model_dump()
            for k in ("mscale", "mscale_all_dim"):  # 0 = not given
                if not fields[k]:
                    del fields[k]
            yarn = {"rope_type": "yarn", **fields}
        rope = {"rope_type": "default"} if yarn is None else yarn
        return {
            "intermediate_size": moe.d_ff_expert,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "router_aux_loss_coef": moe.load_balance_loss,
            "output_router_logits": False,
            "swiglu_alpha": own.swiglu_alpha,
            "swiglu_limit": own.swiglu_limit,
            "sliding_window": m.sliding_window,
            "layer_types": [LAYER_TYPES[local] for local in m.local_layers()],
            "attention_bias": True,
            "rope_parameters": {**rope, "rope_theta": m.rope_theta},
            "rope_scaling": yarn,  # what transformers < 5 reads
        }

    def expert_count_field(self, hf, kind: str) -> None:
        return None  # a layer's experts share one tensor per projection

    def check_import(self, hf, path, kind: str) -> None:
        if not hf.get("attention_bias", True):
            raise unsupported(path, "attention_bias", hf["attention_bias"], "true (GPT-OSS's)")

    def common_view(self, hf, path):
        # The rotary settings are read by `section`; attention_bias is checked above, and
        # hidden_act is not read by GPT-OSS's experts (their gate is the clamped SwiGLU).
        skip = ("rope_scaling", "rope_parameters", "attention_bias", "hidden_act")
        own = {k: v for k, v in hf.items() if k not in skip}
        return {**HF_DEFAULTS, **own, "rope_theta": hf_rope(hf, path)[0]}

    def section(self, hf, path, kind: str, names=()) -> dict:
        layers = require(hf, "num_hidden_layers", path)
        types = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % 2] for i in range(layers)]
        sliding = "sliding_attention" in types
        experts = hf.get("num_local_experts", hf.get("num_experts"))
        if experts is None:
            require(hf, "num_local_experts", path)
        return {
            "family": "gpt_oss",
            "attention_sinks": True,
            "layer_types": list(types),
            "sliding_window": hf.get("sliding_window", 128) if sliding else None,
            "moe": {
                "num_experts": experts,
                "experts_per_token": hf.get("num_experts_per_tok", 4),
                "d_ff_expert": require(hf, "intermediate_size", path),
                "norm_topk_prob": True,
                # The same weight; kiln's term is per layer, summed (docs/interop.md).
                "load_balance_loss": float(hf.get("router_aux_loss_coef", 0.001)),
            },
            "gpt_oss": {
                "swiglu_alpha": hf.get("swiglu_alpha", 1.702),
                "swiglu_limit": hf.get("swiglu_limit", 7.0),
                "yarn": hf_rope(hf, path)[1],
            },
        }

    def layer_tensors(self, m, kind: str, layer: int) -> list[Tensor]:
        return [
            Tensor(f"model.layers.{layer}.{name}", ("blocks", *path), (layer,), n_in, part=part)
            for name, path, n_in, part in LAYER_TENSORS
        ]

    def describe(self, m) -> str:
        text = super().describe(m)
        local = sum(m.local_layers())
        return text + (f", {local} sliding_attention (window {m.sliding_window})" if local else "")


__all__ = ["GptOssHF", "GptOssTransformer", "clamped_swiglu"]
