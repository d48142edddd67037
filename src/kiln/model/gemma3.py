"""The `gemma3` family: Gemma 3's text decoder on llama's attention, blocks and stack, and its
Hugging Face format (`Gemma3ForCausalLM`, model_type gemma3_text).

What differs from llama (transformers' modeling_gemma3.py is the reference): every RMSNorm
multiplies by (1 + w), w initialised to zeros; a block also norms its attention and MLP outputs
before their residual adds (four norms); query and key heads are normed (model.qk_norm,
required); scores are q.k / sqrt(model.gemma3.query_pre_attn_scalar); the MLP is GeGLU with
gelu's tanh approximation; embeddings are multiplied by sqrt(d_model) in the compute dtype.
Its sliding-window layers (model.layer_types, model.sliding_window), their own rotary base
(model.local_rope_theta) and the global layers' linear rope scaling are llama's.

Einsum letters as in `kiln.model.llama`.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from kiln.config import ModelConfig
from kiln.model.hf import HFFormat, Tensor, export_error, require, rope, unsupported
from kiln.model.interface import DTYPES
from kiln.model.llama import (
    ACT_BSD,
    ATTENTION_TENSORS,
    MLP_TENSORS,
    QK_NORM_TENSORS,
    Attention,
    Block,
    Mlp,
    RMSNorm,
    Transformer,
)
from kiln.parallel.mesh import constrain


class GemmaRMSNorm(RMSNorm):
    """llama's RMSNorm with the multiplier 1 + scale, scale initialised to zeros (Gemma's
    weights are stored so)."""

    def __init__(self, dim: int, axis: str, cfg: ModelConfig):
        zeros = jnp.zeros((dim,), DTYPES[cfg.param_dtype])
        self.scale = nnx.Param(zeros, out_sharding=(axis,), eager_sharding=False, role="norm")
        self.eps = cfg.norm_eps

    def multiplier(self) -> jax.Array:
        return 1.0 + self.scale[...].astype(jnp.float32)


class QueryNorm(GemmaRMSNorm):
    """The query heads' norm, whose multiplier also holds sqrt(head_dim / query_pre_attn_scalar):
    every attention implementation scales scores by head_dim^-0.5, so these queries give
    Gemma's query_pre_attn_scalar^-0.5 (in the norm's float32 product: no rounding of its own;
    none at all when the two are equal, as in Gemma 3 up to 12B)."""

    def __init__(self, dim: int, axis: str, cfg: ModelConfig):
        super().__init__(dim, axis, cfg)
        scalar = cfg.gemma3.query_pre_attn_scalar or dim
        self.gain = None if scalar == dim else (dim / scalar) ** 0.5

    def multiplier(self) -> jax.Array:
        base = super().multiplier()
        return base if self.gain is None else base * self.gain


class GemmaAttention(Attention):
    """llama's attention with Gemma's query and key norms."""

    norm: ClassVar[type[RMSNorm]] = GemmaRMSNorm

    def _query_norm(self, cfg: ModelConfig) -> RMSNorm:
        return QueryNorm(cfg.resolved_head_dim, "head_dim", cfg)


class GeGlu(Mlp):
    """GeGLU: (gelu(x W_gate) * x W_up) W_down with gelu's tanh approximation
    (transformers' gelu_pytorch_tanh)."""

    activation: ClassVar = staticmethod(functools.partial(jax.nn.gelu, approximate=True))


class GemmaBlock(Block):
    """x + post_attn_norm(attn(attn_norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x)))."""

    norm: ClassVar[type[RMSNorm]] = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.post_attn_norm = GemmaRMSNorm(cfg.d_model, "norm", cfg)
        self.post_mlp_norm = GemmaRMSNorm(cfg.d_model, "norm", cfg)

    def _make_attention(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return GemmaAttention(cfg, rngs=rngs)

    def _make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return GeGlu(cfg, rngs=rngs)

    # Each output is normed on the residual's sharding (whole d_model per token).
    def _mlp(self, h_BSD, segment_ids_BS):
        return self.post_mlp_norm(constrain(self.mlp(h_BSD), ACT_BSD)), {}

    def _rest(self, x_BSD, attn_BSD, segment_ids_BS):
        normed_BSD = self.post_attn_norm(constrain(attn_BSD, ACT_BSD))
        return super()._rest(x_BSD, normed_BSD, segment_ids_BS)


class Gemma3Transformer(Transformer):
    """The `gemma3` family (implements `kiln.model.LanguageModel`): llama's Transformer with
    Gemma's blocks, final norm and embedding scale."""

    block: ClassVar[type[Block]] = GemmaBlock
    norm: ClassVar[type[RMSNorm]] = GemmaRMSNorm

    def embed(self, inputs_BS):
        x_BSD = super().embed(inputs_BS)
        # As transformers: sqrt(d_model) rounded to the activations' dtype first.
        return x_BSD * jnp.asarray(self.cfg.d_model**0.5, jnp.float32).astype(x_BSD.dtype)


# ---------------------------------------------------------------------------------------------
# Hugging Face: Gemma3ForCausalLM

# HF name inside layer i, kiln path inside the stack, leading kiln dims that are HF's input
# dims (as llama's tables). Gemma's post_attention_layernorm norms the attention output; the
# MLP's input norm is pre_feedforward_layernorm.
LAYER_TENSORS = (
    *ATTENTION_TENSORS[:4],
    *QK_NORM_TENSORS,
    ("input_layernorm.weight", ("attn_norm", "scale"), None),
    ("post_attention_layernorm.weight", ("post_attn_norm", "scale"), None),
    ("pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), None),
    ("post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), None),
    *MLP_TENSORS,
)
# Gemma3TextConfig's defaults where they differ from what `common_section` assumes of a
# missing field (a config.json may leave them out).
HF_DEFAULTS = {
    "head_dim": 256,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def hf_rope(hf, path) -> tuple[float, dict | None, float]:
    """(the global layers' rope_theta, their model.rope_scaling, the sliding layers' base) as
    transformers 5 reads a Gemma 3 config.json: rope_parameters per layer type, else (the
    Hub's files) rope_theta, rope_scaling of the global layers and rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if params and not set(params) <= set(LAYER_TYPES):
        raise unsupported(
            path, "rope_parameters", params, "one entry per layer type (full_attention, ...)"
        )
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1e6))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 1e4))
    limit = hf.get("max_position_embeddings", HF_DEFAULTS["max_position_embeddings"])
    theta, scaling = rope({"rope_parameters": full, "max_position_embeddings": limit}, path)
    local_theta = local.pop("rope_theta")
    if local.pop("rope_type", local.pop("type", "default")) != "default" or local:
        allowed = "rope_type 'default' (the sliding layers' rotary is never rescaled)"
        raise unsupported(
            path, "rope_parameters.sliding_attention", params[LAYER_TYPES[1]], allowed
        )
    return float(theta), scaling, float(local_theta)


class Gemma3HF(HFFormat):
    """Gemma 3's text model (Gemma3ForCausalLM; the 1B and 270M checkpoints are this
    architecture, the larger ones wrap it with a vision tower)."""

    architectures: ClassVar[dict[str, str]] = {"gemma3_text": "Gemma3ForCausalLM"}

    def model_type(self, m) -> str:
        return "gemma3_text"

    def check_exportable(self, m, kind: str) -> None:
        arch = self.architectures[kind]
        self.check_no_softcap(m, kind, f"kiln reads {arch}'s final_logit_softcapping only as null")
        if m.attention_sinks:
            raise export_error(
                "model.attention_sinks", True, f"{arch} has no sinks", "model.attention_sinks=false"
            )
        if any(m.local_layers()) and m.rope_scaling is not None and m.local_rope_theta is None:
            raise export_error(
                "model.local_rope_theta",
                None,
                f"{arch}'s sliding_attention layers never rescale their rotary frequencies, and "
                "without a base of their own kiln's take model.rope_scaling",
                "a model.local_rope_theta (Gemma 3: 10000)",
            )

    def config_fields(self, m, kind: str) -> dict:
        scaling = None if m.rope_scaling is None else m.rope_scaling.hf_fields()
        full = {"rope_type": "default", **(scaling or {}), "rope_theta": m.rope_theta}
        local_theta = m.local_rope_theta or m.rope_theta
        types = [LAYER_TYPES[local] for local in m.local_layers()]
        return {
            "intermediate_size": m.d_ff,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": m.gemma3.query_pre_attn_scalar or m.resolved_head_dim,
            "sliding_window": m.sliding_window,
            "layer_types": types,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
                "full_attention": full,
            },
            # transformers < 5 reads these three.
            "rope_scaling": scaling,
            "rope_local_base_freq": local_theta,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "use_bidirectional_attention": False,
            "attention_bias": False,
        }

    def check_import(self, hf, path, kind: str) -> None:
        for field in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(field) is not None:
                raise unsupported(path, field, hf[field], "null (no soft-capping)")
        if hf.get("use_bidirectional_attention"):
            raise unsupported(path, "use_bidirectional_attention", True, "false (causal attention)")
        act = hf.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise unsupported(path, "hidden_activation", act, "'gelu_pytorch_tanh' (GeGLU)")
        pattern = hf.get("sliding_window_pattern", 6)
        if not hf.get("layer_types") and not (
            isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1
        ):  # without layer_types, every pattern-th layer is a full-attention one
            raise unsupported(path, "sliding_window_pattern", pattern, "an integer >= 1")

    def common_view(self, hf, path):
        # The rotary settings are read per layer type by `section`; hidden_act is not
        # Gemma 3's field (hidden_activation is, checked above).
        skip = ("rope_scaling", "rope_parameters", "hidden_act")
        own = {k: v for k, v in hf.items() if k not in skip}
        return {**HF_DEFAULTS, **own, "rope_theta": hf_rope(hf, path)[0]}

    def section(self, hf, path, kind: str, names=()) -> dict:
        _, scaling, local_theta = hf_rope(hf, path)
        layers = require(hf, "num_hidden_layers", path)
        pattern = hf.get("sliding_window_pattern", 6)
        types = hf.get("layer_types") or [
            LAYER_TYPES[bool((i + 1) % pattern)] for i in range(layers)
        ]
        sliding = "sliding_attention" in types
        window = hf.get("sliding_window", 4096) if sliding else None
        scalar = hf.get("query_pre_attn_scalar", 256)
        return {
            "family": "gemma3",
            "qk_norm": True,
            "rope_scaling": scaling,
            "layer_types": list(types),
            "sliding_window": window,
            "local_rope_theta": local_theta if sliding else None,
            "gemma3": {"query_pre_attn_scalar": scalar},
        }

    def layer_tensors(self, m, kind: str, layer: int) -> list[Tensor]:
        return [
            Tensor(f"model.layers.{layer}.{name}", ("blocks", *path), (layer,), n_in)
            for name, path, n_in in LAYER_TENSORS
        ]

    def describe(self, m) -> str:
        local = sum(m.local_layers())
        return f" ({local} sliding_attention, window {m.sliding_window})" if local else ""


__all__ = ["Gemma3HF", "Gemma3Transformer"]
