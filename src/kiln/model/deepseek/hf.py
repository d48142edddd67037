"""Hugging Face's DeepSeek-V3 (`DeepseekV3ForCausalLM`) for the `deepseek` family.

Layers 0..first_k_dense_replace-1 are kiln's `dense_blocks`, the rest its `blocks`; latent
attention maps projection for projection (q_proj or q_a_proj/q_a_layernorm/q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), routers to `mlp.gate` with the
aux-free bias as `e_score_correction_bias`, experts to `mlp.experts.{e}`, the shared experts
to `mlp.shared_experts`. DeepSeek pairs rotary columns 2i and 2i+1 (rope_interleave: true);
kiln pairs i and i + P/2, so the rotary columns of the query and latent projections are
permuted on import and back on export (attention scores are unchanged: the same
permutation on queries and keys).

The multi-token prediction modules are stored as DeepSeek's own checkpoints store them:
as layers num_layers.. with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and a routed
block, plus copies of the embedding and the LM head (`embed_tokens`, `shared_head.head`).
transformers' DeepseekV3ForCausalLM does not run them and ignores those tensors on load;
DeepSeek's inference engines read them. An import keeps them when the checkpoint has them
(else it imports the decoder alone, with mtp_num_layers 0).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kiln.model.hf import HFFormat, Tensor, export_error, require, unsupported
from kiln.model.llama import ATTENTION_TENSORS, MLP_TENSORS
from kiln.model.moe import EXPERT_PATHS

_NORMS = ATTENTION_TENSORS[4:]  # input_layernorm, post_attention_layernorm
_SHARED = tuple(
    (f"mlp.shared_experts.{name[4:]}", ("mlp", "shared", path[1]), n)
    for name, path, n in MLP_TENSORS
)
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)


def interleaved(first: int, pairs: int) -> tuple[int, ...]:
    """Kiln's order of a last axis whose columns first.. are DeepSeek's rotary pairs (2i,
    2i+1): the leading columns, then the pairs' first members, then their second."""
    rotary = np.arange(2 * pairs).reshape(pairs, 2).T.reshape(-1) + first
    return (*range(first), *rotary.tolist())


