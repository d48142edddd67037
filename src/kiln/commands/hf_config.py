"""Hugging Face config.json <-> kiln's `model` section (the architecture, not the weights).

kiln's llama family is Hugging Face's Llama; with `model.qk_norm` it is Qwen3 (Llama's
attention plus an RMSNorm of each query and key head over head_dim, weighted per channel,
before the rotary embedding), with every layer on full attention (no sliding window).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(model_cfg, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM (Qwen3ForCausalLM with qk_norm) equal to kiln's model;
    KilnError if HF cannot hold it."""
    m = model_cfg
    if m.logit_softcap is not None:
        raise KilnError(
            f"model.logit_softcap: {m.logit_softcap}, but Hugging Face Llama and Qwen3 have no "
            "logit soft-capping; only models trained with model.logit_softcap=null can be exported"
        )
    scaling = None if m.rope_scaling is None else m.rope_scaling.model_dump()
    model_type = "qwen3" if m.qk_norm else "llama"
    qwen3 = {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": m.num_layers,
        "layer_types": ["full_attention"] * m.num_layers,
    }
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **(qwen3 if m.qk_norm else {}),
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
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
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }


def _require(hf: Mapping[str, Any], key: str, path: Path):
    if key not in hf:
        raise KilnError(
            f"{path}: field {key!r} is missing; a Llama or Qwen3 config.json must set it"
        )
    return hf[key]


def _unsupported(path: Path, field: str, value, allowed: str) -> KilnError:
    return KilnError(f"{path}: {field} is {value!r}; kiln imports only {allowed}")


def model_section(hf: Mapping[str, Any], path: Path, param_dtype: str) -> dict[str, Any]:
    """kiln's `model` section from a Llama or Qwen3 config.json; KilnError naming what kiln
    cannot hold."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise _unsupported(path, "model_type", model_type, "'llama' or 'qwen3'")
    arch = hf.get("architectures") or [ARCHITECTURES[model_type]]
    if arch != [ARCHITECTURES[model_type]]:
        raise _unsupported(path, "architectures", arch, f"[{ARCHITECTURES[model_type]!r}]")
    if model_type == "qwen3":
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
    return {
        "vocab_size": _require(hf, "vocab_size", path),
        "d_model": d_model,
        "num_layers": _require(hf, "num_hidden_layers", path),
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or d_model // heads,
        "d_ff": _require(hf, "intermediate_size", path),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": model_type == "qwen3",
        "dtype": param_dtype,
        "param_dtype": param_dtype,
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }


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
