"""The `moe` family: llama's blocks with the MLP replaced by routed experts (Mixture-of-Experts).

Each token's router (float32) picks its top-k experts; the token runs through exactly those
experts' SwiGLU MLPs, weighted by their router probabilities, plus the shared experts if any.
Dropless by default: the assignments are grouped by expert and run through grouped matmuls
(`jax.lax.ragged_dot` on TPU/GPU, equal-size blocks on CPU), so no token is dropped and no
capacity padding is multiplied. On a mesh the experts are split over the `experts` rule's mesh
axis (`expert`); inside `shard_map` each device sends its assignments to the devices holding
their experts by all-to-all, runs its own experts, and sends the outputs back.

Einsum letters as in `kiln.model.llama`, plus E experts, K experts per token, T tokens (B*S
flattened), A assignments (T*K), R rows of a grouped matmul, N blocks of rows, b rows per
block, F d_ff_expert.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from kiln.config import ModelConfig
from kiln.config.axes import entry_axes
from kiln.errors import KilnError
from kiln.model.hf import Tensor, export_error, require, unsupported
from kiln.model.interface import DTYPES
from kiln.model.llama import (
    FULL_ATTENTION,
    Block,
    LlamaHF,
    Mlp,
    Transformer,
    _join,
    _param,
    stacked_blocks,
)
from kiln.model.project import current_reduce_dtype
from kiln.parallel.exchange import Plan, ragged_exchange, take_copies, take_rows
from kiln.parallel.mesh import current_rules, logical_spec, traced_platform

# Largest block of rows the blocked grouped matmul multiplies by one expert's weights.
BLOCK_ROWS = 128
# What `model.moe.grouped_matmul: auto` runs per platform.
AUTO_GROUPED = {"tpu": "ragged_dot", "gpu": "blocked", "cpu": "blocked"}
# Platforms whose XLA backend runs a ragged all-to-all (CPU: a dense one of padded chunks).
NATIVE_RAGGED = ("tpu", "gpu")
# An expert weight's logical names: [experts, in, out].
_EXPERT_IN = ("experts", "embed", "mlp")
_EXPERT_OUT = ("experts", "mlp", "embed")


# ---------------------------------------------------------------------------------------------
# Routing


def route(x_BSD, router_DE, bias_E, moe, router_bias_E=None):
    """(experts [B,S,K] int32, weights [B,S,K], probabilities [B,S,E], logits [B,S,E]), float32.

    logits = x W_router, plus `router_bias_E` (a learned bias, GPT-OSS's) when given; scores =
    softmax(logits), or sigmoid(logits) with `moe.score: sigmoid`; the top
    `moe.experts_per_token` of scores + bias choose the experts (`bias_E` None = no bias),
    within the `moe.topk_group` best of `moe.n_group` groups (a group's worth: the sum of its
    two best biased scores), and the unbiased scores of the chosen ones weight them, divided by
    their sum if `moe.norm_topk_prob`, times `moe.routed_scaling_factor`. probabilities: the scores (sigmoid
    ones normalised over the experts), for the load-balance loss.
    """
    logits_BSE = jnp.einsum("BSD,DE->BSE", x_BSD.astype(jnp.float32), router_DE.astype(jnp.float32))
    if router_bias_E is not None:
        logits_BSE = logits_BSE + router_bias_E.astype(jnp.float32)
    sigmoid = moe.score == "sigmoid"
    if sigmoid:
        scores_BSE = jax.nn.sigmoid(logits_BSE)
        probs_BSE = scores_BSE / jnp.sum(scores_BSE, axis=-1, keepdims=True)
    else:
        scores_BSE = probs_BSE = jax.nn.softmax(logits_BSE, axis=-1)
    choice_BSE = scores_BSE if bias_E is None else scores_BSE + jax.lax.stop_gradient(bias_E)
    if moe.n_group > 1:
        choice_BSE = _group_limited(jax.lax.stop_gradient(choice_BSE), moe.n_group, moe.topk_group)
    _, experts_BSK = jax.lax.top_k(choice_BSE, moe.experts_per_token)
    weights_BSK = jnp.take_along_axis(scores_BSE, experts_BSK, axis=-1)
    if moe.norm_topk_prob:
        total_BS1 = jnp.sum(weights_BSK, axis=-1, keepdims=True)
        weights_BSK = weights_BSK / (total_BS1 + 1e-20 if sigmoid else total_BS1)
    if moe.routed_scaling_factor != 1.0:
        weights_BSK = weights_BSK * moe.routed_scaling_factor
    return experts_BSK.astype(jnp.int32), weights_BSK, probs_BSE, logits_BSE


def _group_limited(choice_BSE, n_group: int, topk_group: int):
    """The choice scores with every expert outside each token's `topk_group` best groups at
    -inf; a group's worth is the sum of its two best scores (DeepSeek-V3)."""
    b, s, e = choice_BSE.shape
    grouped_BSGe = choice_BSE.reshape(b, s, n_group, e // n_group)
    best = jax.lax.top_k(grouped_BSGe, min(2, e // n_group))[0]
    _, groups_BSk = jax.lax.top_k(jnp.sum(best, axis=-1), topk_group)
    keep_BSG = jnp.sum(jax.nn.one_hot(groups_BSk, n_group, dtype=jnp.bool_), axis=2) > 0
    keep_BSE = jnp.repeat(keep_BSG, e // n_group, axis=-1)
    return jnp.where(keep_BSE, choice_BSE, -jnp.inf)


def _group_of(ends, i):
    """The group of each index in `i`, for groups of consecutive indices whose exclusive ends
    are `ends` [G] (cumulative sizes; an empty group is never chosen); G past the last."""
    # A few groups: on CPU comparing with each end compiles and runs faster than a scan loop;
    # the TPU compiler takes longer over the comparisons (measured on the Qwen3-30B-A3B step).
    method = "compare_all" if traced_platform() == "cpu" else "scan"
    return jnp.searchsorted(ends, i, side="right", method=method).astype(jnp.int32)


class Sorted(NamedTuple):
    """Assignments sorted by expert (`sort_by_expert`): order_A the stable sort, start_E1 each
    expert's first sorted position (and the end), count_E the assignments of each expert and
    kept_E those it keeps."""

    order_A: jax.Array
    start_E1: jax.Array
    count_E: jax.Array
    kept_E: jax.Array

    def ranks(self, e_A):
        """(e_As each assignment's expert clipped to a real one, rank_A its rank among its
        expert's assignments, kept_A whether its expert keeps it). The sort's inverse is an
        integer scatter, outside the gradient."""
        a, num_experts = e_A.shape[0], self.kept_E.shape[0]
        c = jnp.arange(a, dtype=jnp.int32)
        pos_A = jnp.zeros((a,), jnp.int32).at[self.order_A].set(c, unique_indices=True)
        e_As = jnp.minimum(e_A, num_experts - 1)
        rank_A = pos_A - self.start_E1[e_As]
        return e_As, rank_A, (e_A < num_experts) & (rank_A < self.kept_E[e_As])


def sort_by_expert(e_A, num_experts: int, cap: int | None) -> Sorted:
    """The layer's one sort. e_A [A] int32: each assignment's expert, `num_experts` for none
    (padding); an expert keeps its first `cap` assignments in the order of e_A (all when cap
    is None)."""
    order_A = jnp.argsort(e_A, stable=True)
    bounds = jnp.arange(num_experts + 1, dtype=e_A.dtype)
    start_E1 = jnp.searchsorted(e_A[order_A], bounds, side="left").astype(jnp.int32)
    count_E = start_E1[1:] - start_E1[:-1]
    kept_E = count_E if cap is None else jnp.minimum(count_E, cap)
    return Sorted(order_A, start_E1, count_E, kept_E)


def expert_layout(e_A, num_experts: int, cap: int | None):
    """The assignments grouped by expert, each expert's in the order of e_A (one sort,
    `sort_by_expert`). Returns (src_C, slot_A, kept_E, dropped): slot c of the grouped layout
    holds assignment src_C[c] (A for the slots past the kept rows), slot_A is the inverse (A
    for an assignment not kept), kept_E the rows per expert and `dropped` the real
    assignments past a capacity.
    """
    a = e_A.shape[0]
    sort = sort_by_expert(e_A, num_experts, cap)
    kend_E = jnp.cumsum(sort.kept_E)
    kstart_E = kend_E - sort.kept_E
    c = jnp.arange(a, dtype=jnp.int32)
    e_C = _group_of(kend_E, c)
    e_Cs = jnp.minimum(e_C, num_experts - 1)
    first = sort.order_A[jnp.minimum(sort.start_E1[e_Cs] + c - kstart_E[e_Cs], a - 1)]
    src_C = jnp.where(e_C < num_experts, first, a)
    e_As, rank_A, kept_A = sort.ranks(e_A)
    slot_A = jnp.where(kept_A, kstart_E[e_As] + rank_A, a)
    return src_C, slot_A, sort.kept_E, jnp.sum(sort.count_E - sort.kept_E)


# ---------------------------------------------------------------------------------------------
# Grouped matmuls: rows grouped by expert (sizes_E rows each, the rest unused) through their
# experts' gated MLPs, act(x W_gate + b_gate, x W_up + b_up) W_down + b_down: the biases
# (`biases` = b_gate [E,F], b_up [E,F], b_down [E,D]) only when given, act SwiGLU's by default.


class ExpertWeights(NamedTuple):
    """The routed experts' parameters, [E, ...] each: the gate and up projections [E,D,F],
    the down projection [E,F,D], and their biases [E,F], [E,F], [E,D] (None: no biases)."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def ragged_rows(xs_RD, sizes_E, w_gate, w_up, w_down, *, biases=None, act=_swiglu):
    """`jax.lax.ragged_dot` over the groups: the grouped matmul TPU runs natively (its compiled
    HLO has ragged-dot kernels, `benchmarks/moe.py --tpu-topology`). Rows past the groups are
    never read."""
    gate = jax.lax.ragged_dot(xs_RD, w_gate, sizes_E)
    up = jax.lax.ragged_dot(xs_RD, w_up, sizes_E)
    if biases is not None:  # each row's expert's
        r = jnp.arange(xs_RD.shape[0], dtype=jnp.int32)
        e_R = jnp.minimum(_group_of(jnp.cumsum(sizes_E), r), sizes_E.shape[0] - 1)
        gate, up = gate + biases[0][e_R], up + biases[1][e_R]
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    ys_RD = jax.lax.ragged_dot(act(gate, up), w_down, sizes_E)
    return ys_RD if biases is None else ys_RD + biases[2][e_R]


def _block_rows(rows: int, num_experts: int) -> int:
    """The default block: a power of two near a quarter of an expert's even share of `rows`,
    8 to BLOCK_ROWS, which keeps the padding near 1/8 of the rows."""
    per_expert = max(1, rows // (4 * num_experts))
    return max(8, min(BLOCK_ROWS, 1 << (per_expert.bit_length() - 1)))


class _Padded(NamedTuple):
    """Groups of sizes_E rows padded to whole blocks (`_padded`): `blocks` of `block` slots,
    group e's slots from pstart_E[e]; slot u's group e_Us[u] (clipped to a real one), its
    place q_U[u] in it, whether it holds a row (filled_U); each block's group expert_N."""

    block: int
    blocks: int
    pstart_E: jax.Array
    e_Us: jax.Array
    q_U: jax.Array
    filled_U: jax.Array
    expert_N: jax.Array


def _padded(sizes_E, rows: int, block: int) -> _Padded:
    """The block layout of groups of `sizes_E` rows (of `rows`): enough blocks of `block` slots
    for any split of the rows, each group padded to whole blocks."""
    num_experts = sizes_E.shape[0]
    blocks = -(-(rows + num_experts * (block - 1)) // block)
    padded_E = -(-sizes_E // block) * block
    pend_E = jnp.cumsum(padded_E)
    pstart_E = pend_E - padded_E
    u = jnp.arange(blocks * block, dtype=jnp.int32)
    e_U = _group_of(pend_E, u)
    e_Us = jnp.minimum(e_U, num_experts - 1)
    q_U = u - pstart_E[e_Us]
    filled_U = (e_U < num_experts) & (q_U < sizes_E[e_Us])
    expert_N = jnp.minimum(_group_of(pend_E, u[::block]), num_experts - 1)
    return _Padded(block, blocks, pstart_E, e_Us, q_U, filled_U, expert_N)


def block_layout(sizes_E, rows: int, block: int | None = None):
    """Groups of `sizes_E` rows (of `rows`, grouped by expert) padded to whole blocks of
    `block` rows: (src_U, dst_R, expert_N, block). Block slot u holds grouped row src_U[u]
    (`rows` for padding), grouped row r goes to slot dst_R[r] (past the slots for rows past
    the groups), block n belongs to expert expert_N[n]. The padding is at most
    E * (block - 1) rows (`_block_rows`: the default block)."""
    num_experts = sizes_E.shape[0]
    pad = _padded(sizes_E, rows, block or _block_rows(rows, num_experts))
    gend_E = jnp.cumsum(sizes_E)
    gstart_E = gend_E - sizes_E
    src_U = jnp.where(pad.filled_U, gstart_E[pad.e_Us] + pad.q_U, rows)
    r = jnp.arange(rows, dtype=jnp.int32)
    e_R = _group_of(gend_E, r)
    e_Rs = jnp.minimum(e_R, num_experts - 1)
    slots = pad.blocks * pad.block
    dst_R = jnp.where(e_R < num_experts, pad.pstart_E[e_Rs] + r - gstart_E[e_Rs], slots)
    return src_U, dst_R, pad.expert_N, pad.block


def _blocks(xs_NbD, expert_N, w_gate, w_up, w_down, biases, act):
    """Each block of rows through its expert's weights (batched matmuls)."""
    gate = jnp.einsum("NbD,NDF->NbF", xs_NbD, w_gate[expert_N])
    up = jnp.einsum("NbD,NDF->NbF", xs_NbD, w_up[expert_N])
    if biases is not None:  # each block's expert's
        gate, up = gate + biases[0][expert_N, None], up + biases[1][expert_N, None]
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    ys_NbD = jnp.einsum("NbF,NFD->NbD", act(gate, up), w_down[expert_N])
    return ys_NbD if biases is None else ys_NbD + biases[2][expert_N, None]


def blocked_rows(
    xs_RD, sizes_E, w_gate, w_up, w_down, block: int | None = None, *, biases=None, act=_swiglu
):
    """Each group padded to whole blocks of `block` rows (`block_layout`), each block
    multiplied by its expert's weights (a batched matmul); rows past the groups give 0. Exact.
    XLA's CPU backend has no grouped matmul of its own (it runs `ragged_dot` as E dense
    matmuls over every row). The rows move into and out of the blocks by `take_rows` (gathers
    both ways)."""
    rows, d = xs_RD.shape
    src_U, dst_R, expert_N, block = block_layout(sizes_E, rows, block)
    xs_NbD = take_rows(xs_RD, src_U, dst_R).reshape(-1, block, d)
    ys_NbD = _blocks(xs_NbD, expert_N, w_gate, w_up, w_down, biases, act)
    return take_rows(ys_NbD.reshape(-1, d), dst_R, src_U)


def _run_rows(rows, xs_RD, sizes_E, weights: ExpertWeights):
    """`rows` (a grouped matmul) over the groups with the experts' weights and biases."""
    biases = None if weights.gate_bias is None else weights[3:]
    return rows(xs_RD, sizes_E, *weights[:3], biases=biases)


GROUPED_MATMULS = {"ragged_dot": ragged_rows, "blocked": blocked_rows}


def grouped_matmul(name: str) -> str:
    """The grouped matmul `model.moe.grouped_matmul=name` runs on this platform."""
    return AUTO_GROUPED.get(traced_platform(), "blocked") if name == "auto" else name


# ---------------------------------------------------------------------------------------------
# Dispatch: assignments to experts and back, on one device or across the expert axis


def capacity(tokens: int, k: int, num_experts: int, factor: float | None) -> int | None:
    """Assignments one expert takes from `tokens` tokens of one device (None: all, dropless);
    at most `tokens`, as a token picks an expert at most once."""
    if factor is None:
        return None
    return max(1, min(tokens, math.ceil(factor * tokens * k / num_experts)))


def receive_rows(tokens: int, k: int, num_experts: int, shards: int, cap, factor) -> int:
    """Rows of a device's receive buffer under expert parallelism over `shards` devices.

    From one source at most min(T·K, T·E/P) rows arrive (a token picks an expert at most
    once), and with a capacity at most C·E/P; dropless, the buffer holds that from every
    source. `factor` (model.moe.buffer_factor) bounds it to factor · T·K rows (what arrives
    when the load is even, times the factor), a multiple of 8.
    """
    local = num_experts // shards
    per_source = min(tokens * k, tokens * local)
    if cap is not None:
        per_source = min(per_source, cap * local)
    dropless = shards * per_source
    if factor is None:
        return dropless
    return min(dropless, -(-math.ceil(factor * tokens * k) // 8) * 8)


class ExpertAxis(NamedTuple):
    """How the experts are split: over mesh axis `axis`, `rows` the receive buffer,
    `native` the backend's ragged all-to-all (else the dense one, CPU)."""

    axis: str
    rows: int
    native: bool


def dispatch(x_TD, e_TK, real_TK, weights: ExpertWeights, *, rows, num_experts, cap, experts):
    """(outputs [T,K,D] of each assignment, 0 if dropped; the real assignments dropped).

    Token t's j-th choice e_TK[t, j] is assignment a = j·T + t: first choices before second
    ones, then in token order, which is the order an expert's capacity keeps. One sort groups
    them by expert (`expert_layout`). `experts` None: every expert is here (weights [E, ...]).
    Else the experts are split over `experts.axis` and the grouped rows, which are also
    grouped by destination, go to their experts' devices by one ragged all-to-all of their
    real sizes and come back by another (`_expert_parallel`).
    """
    t, k = e_TK.shape
    e_A = jnp.where(real_TK, e_TK, num_experts).T.reshape(-1)
    if experts is None and getattr(rows, "func", rows) is blocked_rows:
        sort = sort_by_expert(e_A, num_experts, cap)
        y_TKD = _blocked_assignments(x_TD, e_A, sort, weights, rows.keywords["act"])
        return y_TKD, jnp.sum(sort.count_E - sort.kept_E)
    src_C, slot_A, kept_E, dropped = expert_layout(e_A, num_experts, cap)
    a = t * k
    x_CD = take_copies(x_TD, jnp.where(src_C < a, src_C % t, t), slot_A.reshape(k, t))
    if experts is None:
        y_CD = _run_rows(rows, x_CD, kept_E, weights)
    else:
        y_CD, lost = _expert_parallel(x_CD, kept_E, weights, rows, experts)
        dropped = dropped + lost
    y_AD = take_rows(y_CD, slot_A, src_C)
    return y_AD.reshape(k, t, -1).transpose(1, 0, 2), dropped


def _blocked_assignments(x_TD, e_A, sort: Sorted, weights: ExpertWeights, act):
    """`blocked_rows` for every expert here, straight from the sort: each expert's kept
    assignments padded to whole blocks, the tokens gathered straight into their blocks and the
    outputs straight back to their assignments (no grouped layout between: one gather each
    way, and one per way in the backward pass). Outputs [T, K, D] (gathered in token order,
    not transposed from the assignments' order): the same numbers as the grouped layout
    through `blocked_rows`."""
    t, d = x_TD.shape
    a, num_experts = e_A.shape[0], sort.kept_E.shape[0]
    pad = _padded(sort.kept_E, a, _block_rows(a, num_experts))
    first = sort.order_A[jnp.minimum(sort.start_E1[pad.e_Us] + pad.q_U, a - 1)]
    assignment_U = jnp.where(pad.filled_U, first, a)
    e_As, rank_A, kept_A = sort.ranks(e_A)
    slot_A = jnp.where(kept_A, pad.pstart_E[e_As] + rank_A, pad.blocks * pad.block)
    token_U = jnp.where(assignment_U < a, assignment_U % t, t)
    xs_NbD = take_copies(x_TD, token_U, slot_A.reshape(-1, t))
    xs_NbD = xs_NbD.reshape(pad.blocks, pad.block, d)
    expert_N = pad.expert_N
    biases = None if weights.gate_bias is None else weights[3:]
    ys_NbD = _blocks(xs_NbD, expert_N, *weights[:3], biases, act)
    k = a // t  # assignment j·T + t is row t·K + j of the output
    slot_TK = slot_A.reshape(k, t).T.reshape(-1)
    row_U = jnp.where(assignment_U < a, (assignment_U % t) * k + assignment_U // t, a)
    return take_rows(ys_NbD.reshape(-1, d), slot_TK, row_U).reshape(t, k, d)


def _expert_parallel(x_CD, kept_E, weights, rows, experts: ExpertAxis):
    """The grouped rows (kept_E per expert, in expert order) through the experts of their
    devices on `experts.axis` and back: (outputs in the same slots, rows the receivers had no
    room for, whose outputs are 0).

    Every device learns every device's rows per expert (a small all-gather), so each knows
    where its chunk lands in each receiver's buffer (after the chunks of the devices before
    it) and how much of it fits. The receiver places the rows, which arrive grouped by source
    and then by expert, grouped by expert without sorting: each row's place follows from the
    counts.
    """
    axis, buffer, native = experts
    shards, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    num_experts = kept_E.shape[0]
    local = num_experts // shards
    counts_PE = jax.lax.all_gather(kept_E, axis)  # rows each device sends to each expert
    n_PP = counts_PE.reshape(shards, shards, local).sum(-1)  # [source, destination]
    landing_PP = jnp.cumsum(n_PP, axis=0) - n_PP  # the source's chunk in the receiver's buffer
    taken_PP = jnp.clip(buffer - landing_PP, 0, n_PP)  # the rows of it that fit
    start_PP = jnp.cumsum(n_PP, axis=1) - n_PP  # the chunk in the source's grouped rows
    plan = Plan(
        start_PP[me],
        taken_PP[me],
        landing_PP[me],
        taken_PP[:, me],
        start_PP[:, me],
        landing_PP[:, me],
    )
    lost = jnp.sum(n_PP[me] - taken_PP[me])
    recv_MD = ragged_exchange(x_CD, plan, buffer, axis, native)
    # The received rows grouped by local expert: expert l's rows from each source in turn.
    mine_PL = jax.lax.dynamic_slice_in_dim(counts_PE, me * local, local, axis=1)
    before_PL = jnp.cumsum(mine_PL, axis=1) - mine_PL  # expert l's rows within a chunk
    got_PL = jnp.clip(taken_PP[:, me][:, None] - before_PL, 0, mine_PL)  # a chunk's prefix
    sizes_L = jnp.sum(got_PL, axis=0)
    gend_L = jnp.cumsum(sizes_L)
    gstart_L = gend_L - sizes_L
    from_PL = jnp.cumsum(got_PL, axis=0) - got_PL  # source s's rows within expert l's group
    rend_P = jnp.cumsum(taken_PP[:, me])  # chunks are consecutive from row 0
    rstart_P = rend_P - taken_PP[:, me]
    p = jnp.arange(buffer, dtype=jnp.int32)
    # Grouped row p: its expert, its source, and the received row it is.
    l_p = _group_of(gend_L, p)
    l_ps = jnp.minimum(l_p, local - 1)
    q_p = p - gstart_L[l_ps]
    s_p = jnp.minimum(
        jnp.sum(from_PL.T[l_ps] + got_PL.T[l_ps] <= q_p[:, None], axis=-1), shards - 1
    )
    r_p = rstart_P[s_p] + before_PL[s_p, l_ps] + q_p - from_PL[s_p, l_ps]
    recv_of = jnp.where(l_p < local, r_p, buffer)
    # Received row r: its source, its expert, and the grouped row it becomes.
    s_r = _group_of(rend_P, p)
    s_rs = jnp.minimum(s_r, shards - 1)
    q_r = p - rstart_P[s_rs]
    l_r = jnp.minimum(jnp.sum((before_PL + mine_PL)[s_rs] <= q_r[:, None], axis=-1), local - 1)
    group_of = jnp.where(
        s_r < shards, gstart_L[l_r] + from_PL[s_rs, l_r] + q_r - before_PL[s_rs, l_r], buffer
    )
    xs_MD = take_rows(recv_MD, recv_of, group_of)
    ys_MD = _run_rows(rows, xs_MD, sizes_L, weights)
    y_MD = take_rows(ys_MD, group_of, recv_of)
    return ragged_exchange(y_MD, plan.reverse(), x_CD.shape[0], axis, native), lost


# ---------------------------------------------------------------------------------------------
# The layer


class MoeMlp(nnx.Module):
    """Routed experts (SwiGLU each) and optional shared experts, with their auxiliary sums."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe = cfg.moe
        d, e, f = cfg.d_model, moe.num_experts, moe.d_ff_expert
        self.router = _param(rngs, cfg, (d, e), ("embed", None), "router")
        self.w_gate = _param(rngs, cfg, (e, d, f), _EXPERT_IN, "matrix", ("embed",))
        self.w_up = _param(rngs, cfg, (e, d, f), _EXPERT_IN, "matrix", ("embed",))
        self.w_down = _param(rngs, cfg, (e, f, d), _EXPERT_OUT, "matrix", ("mlp",))
        # DeepSeek-V3's routing bias: moved by the balance rule after each step, never by the
        # optimizer (its gradient is zero: it only chooses experts).
        self.bias = (
            nnx.Param(
                jnp.zeros((e,), jnp.float32),
                out_sharding=(None,),
                eager_sharding=False,
                role="buffer",
            )
            if moe.balance == "aux_free"
            else None
        )
        shared = moe.num_shared_experts * f
        self.shared = Mlp(cfg.model_copy(update={"d_ff": shared}), rngs=rngs) if shared else None
        self.moe = moe
        self.dtype = DTYPES[cfg.dtype]

    def __call__(self, h_BSD, segment_ids_BS) -> tuple[jax.Array, dict[str, jax.Array]]:
        moe, dt = self.moe, self.dtype
        bias = None if self.bias is None else self.bias[...]
        experts_BSK, weights_BSK, probs_BSE, logits_BSE = route(
            h_BSD, self.router[...], bias, moe, self._router_bias()
        )
        real_BS = segment_ids_BS > 0
        y_BSD, dropped = routed(
            h_BSD, experts_BSK, weights_BSK, real_BS, self._experts(), moe, dt, self._act()
        )
        if self.shared is not None:
            y_BSD = y_BSD + self.shared(h_BSD)
        y_BSD = checkpoint_name(y_BSD, "mlp_out")
        return y_BSD, self._aux(segment_ids_BS, experts_BSK, probs_BSE, logits_BSE, dropped)

    def _router_bias(self) -> jax.Array | None:
        """The router's learned bias [E] on its logits (none here; a family may add one)."""
        return None

    def _experts(self) -> ExpertWeights:
        """The routed experts' parameters (a family with expert biases adds them)."""
        return ExpertWeights(self.w_gate[...], self.w_up[...], self.w_down[...])

    def _act(self):
        """The experts' gate: act(gate, up) -> the hidden units (SwiGLU's here)."""
        return _swiglu

    def _aux(self, segment_ids_BS, experts_BSK, probs_BSE, logits_BSE, dropped):
        """float32 sums over this call's tokens (padding, segment id 0, excluded)."""
        moe = self.moe
        e, k = moe.num_experts, moe.experts_per_token
        real_BS = (segment_ids_BS > 0).astype(jnp.float32)
        chosen_BSE = jax.nn.one_hot(experts_BSK, e, dtype=jnp.float32).sum(axis=2)
        tokens_E = jnp.einsum("BSE,BS->E", chosen_BSE, real_BS)
        aux = {"moe/expert_tokens": tokens_E}
        if moe.router_z_loss:
            lse_BS = jax.nn.logsumexp(logits_BSE, axis=-1)
            aux["learning/router_z_loss"] = moe.router_z_loss * jnp.sum(real_BS * lse_BS**2)
        if moe.load_balance_loss:
            n = jnp.sum(real_BS)
            mean_prob_E = jnp.einsum("BSE,BS->E", probs_BSE, real_BS) / jnp.maximum(n, 1.0)
            # E * sum_e f_e P_e with f_e = tokens_e / (K n), times n: a sum over the tokens.
            balance = e / k * jnp.sum(jax.lax.stop_gradient(tokens_E) * mean_prob_E)
            aux["learning/moe_lb_loss"] = moe.load_balance_loss * balance
        if dropped is not None:
            aux["moe/dropped_tokens"] = dropped
        return aux


def routed(h_BSD, experts_BSK, weights_BSK, real_BS, weights, moe, dtype, act=_swiglu):
    """(sum over each token's experts of weight * expert(token) [B,S,D], real tokens'
    assignments dropped for a capacity or the receive buffer, or None when nothing can be
    dropped), on this device or in `shard_map` over the mesh. Padding (`real_BS` False) is not
    routed: its output is 0 and it takes no capacity. `weights`: an `ExpertWeights` (or the
    gate, up and down projections), `act` the experts' gate (`ragged_rows`).

    On a mesh the experts are split over the `experts` rule's axis (`_expert_parallel`). With
    `moe.expert_tensor_parallel` and the `mlp` rule's axis (tensor) splitting the tokens, the
    expert weights stay split over it along d_ff: the devices of that axis gather their tokens
    (an all-gather), route and send all of them, multiply them by their slices of the experts,
    and reduce-scatter the partial sums back to their own tokens (Megatron's expert tensor
    parallelism); otherwise each device gathers its experts whole.

    `weights` (gate, up, down) are cast to the compute `dtype` before they are gathered for
    `shard_map`, unless `train.grad_reduce_dtype` asks for weight gradients in another dtype:
    then they are cast inside, so their gradients leave `shard_map`, and are summed across
    devices, in the parameters' dtype.
    """
    rows = functools.partial(GROUPED_MATMULS[grouped_matmul(moe.grouped_matmul)], act=act)
    reduce = current_reduce_dtype()
    inside = reduce is not None and reduce != jnp.dtype(dtype)
    weights = ExpertWeights(*weights)
    if not inside:
        weights = ExpertWeights(*(None if w is None else w.astype(dtype) for w in weights))
    counted = moe.capacity_factor is not None or moe.buffer_factor is not None

    def local(h_BSD, experts_BSK, weights_BSK, real_BS, ws, *, axis, count_axes, tensor):
        tensor_axis, tensor_dim = tensor
        if tensor_axis is not None:  # the tensor group's tokens, for its slices of the experts
            gather = functools.partial(
                jax.lax.all_gather, axis_name=tensor_axis, axis=tensor_dim, tiled=True
            )
            h_BSD, experts_BSK, weights_BSK, real_BS = map(
                gather, (h_BSD, experts_BSK, weights_BSK, real_BS)
            )
        b, s, d = h_BSD.shape
        k = experts_BSK.shape[-1]
        cap = capacity(b * s, k, moe.num_experts, moe.capacity_factor)
        experts = None
        if axis is not None:
            shards = jax.lax.axis_size(axis)
            buffer = receive_rows(b * s, k, moe.num_experts, shards, cap, moe.buffer_factor)
            experts = ExpertAxis(axis, buffer, traced_platform() in NATIVE_RAGGED)
        ws = ExpertWeights(*(None if w is None else w.astype(dtype) for w in ws))
        if tensor_axis is not None and ws.down_bias is not None:
            # The devices' partial sums over their slices of d_ff add up: one holds the bias.
            first = jax.lax.axis_index(tensor_axis) == 0
            ws = ws._replace(down_bias=jnp.where(first, ws.down_bias, 0))
        y_TKD, dropped = dispatch(
            h_BSD.reshape(b * s, d),
            experts_BSK.reshape(b * s, k),
            jnp.broadcast_to(real_BS.reshape(b * s, 1), (b * s, k)),
            ws,
            rows=rows,
            num_experts=moe.num_experts,
            cap=cap,
            experts=experts,
        )
        w_TK = weights_BSK.reshape(b * s, k)
        y_BSD = jnp.einsum("TKD,TK->TD", y_TKD.astype(jnp.float32), w_TK).reshape(b, s, d)
        if tensor_axis is not None:  # each device's partial sums, back to its tokens
            y_BSD = jax.lax.psum_scatter(
                y_BSD, tensor_axis, scatter_dimension=tensor_dim, tiled=True
            )
        dropped = dropped.astype(jnp.float32) if counted else None
        if counted and count_axes:
            dropped = jax.lax.psum(dropped, count_axes)
        return y_BSD.astype(h_BSD.dtype), dropped

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(
            h_BSD,
            experts_BSK,
            weights_BSK,
            real_BS,
            weights,
            axis=None,
            count_axes=(),
            tensor=(None, 0),
        )
    rules = current_rules()
    tokens = logical_spec(("batch", "act_length", None), rules)
    token_axes = tuple(a for entry in tokens for a in entry_axes(entry))
    expert_spec = logical_spec(("experts",), rules)
    expert_axes = entry_axes(expert_spec[0])
    if len(expert_axes) > 1:
        raise KilnError(
            f"mesh.rules.experts: {list(expert_axes)}; allowed: at most one mesh axis "
            "(the all-to-all runs over one axis)"
        )
    axis = expert_axes[0] if expert_axes and mesh.shape[expert_axes[0]] > 1 else None
    if moe.num_experts % (mesh.shape[axis] if axis else 1):
        raise KilnError(
            f"model.moe.num_experts: {moe.num_experts} is not divisible by mesh.{axis}="
            f"{mesh.shape[axis]}; allowed: a multiple of the expert-parallel size"
        )
    tensor = _expert_tensor_axis(moe, mesh, rules, tokens, axis)
    w_in = PartitionSpec(axis, None, tensor[0])
    w_out = PartitionSpec(axis, tensor[0], None)
    b_in, b_out = PartitionSpec(axis, tensor[0]), PartitionSpec(axis, None)
    # The specs of the weights there are (the biases' only with biases).
    w_specs = [
        spec
        for spec, w in zip((w_in, w_in, w_out, b_in, b_in, b_out), weights, strict=True)
        if w is not None
    ]
    count_axes = tuple(a for a in token_axes if a != tensor[0])

    def per_device(h_BSD, experts_BSK, weights_BSK, real_BS, *ws):
        return local(
            h_BSD,
            experts_BSK,
            weights_BSK,
            real_BS,
            ExpertWeights(*ws),
            axis=axis,
            count_axes=count_axes,
            tensor=tensor,
        )

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, PartitionSpec(*tokens[:2]), *w_specs),
        out_specs=(tokens, PartitionSpec() if counted else None),
        check_vma=False,
    )(h_BSD, experts_BSK, weights_BSK, real_BS, *(w for w in weights if w is not None))


def _expert_tensor_axis(moe, mesh, rules, tokens, expert_axis) -> tuple[str | None, int]:
    """(the mesh axis that splits the experts' d_ff inside the expert computation, the token
    dimension it splits), or (None, 0): expert tensor parallelism needs one axis of size > 1
    under the `mlp` rule that splits the tokens (the `act_length` rule's tensor) and is not the
    expert axis."""
    mlp_axes = entry_axes(logical_spec(("mlp",), rules)[0])
    if not moe.expert_tensor_parallel or len(mlp_axes) != 1:
        return None, 0
    name = mlp_axes[0]
    if name == expert_axis or mesh.shape[name] == 1:
        return None, 0
    for dim, entry in enumerate(tokens[:2]):
        if name in entry_axes(entry):
            return name, dim
    return None, 0


class MoeBlock(Block):
    """llama's block with routed experts in place of its MLP; returns (x, aux sums)."""

    def _make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoeMlp(cfg, rngs=rngs)

    def _mlp(self, h_BSD, segment_ids_BS):
        return self.mlp(h_BSD, segment_ids_BS)


class MoeTransformer(Transformer):
    """The `moe` family: `first_dense_layers` llama blocks, then MoE blocks (two scanned stacks).

    Implements `kiln.model.LanguageModel`. aux (`ModelOutput.aux`): the router z-loss and the
    load-balance loss as sums over the tokens (summed over layers; absent when their weight is
    0), the tokens each layer sent to each expert (`moe/expert_tokens` [L_moe, E]) and, with a
    capacity, the assignments dropped per layer (`moe/dropped_tokens` [L_moe]).
    """

    # The blocks of the two stacks (a family with another attention overrides both).
    dense_block: ClassVar[type[Block]] = Block
    moe_block: ClassVar[type[Block]] = MoeBlock

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe = cfg.moe
        if moe is None or not 0 <= moe.first_dense_layers < cfg.num_layers:
            raise KilnError(
                f"model.moe.first_dense_layers: {getattr(moe, 'first_dense_layers', None)}; "
                f"allowed: 0..{cfg.num_layers - 1} (model.num_layers={cfg.num_layers})"
            )
        super().__init__(cfg, rngs=rngs)
        # Replaces the dense stack the base class built with the two stacks.
        dense = moe.first_dense_layers
        self.dense_blocks = stacked_blocks(cfg, rngs, self.dense_block, dense) if dense else None
        self.blocks = stacked_blocks(cfg, rngs, self.moe_block, cfg.num_layers - dense)

    def _stacks(self) -> list[nnx.Module]:
        return [b for b in (self.dense_blocks, self.blocks) if b is not None]

    def _routed(self) -> list[nnx.Module]:
        """The stacks of routed-expert MLPs, in the order of their rows in the aux arrays."""
        return [self.blocks.mlp]

    def _aux(self, per_stack):
        """The routed stacks' per-layer aux joined along layers ([L_moe, ...] per key; the
        dense stack has none): statistics as arrays, losses summed."""
        routed = [aux for aux in per_stack if aux]
        aux = {k: _join([a[k] for a in routed]) for k in (routed[0] if routed else ())}
        out = {k: v for k, v in aux.items() if k.startswith("moe/")}
        out.update({k: jnp.sum(v) for k, v in aux.items() if not k.startswith("moe/")})
        return out

    def update_balance(self, aux) -> None:
        """balance: aux_free: each expert's bias moves by bias_update_rate towards equal load,
        from the step's global `moe/expert_tokens` (DeepSeek-V3: up if below the mean), centred:
        the mean move of a layer's biases is taken out, so they never drift together (a shift
        common to every expert chooses nothing)."""
        moe = self.cfg.moe
        if moe.balance != "aux_free":
            return
        tokens_LE = aux["moe/expert_tokens"]
        mean_L1 = jnp.mean(tokens_LE, axis=-1, keepdims=True)
        move_LE = jnp.sign(mean_L1 - tokens_LE)
        move_LE = move_LE - jnp.mean(move_LE, axis=-1, keepdims=True)
        first = 0
        for mlp in self._routed():
            bias = mlp.bias
            rows = bias.shape[0]
            bias[...] = bias[...] + moe.bias_update_rate * move_LE[first : first + rows]
            first += rows

    @staticmethod
    def aux_metrics(cfg: ModelConfig, sums) -> dict[str, jax.Array]:
        """Scalars logged from the global aux sums: each MoE layer's most loaded expert over
        the mean load (and the worst layer's), and the fraction of assignments dropped."""
        tokens_LE = sums["moe/expert_tokens"]
        mean_L = jnp.mean(tokens_LE, axis=-1)
        ratio_L = jnp.max(tokens_LE, axis=-1) / jnp.where(mean_L > 0, mean_L, 1.0)
        first = cfg.moe.first_dense_layers
        out = {"moe/expert_load_max_over_mean": jnp.max(ratio_L)}
        for i in range(tokens_LE.shape[0]):
            out[f"moe/expert_load_max_over_mean/layer_{first + i}"] = ratio_L[i]
        if "moe/dropped_tokens" in sums:
            total = jnp.sum(tokens_LE)
            out["moe/dropped_fraction"] = jnp.sum(sums["moe/dropped_tokens"]) / jnp.where(
                total > 0, total, 1.0
            )
        return out

    def matmul_params(self) -> int:
        """Active parameters that multiply activations: attention, dense MLPs, the router and
        the K routed plus the shared experts each token passes through, and the LM head."""
        m, dense = self.cfg, self.cfg.moe.first_dense_layers
        layers = m.num_layers * self._attention_params() + dense * 3 * m.d_model * m.d_ff
        routed = (m.num_layers - dense) * self._routed_layer_params()
        return layers + routed + m.d_model * m.vocab_size

    def _attention_params(self) -> int:
        """Matmul parameters of one layer's attention (grouped-query: q, k, v and o)."""
        m = self.cfg
        d, h, n, kv = m.d_model, m.resolved_head_dim, m.num_heads, m.kv_heads
        return d * (n + 2 * kv) * h + n * h * d

    def _routed_layer_params(self) -> int:
        """Active matmul parameters of one routed MLP: the router, the K routed and the
        shared experts a token passes through."""
        m, moe = self.cfg, self.cfg.moe
        expert = 3 * m.d_model * moe.d_ff_expert
        return (
            m.d_model * moe.num_experts + (moe.experts_per_token + moe.num_shared_experts) * expert
        )

    def inactive_params(self) -> int:
        """Parameters a token does not use: the routed experts beyond its top-k, every layer."""
        m, moe = self.cfg, self.cfg.moe
        idle = (moe.num_experts - moe.experts_per_token) * 3 * m.d_model * moe.d_ff_expert
        return (m.num_layers - moe.first_dense_layers) * idle


__all__ = ["ExpertWeights", "MoeTransformer", "route", "routed"]


# ---------------------------------------------------------------------------------------------
# Hugging Face: Qwen3-MoE with model.qk_norm, Mixtral without

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
