"""Tensor names and layouts: kiln's parameters <-> a Hugging Face state dict.

kiln's `llama` family is the Llama architecture: pre-norm RMSNorm blocks, grouped-query
attention, SwiGLU, rotary embeddings. Both use the rotate-half rotary layout (HF's
`rotate_half`, same frequencies), so q/k projections map without the head-dim permutation
that HF's conversion script applies to Meta's interleaved checkpoints; tests/test_hf.py
checks this on logits.

Layouts (kiln -> HF, where HF's Linear weight is [out, in]): wq [D,N,H] -> q_proj [N*H, D],
wk/wv [D,K,H] -> [K*H, D], wo [N,H,D] -> o_proj [D, N*H], w_gate/w_up [D,F] -> [F, D],
w_down [F,D] -> [D, F], lm_head [D,V] -> [V, D]; embedding [V,D] and norm scales as they are.
The `moe` family (Qwen3-MoE, Mixtral) stacks its first_dense_layers in `dense_blocks` and the
MoE layers in `blocks`, whose router [D,E] -> gate.weight [E, D] and expert e's slice of
w_gate/w_up [E,D,F] and w_down [E,F,D] -> that expert's own Linear weights, as above.
Conversion is a reshape and a transpose, so values are copied bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from flax import nnx

from kiln.commands.hf_config import ARCHITECTURES, MOE_TYPES, model_type
from kiln.errors import KilnError
from kiln.model import abstract_state

# (HF name inside layer i, kiln path inside its stack, how many leading kiln dims are HF's input
# dims; None = a vector, same layout).
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
# An MoE layer's module, and its experts' (gate, up, down) Linear names, per HF model_type.
MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
EXPERT_PATHS = (("mlp", "w_gate"), ("mlp", "w_up"), ("mlp", "w_down"))
TOP_TENSORS = (
    ("model.embed_tokens.weight", ("embedding",), None),
    ("model.norm.weight", ("final_norm", "scale"), None),
    ("lm_head.weight", ("lm_head",), 1),
)
# Buffers some older checkpoints store next to the weights; recomputed by every loader.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Tensor(NamedTuple):
    """One HF tensor: kiln's array at `path`, indexed by `index` (layer in its stack, expert)."""

    name: str
    path: tuple[str, ...]
    index: tuple[int, ...]
    n_in: int | None


def _hf_shape(kiln_shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    if n_in is None:
        return kiln_shape
    return (math.prod(kiln_shape[n_in:]), math.prod(kiln_shape[:n_in]))


def _to_hf(x: np.ndarray, n_in: int | None) -> np.ndarray:
    if n_in is None:
        return np.ascontiguousarray(x)
    return np.ascontiguousarray(x.reshape(math.prod(x.shape[:n_in]), -1).T)


def _from_hf(w: np.ndarray, kiln_shape: tuple[int, ...], n_in: int | None) -> np.ndarray:
    return w if n_in is None else np.ascontiguousarray(w.T.reshape(kiln_shape))


def _get(tree: Mapping[str, Any], path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _tensors(model_cfg) -> list[Tensor]:
    """Every tensor of the model, in order: for each kiln array, its items in index order."""
    m = model_cfg
    kind = model_type(m)
    out = [
        Tensor(name, path, (), n_in)
        for name, path, n_in in TOP_TENSORS
        if not (path == ("lm_head",) and m.tie_embeddings)
    ]
    dense = m.moe.first_dense_layers if kind in MOE_TYPES else m.num_layers
    layer_tensors = ATTENTION_TENSORS + (QK_NORM_TENSORS if m.qk_norm else ())
    for i in range(m.num_layers):
        stack, j = ("blocks", i) if kind not in MOE_TYPES else _moe_stack(i, dense)
        for name, path, n_in in layer_tensors + (MLP_TENSORS if i < dense else ()):
            out.append(Tensor(f"model.layers.{i}.{name}", (stack, *path), (j,), n_in))
        if i >= dense:
            module, expert_names = MOE_NAMES[kind]
            prefix = f"model.layers.{i}.{module}"
            out.append(Tensor(f"{prefix}.gate.weight", (stack, "mlp", "router"), (j,), 1))
            for e in range(m.moe.num_experts):
                for linear, path in zip(expert_names, EXPERT_PATHS):
                    name = f"{prefix}.experts.{e}.{linear}.weight"
                    out.append(Tensor(name, (stack, *path), (j, e), 1))
    return out


def _moe_stack(layer: int, dense: int) -> tuple[str, int]:
    """(kiln stack, index in it) of a layer of an moe model."""
    return ("dense_blocks", layer) if layer < dense else ("blocks", layer - dense)


def kiln_to_hf(model_cfg, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """HF state dict (numpy) from kiln's pure parameter dict (stacked blocks)."""
    return {
        t.name: _to_hf(np.asarray(_get(params, t.path))[t.index], t.n_in)
        for t in _tensors(model_cfg)
    }


def hf_to_kiln(model_cfg, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """kiln's pure parameter dict from an HF state dict; KilnError naming a bad tensor."""
    shapes = _shapes(nnx.to_pure_dict(abstract_state(model_cfg)))
    expected = _tensors(model_cfg)
    names = {t.name for t in expected}
    if model_cfg.tie_embeddings:
        names.add("lm_head.weight")  # stored by some tied checkpoints; HF ignores it too
    unexpected = sorted(n for n in tensors if n not in names and not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise KilnError(
            f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); the "
            f"{ARCHITECTURES[model_type(model_cfg)]} config.json describes has no such tensor "
            "(kiln holds no biases)"
        )
    items: dict[tuple[str, ...], list[np.ndarray]] = {}
    for t in expected:
        full = _get(shapes, t.path)
        shape = full[len(t.index) :]
        hf_shape = _hf_shape(shape, t.n_in)
        if t.name not in tensors:
            raise KilnError(f"missing tensor {t.name!r} (expected shape {list(hf_shape)})")
        w = tensors[t.name]
        if tuple(w.shape) != hf_shape:
            raise KilnError(
                f"tensor {t.name!r} has shape {list(w.shape)}, but config.json implies "
                f"{list(hf_shape)}"
            )
        items.setdefault(t.path, []).append(_from_hf(w, shape, t.n_in))
    out: dict[str, Any] = {}
    for path, arrays in items.items():
        # One array per index, in index order: stacked, they are kiln's array.
        _set(out, path, np.stack(arrays).reshape(_get(shapes, path)))
    return out


def _shapes(tree):
    if isinstance(tree, Mapping):
        return {k: _shapes(v) for k, v in tree.items()}
    return tuple(tree.shape)