class DeepseekHF(HFFormat):
    """DeepSeek-V3: sigmoid group-limited routing with a correction bias, shared experts,
    first_k_dense_replace dense layers, latent attention, multi-token prediction modules."""

    architectures: ClassVar[dict[str, str]] = {"deepseek_v3": "DeepseekV3ForCausalLM"}

    def model_type(self, m) -> str:
        return "deepseek_v3"

    def check_exportable(self, m, kind: str) -> None:
        super().check_exportable(m, kind)
        moe = m.moe
        if moe.score != "sigmoid":
            raise export_error(
                "model.moe.score",
                moe.score,
                "Hugging Face DeepseekV3ForCausalLM scores experts by a sigmoid",
                "model.moe.score=sigmoid",
            )
        if m.num_layers <= moe.first_dense_layers:
            raise export_error(
                "model.moe.first_dense_layers",
                moe.first_dense_layers,
                "DeepSeek-V3 routes in every layer after them",
                "fewer dense layers than model.num_layers",
            )

    def export_notes(self, m) -> list[str]:
        notes = []
        if m.moe.balance != "aux_free":
            notes.append(
                "e_score_correction_bias not written (model.moe.balance is aux_loss): "
                "transformers initialises it to zeros, which is kiln's routing without a bias"
            )
        if m.moe.capacity_factor is not None:
            notes.append(
                f"model.moe.capacity_factor {m.moe.capacity_factor} not exported: Hugging "
                "Face's DeepseekV3ForCausalLM is dropless"
            )
        return notes

    def config_fields(self, m, kind: str) -> dict:
        moe, ds = m.moe, m.deepseek
        rope = {"rope_type": "default", "rope_theta": m.rope_theta}
        if ds.yarn is not None:
            rope = {"rope_type": "yarn", "rope_theta": m.rope_theta, **ds.yarn.model_dump()}
        return {
            "intermediate_size": m.d_ff,
            "moe_intermediate_size": moe.d_ff_expert,
            "n_routed_experts": moe.num_experts,
            "n_shared_experts": moe.num_shared_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "routed_scaling_factor": moe.routed_scaling_factor,
            "norm_topk_prob": moe.norm_topk_prob,
            "first_k_dense_replace": moe.first_dense_layers,
            "q_lora_rank": ds.q_lora_rank,
            "kv_lora_rank": ds.kv_lora_rank,
            "qk_nope_head_dim": ds.qk_nope_head_dim,
            "qk_rope_head_dim": ds.qk_rope_head_dim,
            "v_head_dim": ds.v_head_dim,
            "head_dim": ds.qk_rope_head_dim,  # transformers' name for the rotary width
            "num_key_value_heads": m.num_heads,
            "rope_interleave": True,
            "rope_scaling": None if ds.yarn is None else rope,
            "rope_parameters": rope,
            "num_nextn_predict_layers": ds.mtp_num_layers,
            "attention_bias": False,
        }

    def expert_count_field(self, hf, kind: str) -> str:
        return "n_routed_experts"

    def check_import(self, hf, path, kind: str) -> None:
        if not hf.get("rope_interleave", True):
            raise unsupported(
                path, "rope_interleave", hf["rope_interleave"], "true (DeepSeek's layout)"
            )
        if hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise unsupported(path, "topk_method", hf["topk_method"], "'noaux_tc' (DeepSeek-V3's)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise unsupported(path, "scoring_func", hf["scoring_func"], "'sigmoid'")

    def common_view(self, hf, path):
        # Latent attention's head widths and the rotary scaling (YaRN) are read by `section`;
        # num_key_value_heads means nothing to latent attention (every head reads the latent;
        # transformers ignores it too); intermediate_size is the dense layers' width.
        skip = ("rope_scaling", "rope_parameters", "head_dim", "num_key_value_heads")
        theta = _rope_fields(hf)[0]
        return {**{k: v for k, v in hf.items() if k not in skip}, "rope_theta": theta}

    def section(self, hf, path, kind: str, names=()) -> dict:
        _, rope, field = _rope_fields(hf)
        layers = require(hf, "num_hidden_layers", path)
        mtp = int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0)
        if mtp and f"model.layers.{layers}.eh_proj.weight" not in names:
            mtp = 0  # transformers' saves carry the field but not the modules
        return {
            "family": "deepseek",
            "num_kv_heads": None,
            "head_dim": None,
            "rope_scaling": None,
            "moe": {
                "num_experts": require(hf, "n_routed_experts", path),
                "experts_per_token": require(hf, "num_experts_per_tok", path),
                "d_ff_expert": require(hf, "moe_intermediate_size", path),
                "num_shared_experts": hf.get("n_shared_experts") or 0,
                "first_dense_layers": hf.get("first_k_dense_replace", 0),
                "score": "sigmoid",
                "n_group": hf.get("n_group") or 1,
                "topk_group": hf.get("topk_group") or 1,
                "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
                "balance": "aux_free",
                "load_balance_loss": 0.0,
            },
            "deepseek": {
                "q_lora_rank": hf.get("q_lora_rank"),
                "kv_lora_rank": require(hf, "kv_lora_rank", path),
                "qk_nope_head_dim": require(hf, "qk_nope_head_dim", path),
                "qk_rope_head_dim": require(hf, "qk_rope_head_dim", path),
                "v_head_dim": require(hf, "v_head_dim", path),
                "yarn": _yarn(rope, field, hf, path),
                "mtp_num_layers": mtp,
            },
        }

    def _attention(self, m, prefix: str, stack: str, j: int) -> list[Tensor]:
        ds = m.deepseek
        a, p, r = ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.kv_lora_rank
        q_order = interleaved(a, p // 2)
        at = lambda *path: (stack, "attn", *path)  # noqa: E731
        if ds.q_lora_rank is None:
            q = [Tensor(f"{prefix}.self_attn.q_proj.weight", at("wq"), (j,), 1, q_order)]
        else:
            q = [
                Tensor(f"{prefix}.self_attn.q_a_proj.weight", at("wq_a"), (j,), 1),
                Tensor(
                    f"{prefix}.self_attn.q_a_layernorm.weight", at("q_norm", "scale"), (j,), None
                ),
                Tensor(f"{prefix}.self_attn.q_b_proj.weight", at("wq_b"), (j,), 1, q_order),
            ]
        kv = [
            Tensor(
                f"{prefix}.self_attn.kv_a_proj_with_mqa.weight",
                at("wkv_a"),
                (j,),
                1,
                interleaved(r, p // 2),
            ),
            Tensor(f"{prefix}.self_attn.kv_a_layernorm.weight", at("kv_norm", "scale"), (j,), None),
            Tensor(f"{prefix}.self_attn.kv_b_proj.weight", at("wkv_b"), (j,), 1),
            Tensor(f"{prefix}.self_attn.o_proj.weight", at("wo"), (j,), 2),
        ]
        norms = [Tensor(f"{prefix}.{name}", (stack, *path), (j,), n) for name, path, n in _NORMS]
        return q + kv + norms

    def _routed(self, m, prefix: str, stack: tuple[str, ...], j: int) -> list[Tensor]:
        out = [Tensor(f"{prefix}.mlp.gate.weight", (*stack, "mlp", "router"), (j,), 1)]
        if m.moe.balance == "aux_free":
            out.append(
                Tensor(
                    f"{prefix}.mlp.gate.e_score_correction_bias",
                    (*stack, "mlp", "bias"),
                    (j,),
                    None,
                )
            )
        for e in range(m.moe.num_experts):
            for linear, path in zip(("gate_proj", "up_proj", "down_proj"), EXPERT_PATHS):
                out.append(
                    Tensor(f"{prefix}.mlp.experts.{e}.{linear}.weight", (*stack, *path), (j, e), 1)
                )
        if m.moe.num_shared_experts:
            out += [
                Tensor(f"{prefix}.{name}", (*stack, *path), (j,), n) for name, path, n in _SHARED
            ]
        return out

    def layer_tensors(self, m, kind: str, layer: int) -> list[Tensor]:
        dense = m.moe.first_dense_layers
        stack, j = ("dense_blocks", layer) if layer < dense else ("blocks", layer - dense)
        prefix = f"model.layers.{layer}"
        out = self._attention(m, prefix, stack, j)
        if layer < dense:
            return out + [
                Tensor(f"{prefix}.{name}", (stack, *path), (j,), n) for name, path, n in MLP_TENSORS
            ]
        return out + self._routed(m, prefix, (stack,), j)

    def extra_tensors(self, m, kind: str) -> list[Tensor]:
        out = []
        for d in range(m.deepseek.mtp_num_layers):
            prefix = f"model.layers.{m.num_layers + d}"
            block = self._attention(m, prefix, "block", d)
            out += [t._replace(path=("mtp", *t.path)) for t in block]
            out += self._routed(m, prefix, ("mtp", "block"), d)
            own = (
                ("enorm.weight", ("embed_norm", "scale"), None),
                ("hnorm.weight", ("hidden_norm", "scale"), None),
                ("eh_proj.weight", ("proj",), 1),
                ("shared_head.norm.weight", ("final_norm", "scale"), None),
            )
            out += [Tensor(f"{prefix}.{name}", ("mtp", *path), (d,), n) for name, path, n in own]
        return out

    def copies(self, m, kind: str) -> list[Tensor]:
        head = ("embedding",) if m.tie_embeddings else ("lm_head",)
        out = []
        for d in range(m.deepseek.mtp_num_layers):
            prefix = f"model.layers.{m.num_layers + d}"
            out.append(Tensor(f"{prefix}.embed_tokens.weight", ("embedding",), (), None))
            out.append(
                Tensor(
                    f"{prefix}.shared_head.head.weight", head, (), None if m.tie_embeddings else 1
                )
            )
        return out

    def describe(self, m) -> str:
        moe, ds = m.moe, m.deepseek
        text = f", {moe.num_experts} experts (top {moe.experts_per_token})"
        text += f" after {moe.first_dense_layers} dense" if moe.first_dense_layers else ""
        text += f", latent attention (kv_lora_rank {ds.kv_lora_rank})"
        return text + (f", {ds.mtp_num_layers} MTP modules" if ds.mtp_num_layers else "")


def _rope_fields(hf) -> tuple[float, dict, str]:
    """(rope_theta, the rotary settings, the field they came from) as transformers reads them."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    found = dict(hf.get(field) or {})
    theta = found.pop("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), found, field


def _yarn(found: dict, field: str, hf, path) -> dict | None:
    """kiln's model.deepseek.yarn from config.json's rotary settings (None: plain rotary)."""
    kind = found.pop("rope_type", found.pop("type", "default"))
    allowed = "rope_type 'default' or 'yarn' (" + ", ".join(YARN_KEYS) + ")"
    if kind == "default" and not found:
        return None
    if kind != "yarn" or found.get("factor") is None or found.get("attention_factor") is not None:
        raise unsupported(path, field, hf[field], allowed)
    if not found.pop("truncate", True):
        raise unsupported(path, f"{field}.truncate", False, "true (the ramp's ends rounded)")
    found.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    extra = set(found) - set(YARN_KEYS)
    if extra:
        raise unsupported(path, field, hf[field], allowed)
    # transformers' defaults: without mscale and mscale_all_dim, cos and sin are scaled by
    # mscale(factor) and the softmax is not (kiln's 0 = not given).
    yarn = {k: found[k] for k in YARN_KEYS if found.get(k) is not None}
    return {"mscale": 0.0, "mscale_all_dim": 0.0, **yarn}


__all__ = ["DeepseekHF"]
