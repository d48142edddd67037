"""The `moe` family: llama's blocks with the MLP replaced by routed experts (Mixture-of-Experts).

Each token's router (float32) picks its top-k experts; the token runs through exactly those
experts' SwiGLU MLPs, weighted by their gates (its router probabilities), plus the shared experts
if any. Dropless by default: the assignments are grouped by expert and run through grouped
matmuls (`jax.lax.ragged_dot` on TPU/GPU, equal-size blocks on CPU), so no token is dropped and no
capacity padding is multiplied. On a mesh the experts are split over the `experts` rule's mesh
axis (`expert`); inside `shard_map` each device sends its assignments to the devices holding
their experts by all-to-all, runs its own experts, and sends the outputs back.

Modules, bottom to top: `routing` (`route`: the router), `layout` (where each assignment goes:
the sort by expert, groups padded to blocks), `grouped` (the grouped matmuls), `experts`
(`expert_outputs`: the assignments through their experts, here or across the expert axis),
`layer` (`MoeMlp`, `routed`: the layer in `shard_map`; `MoeBlock`), `model` (`MoeTransformer`),
`hf` (Qwen3-MoE and Mixtral). Config: model.moe.

Einsum letters as in `kiln.model.llama`, plus E experts, K experts per token, T tokens (B*S
flattened), A assignments (T*K), R rows of a grouped matmul, N blocks of rows, b rows per
block, F d_ff_expert.
"""

from kiln.model.moe.experts import capacity, expert_outputs, receive_rows
from kiln.model.moe.grouped import (
    GROUPED_MATMULS,
    ExpertWeights,
    blocked_rows,
    grouped_matmul,
    ragged_rows,
    swiglu,
)
from kiln.model.moe.hf import EXPERT_PATHS, MoeHF, check_routing
from kiln.model.moe.layer import MoeBlock, MoeMlp, routed
from kiln.model.moe.layout import block_layout, expert_layout, sort_by_expert
from kiln.model.moe.model import MoeTransformer
from kiln.model.moe.routing import route

__all__ = [
    "EXPERT_PATHS",
    "GROUPED_MATMULS",
    "ExpertWeights",
    "MoeBlock",
    "MoeHF",
    "MoeMlp",
    "MoeTransformer",
    "block_layout",
    "blocked_rows",
    "capacity",
    "check_routing",
    "expert_layout",
    "expert_outputs",
    "grouped_matmul",
    "ragged_rows",
    "receive_rows",
    "route",
    "routed",
    "sort_by_expert",
    "swiglu",
]
