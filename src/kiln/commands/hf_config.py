"""Hugging Face config.json <-> kiln's `model` section (the architecture, not the weights).

kiln's llama family is Hugging Face's Llama; with `model.qk_norm` it is Qwen3 (Llama's
attention plus an RMSNorm of each query and key head over head_dim, weighted per channel,
before the rotary embedding), with every layer on full attention (no sliding window).

kiln's moe family with `model.qk_norm` is Qwen3-MoE (Qwen3's attention; `first_dense_layers`
= its `mlp_only_layers` 0..N-1; `moe_intermediate_size` = d_ff_expert, `intermediate_size` =
d_ff of the dense layers), without it Mixtral (Llama's attention, experts in every layer,
top-k weights always renormalised). Both route as kiln does: softmax over the experts, the
top-k probabilities as weights, divided by their sum if norm_topk_prob; neither has shared
experts, a routing bias or a token capacity.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MOE_TYPES = ("qwen3_moe", "mixtral")


def model_type(model_cfg) -> str:
    """The Hugging Face model_type of a kiln model: by family, and by qk_norm within it."""
    if model_cfg.family == "moe":
        return "qwen3_moe" if model_cfg.qk_norm else "mixtral"
    return "qwen3" if model_cfg.qk_norm else "llama"


def _export_error(field: str, value, why: str, allowed: str) -> KilnError:
    return KilnError(f"{field}: {value}, but {why}; only models with {allowed} can be exported")


def _check_exportable(m, kind: str) -> None:
    if m.logit_softcap is not None:
        raise _export_error(
            "model.logit_softcap",
            m.logit_softcap,
            "Hugging Face Llama, Qwen3, Qwen3-MoE and Mixtral have no logit soft-capping",
            "model.logit_softcap=null",
        )
    if kind not in MOE_TYPES:
        return
    moe = m.moe
    if moe.balance == "aux_free":
        raise _export_error(
            "model.moe.balance",
            moe.balance,
            "Hugging Face Qwen3-MoE and Mixtral choose experts without a routing bias",
            "model.moe.balance=aux_loss",
        )
    if moe.num_shared_experts:
        raise _export_error(
            "model.moe.num_shared_experts",
            moe.num_shared_experts,
            "Hugging Face Qwen3-MoE and Mixtral have no shared experts",
            "model.moe.num_shared_experts=0",
        )
    if kind == "mixtral" and moe.first_dense_layers:
        raise _export_error(
            "model.moe.first_dense_layers",
            moe.first_dense_layers,
            "Mixtral (the export of an moe model without model.qk_norm) has experts in every layer",
            "first_dense_layers=0, or model.qk_norm=true (Qwen3-MoE)",
        )
    if kind == "mixtral" and not moe.norm_topk_prob:
        raise _export_error(
            "model.moe.norm_topk_prob",
            "false",
            "Mixtral (the export of an moe model without model.qk_norm) renormalises the top-k weights",
            "norm_topk_prob=true, or model.qk_norm=true (Qwen3-MoE)",
        )


def export_notes(model_cfg) -> list[str]:
    """What an export leaves behind that changes no inference result."""
    moe = model_cfg.moe if model_cfg.family == "moe" else None
    if moe is None or moe.capacity_factor is None:
        return []
    return [
        f"model.moe.capacity_factor {moe.capacity_factor} not exported: Hugging Face's "
        f"{ARCHITECTURES[model_type(model_cfg)]} runs every token through its experts "
        "(dropless), as kiln does with capacity_factor null"
    ]


def hf_config(model_cfg, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of the Hugging Face model equal to kiln's (`model_type`); KilnError if HF
    cannot hold it."""
    m = model_cfg
    kind = model_type(m)
    _check_exportable(m, kind)
    scaling = None if m.rope_scaling is None else m.rope_scaling.model_dump()
    return {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        **_family_fields(m, kind),
        "hidden_size": m.d_model,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.resolved_head_dim,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        # transformers < 5 reads rope_scaling, transformers >= 5 rope_parameters.
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": m.max_seq_len,
        "torch_dtype": m.param_dtype,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": m.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }


def _family_fields(m, kind: str) -> dict[str, Any]:
    """The fields of config.json that only `kind` has."""
    full_attention = {"use_sliding_window": False, "sliding_window": None}
    if kind in ("llama", "qwen3"):
        qwen3 = {
            **full_attention,
            "max_window_layers": m.num_layers,
            "layer_types": ["full_attention"] * m.num_layers,
        }
        fields = {"intermediate_size": m.d_ff, "attention_bias": False, "mlp_bias": False}
        return {**(qwen3 if kind == "qwen3" else {}), **fields}
    moe = m.moe
    routing = {
        "num_experts_per_tok": moe.experts_per_token,
        "router_aux_loss_coef": moe.load_balance_loss,
        "output_router_logits": False,
    }
    if kind == "mixtral":
        return {
            "intermediate_size": moe.d_ff_expert,
            "num_local_experts": moe.num_experts,
            **routing,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    return {
        **full_attention,
        "intermediate_size": m.d_ff,
        "moe_intermediate_size": moe.d_ff_expert,
        # transformers 5 also reads num_local_experts; 4.x only num_experts (the Hub's name).
        "num_experts": moe.num_experts,
        **routing,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(moe.first_dense_layers)),
        "attention_bias": False,
    }


def _require(hf: Mapping[str, Any], key: str, path: Path):
    if key not in hf:
        raise KilnError(
            f"{path}: field {key!r} is missing; a {hf['model_type']} config.json must set it"
        )
    return hf[key]


def _unsupported(path: Path, field: str, value, allowed: str) -> KilnError:
    return KilnError(f"{path}: {field} is {value!r}; kiln imports only {allowed}")


def model_section(hf: Mapping[str, Any], path: Path, param_dtype: str) -> dict[str, Any]:
    """kiln's `model` section from a Llama, Qwen3, Qwen3-MoE or Mixtral config.json;
    KilnError naming what kiln cannot hold."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise _unsupported(path, "model_type", kind, "'" + "', '".join(ARCHITECTURES) + "'")
    arch = hf.get("architectures") or [ARCHITECTURES[kind]]
    if arch != [ARCHITECTURES[kind]]:
        raise _unsupported(path, "architectures", arch, f"[{ARCHITECTURES[kind]!r}]")
    if kind in ("qwen3", "qwen3_moe"):
        sliding = hf.get("use_sliding_window", False)
        layer_types = set(hf.get("layer_types") or ["full_attention"])
        if sliding or layer_types != {"full_attention"}:
            field, value = (
                ("use_sliding_window", sliding) if sliding else ("layer_types", layer_types)
            )
            raise _unsupported(path, field, value, "full attention in every layer")
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(path, "hidden_act", hf["hidden_act"], "'silu' (SwiGLU)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            raise _unsupported(path, field, hf[field], "false (kiln has no biases)")
    theta, scaling = _rope(hf, path)
    heads = _require(hf, "num_attention_heads", path)
    d_model = _require(hf, "hidden_size", path)
    section = {
        "vocab_size": _require(hf, "vocab_size", path),
        "d_model": d_model,
        "num_layers": _require(hf, "num_hidden_layers", path),
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or d_model // heads,
        "d_ff": _require(hf, "intermediate_size", path),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": kind in ("qwen3", "qwen3_moe"),
        "dtype": param_dtype,
        "param_dtype": param_dtype,
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }
    if kind in MOE_TYPES:
        section = {"family": "moe", "moe": _moe(hf, path, kind), **section}
    return section


def _moe(hf: Mapping[str, Any], path: Path, kind: str) -> dict[str, Any]:
    """kiln's model.moe from a Qwen3-MoE or Mixtral config.json (defaults as transformers')."""
    common = {
        "experts_per_token": _require(hf, "num_experts_per_tok", path),
        # The same weight; kiln's term is per layer, summed (docs/interop.md).
        "load_balance_loss": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    if kind == "mixtral":
        if hf.get("sliding_window") is not None:
            raise _unsupported(
                path, "sliding_window", hf["sliding_window"], "null (full attention)"
            )
        if hf.get("router_jitter_noise", 0.0):
            raise _unsupported(
                path,
                "router_jitter_noise",
                hf["router_jitter_noise"],
                "0 (kiln's router has no noise)",
            )
        return {
            "num_experts": _require(hf, "num_local_experts", path),
            "d_ff_expert": _require(hf, "intermediate_size", path),
            "norm_topk_prob": True,
            **common,
        }
    # transformers 5 writes num_local_experts, the Hub's files and transformers 4 num_experts.
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        _require(hf, "num_experts", path)
    layers = _require(hf, "num_hidden_layers", path)
    dense = _dense_layers(hf, path, layers, experts)
    if dense != list(range(len(dense))) or len(dense) >= layers:
        raise KilnError(
            f"{path}: mlp_only_layers {hf.get('mlp_only_layers') or []} with "
            f"decoder_sparse_step {hf.get('decoder_sparse_step', 1)} give dense layers {dense} "
            f"of {layers}; kiln imports only dense layers 0..N-1 before the MoE layers "
            "(model.moe.first_dense_layers = N < num_hidden_layers)"
        )
    return {
        "num_experts": experts,
        "d_ff_expert": _require(hf, "moe_intermediate_size", path),
        "first_dense_layers": len(dense),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        **common,
    }


def _dense_layers(hf: Mapping[str, Any], path: Path, layers: int, experts) -> list[int]:
    """Layers of a Qwen3-MoE with a dense MLP, as transformers' Qwen3MoeDecoderLayer picks them."""
    only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    if type(step) is not int or step < 1:
        raise _unsupported(path, "decoder_sparse_step", step, "a positive integer")
    return [i for i in range(layers) if i in only or not experts or (i + 1) % step]


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_ALLOWED = (
    "rope_type 'default' (rope_theta only) or 'llama3' (rope_theta, " + ", ".join(LLAMA3_KEYS) + ")"
)


def _rope(hf: Mapping[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, kiln's model.rope_scaling) as transformers reads them: the legacy rope_scaling
    takes precedence over rope_parameters, and rope_theta outside them is the fallback."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(field) or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind == "default" and not rope:
        return theta, None
    if kind != "llama3":
        raise _unsupported(path, field, hf[field], ROPE_ALLOWED)
    # As transformers: without original_max_position_embeddings, max_position_embeddings.
    rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if set(rope) != set(LLAMA3_KEYS) or None in rope.values():
        raise _unsupported(path, field, hf[field], ROPE_ALLOWED)
    return theta, {"rope_type": "llama3", **rope}
