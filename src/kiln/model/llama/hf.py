"""The `llama` family's Hugging Face format: Llama, and Qwen3 with model.qk_norm; the tensor
tables the other families' formats extend."""

from __future__ import annotations

from typing import ClassVar

from kiln.model.hf import HFFormat, Tensor, unsupported

# HF name inside layer i, kiln path inside its stack, leading kiln dims that are HF's input
# dims (None = a vector, same layout). Linear weights are [out, in] in HF: wq [D,N,H] ->
# q_proj [N*H, D], wk/wv [D,K,H] -> [K*H, D], wo [N,H,D] -> o_proj [D, N*H], w_gate/w_up
# [D,F] -> [F, D], w_down [F,D] -> [D, F], lm_head [D,V] -> [V, D]. Both use the rotate-half
# rotary layout (HF's `rotate_half`, same frequencies), so q/k map without the head-dim
# permutation HF's script applies to Meta's interleaved checkpoints (tests/test_hf.py).
ATTENTION_TENSORS = (
    ("self_attn.q_proj.weight", ("attn", "wq"), 1),
    ("self_attn.k_proj.weight", ("attn", "wk"), 1),
    ("self_attn.v_proj.weight", ("attn", "wv"), 1),
    ("self_attn.o_proj.weight", ("attn", "wo"), 2),
    ("input_layernorm.weight", ("attn_norm", "scale"), None),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), None),
)
MLP_TENSORS = (
    ("mlp.gate_proj.weight", ("mlp", "w_gate"), 1),
    ("mlp.up_proj.weight", ("mlp", "w_up"), 1),
    ("mlp.down_proj.weight", ("mlp", "w_down"), 1),
)
# Qwen3's per-head query/key RMSNorm weights [H], for models with model.qk_norm.
QK_NORM_TENSORS = (
    ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), None),
    ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), None),
)
FULL_ATTENTION = {"use_sliding_window": False, "sliding_window": None}


class LlamaHF(HFFormat):
    """Hugging Face's Llama; with `model.qk_norm`, Qwen3 (Llama's attention plus an RMSNorm of
    each query and key head over head_dim, weighted per channel, before the rotary
    embedding), with every layer on full attention (no sliding window)."""

    architectures: ClassVar[dict[str, str]] = {
        "llama": "LlamaForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }

    def model_type(self, m) -> str:
        return "qwen3" if m.qk_norm else "llama"

    def config_fields(self, m, kind: str) -> dict:
        qwen3 = {
            **FULL_ATTENTION,
            "max_window_layers": m.num_layers,
            "layer_types": ["full_attention"] * m.num_layers,
        }
        fields = {"intermediate_size": m.d_ff, "attention_bias": False, "mlp_bias": False}
        return {**(qwen3 if kind == "qwen3" else {}), **fields}

    def check_import(self, hf, path, kind: str) -> None:
        full_attention_only(hf, path)

    def section(self, hf, path, kind: str, names=()) -> dict:
        return {"qk_norm": kind.startswith("qwen3")}

    def attention_tensors(self, m, layer: int, stack: str, index: int) -> list[Tensor]:
        names = ATTENTION_TENSORS + (QK_NORM_TENSORS if m.qk_norm else ())
        return [
            Tensor(f"model.layers.{layer}.{name}", (stack, *path), (index,), n_in)
            for name, path, n_in in names
        ]

    def mlp_tensors(self, layer: int, stack: str, index: int) -> list[Tensor]:
        return [
            Tensor(f"model.layers.{layer}.{name}", (stack, *path), (index,), n_in)
            for name, path, n_in in MLP_TENSORS
        ]

    def layer_tensors(self, m, kind: str, layer: int) -> list[Tensor]:
        attention = self.attention_tensors(m, layer, "blocks", layer)
        return attention + self.mlp_tensors(layer, "blocks", layer)


def full_attention_only(hf, path) -> None:
    """KilnError unless a Qwen3-shaped config.json has every layer on full attention."""
    if not str(hf.get("model_type", "")).startswith("qwen3"):
        return
    sliding = hf.get("use_sliding_window", False)
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if sliding or layer_types != {"full_attention"}:
        field, value = ("use_sliding_window", sliding) if sliding else ("layer_types", layer_types)
        raise unsupported(path, field, value, "full attention in every layer")
