"""The `moe` family's Hugging Face format: Qwen3-MoE with model.qk_norm, Mixtral without."""

from __future__ import annotations

from typing import ClassVar

from kiln.errors import KilnError
from kiln.model.hf import Tensor, export_error, require, unsupported
from kiln.model.llama import FULL_ATTENTION, LlamaHF

# An MoE layer's module, and its experts' (gate, up, down) Linear names, per HF model_type.
MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
EXPERT_PATHS = (("mlp", "w_gate"), ("mlp", "w_up"), ("mlp", "w_down"))


class MoeHF(LlamaHF):
    """With `model.qk_norm`, Qwen3-MoE (Qwen3's attention; `first_dense_layers` = its
    `mlp_only_layers` 0..N-1; `moe_intermediate_size` = d_ff_expert, `intermediate_size` =
    d_ff of the dense layers); without it, Mixtral (Llama's attention, experts in every layer,
    top-k weights always renormalised). Both route as kiln does: softmax over the experts, the
    top-k probabilities as weights, divided by their sum if norm_topk_prob; neither has shared
    experts, a routing bias or a token capacity. The first_dense_layers are kiln's
    `dense_blocks` stack and the MoE layers its `blocks`; router [D,E] -> gate.weight [E, D],
    expert e's slice of w_gate/w_up [E,D,F] and w_down [E,F,D] -> that expert's Linears."""

    architectures: ClassVar[dict[str, str]] = {
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
    }

    def model_type(self, m) -> str:
        return "qwen3_moe" if m.qk_norm else "mixtral"

    def check_exportable(self, m, kind: str) -> None:
        super().check_exportable(m, kind)
        moe = m.moe
        check_routing(moe, self.architectures[kind])
        if kind == "mixtral" and moe.first_dense_layers:
            raise export_error(
                "model.moe.first_dense_layers",
                moe.first_dense_layers,
                "Mixtral (the export of an moe model without model.qk_norm) has experts in "
                "every layer",
                "first_dense_layers=0, or model.qk_norm=true (Qwen3-MoE)",
            )
        if kind == "mixtral" and not moe.norm_topk_prob:
            raise export_error(
                "model.moe.norm_topk_prob",
                "false",
                "Mixtral (the export of an moe model without model.qk_norm) renormalises the "
                "top-k weights",
                "norm_topk_prob=true, or model.qk_norm=true (Qwen3-MoE)",
            )

    def export_notes(self, m) -> list[str]:
        if m.moe.capacity_factor is None:
            return []
        return [
            f"model.moe.capacity_factor {m.moe.capacity_factor} not exported: Hugging Face's "
            f"{self.architectures[self.model_type(m)]} runs every token through its experts "
            "(dropless), as kiln does with capacity_factor null"
        ]

    def config_fields(self, m, kind: str) -> dict:
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
            **FULL_ATTENTION,
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

    def expert_count_field(self, hf, kind: str) -> str:
        return _experts_field(hf, kind)

    def section(self, hf, path, kind: str, names=()) -> dict:
        return {
            "family": "moe",
            "moe": _moe_section(hf, path, kind),
            **super().section(hf, path, kind, names),
        }

    def layer_tensors(self, m, kind: str, layer: int) -> list[Tensor]:
        dense = m.moe.first_dense_layers
        stack, j = ("dense_blocks", layer) if layer < dense else ("blocks", layer - dense)
        out = self.attention_tensors(m, layer, stack, j)
        if layer < dense:
            return out + self.mlp_tensors(layer, stack, j)
        module, expert_names = MOE_NAMES[kind]
        prefix = f"model.layers.{layer}.{module}"
        out.append(Tensor(f"{prefix}.gate.weight", (stack, "mlp", "router"), (j,), 1))
        for e in range(m.moe.num_experts):
            for linear, path in zip(expert_names, EXPERT_PATHS):
                out.append(
                    Tensor(f"{prefix}.experts.{e}.{linear}.weight", (stack, *path), (j, e), 1)
                )
        return out

    def describe(self, m) -> str:
        moe = m.moe
        text = f", {moe.num_experts} experts (top {moe.experts_per_token})"
        return text + (f" after {moe.first_dense_layers} dense" if moe.first_dense_layers else "")


def check_routing(moe, name: str) -> None:
    """KilnError naming the field unless Hugging Face's `name` routes as model.moe does: by a
    softmax over every expert, unscaled, without a routing bias or shared experts."""
    if moe.balance == "aux_free":
        raise export_error(
            "model.moe.balance",
            moe.balance,
            f"Hugging Face {name} chooses experts without a routing bias",
            "model.moe.balance=aux_loss",
        )
    routing = (
        ("score", moe.score, "softmax"),
        ("n_group", moe.n_group, 1),
        ("routed_scaling_factor", moe.routed_scaling_factor, 1.0),
    )
    for field, value, plain in routing:
        if value != plain:
            raise export_error(
                f"model.moe.{field}",
                value,
                f"Hugging Face {name} routes by a softmax over every expert, unscaled",
                f"model.moe.{field}={plain}",
            )
    if moe.num_shared_experts:
        raise export_error(
            "model.moe.num_shared_experts",
            moe.num_shared_experts,
            f"Hugging Face {name} has no shared experts",
            "model.moe.num_shared_experts=0",
        )


def _moe_section(hf, path, kind: str) -> dict:
    """kiln's model.moe from a Qwen3-MoE or Mixtral config.json (defaults as transformers')."""
    common = {
        "experts_per_token": require(hf, "num_experts_per_tok", path),
        # The same weight; kiln's term is per layer, summed (docs/interop.md).
        "load_balance_loss": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    if kind == "mixtral":
        if hf.get("sliding_window") is not None:
            raise unsupported(path, "sliding_window", hf["sliding_window"], "null (full attention)")
        if hf.get("router_jitter_noise", 0.0):
            raise unsupported(
                path,
                "router_jitter_noise",
                hf["router_jitter_noise"],
                "0 (kiln's router has no noise)",
            )
        return {
            "num_experts": require(hf, "num_local_experts", path),
            "d_ff_expert": require(hf, "intermediate_size", path),
            "norm_topk_prob": True,
            **common,
        }
    experts = hf.get(_experts_field(hf, kind))
    if experts is None:
        require(hf, "num_experts", path)
    layers = require(hf, "num_hidden_layers", path)
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
        "d_ff_expert": require(hf, "moe_intermediate_size", path),
        "first_dense_layers": len(dense),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        **common,
    }


def _experts_field(hf, kind: str) -> str:
    """The config.json field of the routed experts per layer: Mixtral's num_local_experts;
    for Qwen3-MoE num_experts (the Hub's files, transformers 4), else num_local_experts
    (transformers 5 writes both)."""
    if kind == "qwen3_moe" and hf.get("num_experts") is not None:
        return "num_experts"
    return "num_local_experts"


def _dense_layers(hf, path, layers: int, experts) -> list[int]:
    """Layers of a Qwen3-MoE with a dense MLP, as transformers' Qwen3MoeDecoderLayer picks them."""
    only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    if type(step) is not int or step < 1:
        raise unsupported(path, "decoder_sparse_step", step, "a positive integer")
    return [i for i in range(layers) if i in only or not experts or (i + 1) % step]
