"""Where each assignment goes: the assignments sorted and grouped by expert, and groups of
rows padded to whole blocks. Integer index arithmetic only (no matmul, no gradient).

Einsum letters as in `kiln.model.moe`: E experts, A assignments, C slots of the grouped
layout, R grouped rows, U block slots, N blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kiln.parallel.mesh import traced_platform

# Largest block of rows the blocked grouped matmul multiplies by one expert's weights.
BLOCK_ROWS = 128


def group_of(ends, i):
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
    e_C = group_of(kend_E, c)
    e_Cs = jnp.minimum(e_C, num_experts - 1)
    first = sort.order_A[jnp.minimum(sort.start_E1[e_Cs] + c - kstart_E[e_Cs], a - 1)]
    src_C = jnp.where(e_C < num_experts, first, a)
    e_As, rank_A, kept_A = sort.ranks(e_A)
    slot_A = jnp.where(kept_A, kstart_E[e_As] + rank_A, a)
    return src_C, slot_A, sort.kept_E, jnp.sum(sort.count_E - sort.kept_E)


# ---------------------------------------------------------------------------------------------
# Groups padded to whole blocks (the blocked grouped matmul's layout)


def default_block(rows: int, num_experts: int) -> int:
    """The default block: a power of two near a quarter of an expert's even share of `rows`,
    8 to BLOCK_ROWS, which keeps the padding near 1/8 of the rows."""
    per_expert = max(1, rows // (4 * num_experts))
    return max(8, min(BLOCK_ROWS, 1 << (per_expert.bit_length() - 1)))


class Padded(NamedTuple):
    """Groups of sizes_E rows padded to whole blocks (`pad_to_blocks`): `blocks` of `block` slots,
    group e's slots from pstart_E[e]; slot u's group e_Us[u] (clipped to a real one), its
    place q_U[u] in it, whether it holds a row (filled_U); each block's group expert_N."""

    block: int
    blocks: int
    pstart_E: jax.Array
    e_Us: jax.Array
    q_U: jax.Array
    filled_U: jax.Array
    expert_N: jax.Array


def pad_to_blocks(sizes_E, rows: int, block: int) -> Padded:
    """The block layout of groups of `sizes_E` rows (of `rows`): enough blocks of `block` slots
    for any split of the rows, each group padded to whole blocks."""
    num_experts = sizes_E.shape[0]
    blocks = -(-(rows + num_experts * (block - 1)) // block)
    padded_E = -(-sizes_E // block) * block
    pend_E = jnp.cumsum(padded_E)
    pstart_E = pend_E - padded_E
    u = jnp.arange(blocks * block, dtype=jnp.int32)
    e_U = group_of(pend_E, u)
    e_Us = jnp.minimum(e_U, num_experts - 1)
    q_U = u - pstart_E[e_Us]
    filled_U = (e_U < num_experts) & (q_U < sizes_E[e_Us])
    expert_N = jnp.minimum(group_of(pend_E, u[::block]), num_experts - 1)
    return Padded(block, blocks, pstart_E, e_Us, q_U, filled_U, expert_N)


def block_layout(sizes_E, rows: int, block: int | None = None):
    """Groups of `sizes_E` rows (of `rows`, grouped by expert) padded to whole blocks of
    `block` rows: (src_U, dst_R, expert_N, block). Block slot u holds grouped row src_U[u]
    (`rows` for padding), grouped row r goes to slot dst_R[r] (past the slots for rows past
    the groups), block n belongs to expert expert_N[n]. The padding is at most
    E * (block - 1) rows (`default_block`: the default block)."""
    num_experts = sizes_E.shape[0]
    pad = pad_to_blocks(sizes_E, rows, block or default_block(rows, num_experts))
    gend_E = jnp.cumsum(sizes_E)
    gstart_E = gend_E - sizes_E
    src_U = jnp.where(pad.filled_U, gstart_E[pad.e_Us] + pad.q_U, rows)
    r = jnp.arange(rows, dtype=jnp.int32)
    e_R = group_of(gend_E, r)
    e_Rs = jnp.minimum(e_R, num_experts - 1)
    slots = pad.blocks * pad.block
    dst_R = jnp.where(e_R < num_experts, pad.pstart_E[e_Rs] + r - gstart_E[e_Rs], slots)
    return src_U, dst_R, pad.expert_N, pad.block
