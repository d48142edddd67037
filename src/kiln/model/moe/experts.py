"""The assignments through their experts: grouped by expert on this device, or sent to the
devices holding their experts over the expert axis and back (`kiln.parallel.exchange`).

Einsum letters as in `kiln.model.moe`, plus C slots of the grouped layout, M rows of a
receive buffer, P devices on the expert axis and L experts of one device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kiln.model.moe.grouped import ExpertWeights, blocked_rows, expert_blocks, run_grouped
from kiln.model.moe.layout import (
    Sorted,
    default_block,
    expert_layout,
    group_of,
    pad_to_blocks,
    sort_by_expert,
)
from kiln.parallel.exchange import Plan, ragged_exchange, take_copies, take_rows

# Platforms whose XLA backend runs a ragged all-to-all (CPU: a dense one of padded chunks).
NATIVE_RAGGED = ("tpu", "gpu")


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
    """How the experts are split: over mesh axis `axis`, `buffer` the receive buffer's rows,
    `native` the backend's ragged all-to-all (else the dense one, CPU)."""

    axis: str
    buffer: int
    native: bool


def expert_outputs(
    x_TD, e_TK, real_TK, weights: ExpertWeights, *, matmul, num_experts, cap, expert_axis
):
    """(outputs [T,K,D] of each assignment, 0 if dropped; the real assignments dropped): each
    token through each of its experts, before the router's gates weight and sum them.

    Token t's j-th choice e_TK[t, j] is assignment a = j·T + t: first choices before second
    ones, then in token order, which is the order an expert's capacity keeps. One sort groups
    them by expert (`expert_layout`) and `matmul` (a grouped matmul) runs them. `expert_axis`
    None: every expert is here (weights [E, ...]). Else the experts are split over
    `expert_axis.axis` and the grouped rows, which are also grouped by destination, go to their
    experts' devices by one ragged all-to-all of their real sizes and come back by another
    (`_expert_parallel`).
    """
    t, k = e_TK.shape
    e_A = jnp.where(real_TK, e_TK, num_experts).T.reshape(-1)
    if expert_axis is None and getattr(matmul, "func", matmul) is blocked_rows:
        sort = sort_by_expert(e_A, num_experts, cap)
        y_TKD = blocked_assignments(x_TD, e_A, sort, weights, matmul.keywords["act"])
        return y_TKD, jnp.sum(sort.count_E - sort.kept_E)
    src_C, slot_A, kept_E, dropped = expert_layout(e_A, num_experts, cap)
    a = t * k
    x_CD = take_copies(x_TD, jnp.where(src_C < a, src_C % t, t), slot_A.reshape(k, t))
    if expert_axis is None:
        y_CD = run_grouped(matmul, x_CD, kept_E, weights)
    else:
        y_CD, lost = _expert_parallel(x_CD, kept_E, weights, matmul, expert_axis)
        dropped = dropped + lost
    y_AD = take_rows(y_CD, slot_A, src_C)
    return y_AD.reshape(k, t, -1).transpose(1, 0, 2), dropped


def blocked_assignments(x_TD, e_A, sort: Sorted, weights: ExpertWeights, act):
    """`blocked_rows` for every expert here, straight from the sort: each expert's kept
    assignments padded to whole blocks, the tokens gathered straight into their blocks and the
    outputs straight back to their assignments (no grouped layout between: one gather each
    way, and one per way in the backward pass). Outputs [T, K, D] (gathered in token order,
    not transposed from the assignments' order): the same numbers as the grouped layout
    through `blocked_rows`."""
    t, d = x_TD.shape
    a, num_experts = e_A.shape[0], sort.kept_E.shape[0]
    pad = pad_to_blocks(sort.kept_E, a, default_block(a, num_experts))
    first = sort.order_A[jnp.minimum(sort.start_E1[pad.e_Us] + pad.q_U, a - 1)]
    assignment_U = jnp.where(pad.filled_U, first, a)
    e_As, rank_A, kept_A = sort.ranks(e_A)
    slot_A = jnp.where(kept_A, pad.pstart_E[e_As] + rank_A, pad.blocks * pad.block)
    token_U = jnp.where(assignment_U < a, assignment_U % t, t)
    xs_NbD = take_copies(x_TD, token_U, slot_A.reshape(-1, t))
    xs_NbD = xs_NbD.reshape(pad.blocks, pad.block, d)
    expert_N = pad.expert_N
    biases = None if weights.gate_bias is None else weights[3:]
    ys_NbD = expert_blocks(xs_NbD, expert_N, *weights[:3], biases, act)
    k = a // t  # assignment j·T + t is row t·K + j of the output
    slot_TK = slot_A.reshape(k, t).T.reshape(-1)
    row_U = jnp.where(assignment_U < a, (assignment_U % t) * k + assignment_U // t, a)
    return take_rows(ys_NbD.reshape(-1, d), slot_TK, row_U).reshape(t, k, d)


def _expert_parallel(x_CD, kept_E, weights, matmul, expert_axis: ExpertAxis):
    """The grouped rows (kept_E per expert, in expert order) through the experts of their
    devices on `expert_axis.axis` and back: (outputs in the same slots, rows the receivers had no
    room for, whose outputs are 0).

    Every device learns every device's rows per expert (a small all-gather), so each knows
    where its chunk lands in each receiver's buffer (after the chunks of the devices before
    it) and how much of it fits. The receiver places the rows, which arrive grouped by source
    and then by expert, grouped by expert without sorting: each row's place follows from the
    counts.
    """
    axis, buffer, native = expert_axis
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
    l_p = group_of(gend_L, p)
    l_ps = jnp.minimum(l_p, local - 1)
    q_p = p - gstart_L[l_ps]
    s_p = jnp.minimum(
        jnp.sum(from_PL.T[l_ps] + got_PL.T[l_ps] <= q_p[:, None], axis=-1), shards - 1
    )
    r_p = rstart_P[s_p] + before_PL[s_p, l_ps] + q_p - from_PL[s_p, l_ps]
    recv_of = jnp.where(l_p < local, r_p, buffer)
    # Received row r: its source, its expert, and the grouped row it becomes.
    s_r = group_of(rend_P, p)
    s_rs = jnp.minimum(s_r, shards - 1)
    q_r = p - rstart_P[s_rs]
    l_r = jnp.minimum(jnp.sum((before_PL + mine_PL)[s_rs] <= q_r[:, None], axis=-1), local - 1)
    grouped_of = jnp.where(
        s_r < shards, gstart_L[l_r] + from_PL[s_rs, l_r] + q_r - before_PL[s_rs, l_r], buffer
    )
    xs_MD = take_rows(recv_MD, recv_of, grouped_of)
    ys_MD = run_grouped(matmul, xs_MD, sizes_L, weights)
    y_MD = take_rows(ys_MD, grouped_of, recv_of)
    return ragged_exchange(y_MD, plan.reverse(), x_CD.shape[0], axis, native), lost
