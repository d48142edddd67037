"""Ring attention (`model.context_parallel: ring`): the key/value blocks of every sequence shard
travel around the shards by `ppermute` while each keeps its query rows.

The contract and the einsum letters: `kiln.model.attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kiln.model.attention.xla import (
    MASKED,
    QUERY_BLOCK,
    balanced_order,
    rows_balanced,
    sequence_shards,
)
from kiln.parallel.mesh import current_rules, logical_spec, mesh_axes

# ---------------------------------------------------------------------------------------------
# Ring attention (model.context_parallel: ring): each sequence shard keeps its query rows, and the
# key/value blocks of all shards travel around the shards by `ppermute`, one hop per step, merged
# into each row's softmax online (running maximum and sum). No shard ever holds more than its own
# block and the one arriving; the backward pass sends the blocks around again with their key/value
# gradients travelling beside them, so it saves no block either. Rows may be in any order (their
# positions travel with the keys): placed for load balance, every shard's step has the same work.


def _ring_visible(pos_q_C, pos_k_U, window):
    """Whether any of these query rows sees any of these keys (by position; exact for runs of
    consecutive positions, which a shard's halves are, conservative otherwise)."""
    visible = pos_q_C.max() >= pos_k_U.min()
    if window is not None:
        visible &= pos_q_C.min() - pos_k_U.max() < window
    return visible


def _ring_mask(pos_q_C, seg_q_BC, pos_k_U, seg_k_BU, window, g: int):
    """[B, 1, R, U]: which keys each query row (R = C*G, c-major) sees."""
    seen_CU = pos_q_C[:, None] >= pos_k_U[None, :]
    if window is not None:
        seen_CU &= pos_q_C[:, None] - pos_k_U[None, :] < window
    mask_BCU = (seg_q_BC[:, :, None] == seg_k_BU[:, None, :]) & seen_CU[None]
    b, c, u = mask_BCU.shape
    return jnp.broadcast_to(mask_BCU[:, :, None], (b, c, g, u)).reshape(b, 1, c * g, u)


def _ring_scores(q_BKRH, k_BUKH, mask_B1RU):
    h = q_BKRH.shape[-1]
    scores_BKRU = jnp.einsum(
        "BKRH,BUKH->BKRU", q_BKRH, k_BUKH, preferred_element_type=jnp.float32
    ) * (h**-0.5)
    return jnp.where(mask_B1RU, scores_BKRU, MASKED)


def _ring_forward_block(state, q_BKRH, k_BUKH, v_BUKV, mask_B1RU):
    """The running maximum, sum and unnormalised output of R rows, after one more key block."""
    max_BKR, sum_BKR, acc_BKRV = state
    scores_BKRU = _ring_scores(q_BKRH, k_BUKH, mask_B1RU)
    new_max_BKR = jnp.maximum(max_BKR, scores_BKRU.max(axis=-1))
    rescale_BKR = jnp.exp(max_BKR - new_max_BKR)
    exp_BKRU = jnp.where(mask_B1RU, jnp.exp(scores_BKRU - new_max_BKR[..., None]), 0.0)
    sum_BKR = sum_BKR * rescale_BKR + exp_BKRU.sum(axis=-1)
    values_BKRV = jnp.einsum(
        "BKRU,BUKV->BKRV", exp_BKRU.astype(v_BUKV.dtype), v_BUKV, preferred_element_type=jnp.float32
    )
    return new_max_BKR, sum_BKR, acc_BKRV * rescale_BKR[..., None] + values_BKRV


def _ring_backward_block(grads, q_BKRH, k_BUKH, v_BUKV, do_BKRV, lse_BKR, delta_BKR, mask_B1RU):
    """The gradients of R rows' queries and of one key block's keys and values, accumulated."""
    dq_BKRH, dk_BUKH, dv_BUKV = grads
    h = q_BKRH.shape[-1]
    scores_BKRU = _ring_scores(q_BKRH, k_BUKH, mask_B1RU)
    probs_BKRU = jnp.where(mask_B1RU, jnp.exp(scores_BKRU - lse_BKR[..., None]), 0.0)
    dv_BUKV += jnp.einsum(
        "BKRU,BKRV->BUKV",
        probs_BKRU.astype(do_BKRV.dtype),
        do_BKRV,
        preferred_element_type=jnp.float32,
    )
    dprobs_BKRU = jnp.einsum("BKRV,BUKV->BKRU", do_BKRV, v_BUKV, preferred_element_type=jnp.float32)
    dscores_BKRU = probs_BKRU * (dprobs_BKRU - delta_BKR[..., None]) * (h**-0.5)
    dq_BKRH += jnp.einsum(
        "BKRU,BUKH->BKRH",
        dscores_BKRU.astype(k_BUKH.dtype),
        k_BUKH,
        preferred_element_type=jnp.float32,
    )
    dk_BUKH += jnp.einsum(
        "BKRU,BKRH->BUKH",
        dscores_BKRU.astype(q_BKRH.dtype),
        q_BKRH,
        preferred_element_type=jnp.float32,
    )
    return dq_BKRH, dk_BUKH, dv_BUKV


@dataclasses.dataclass(frozen=True)
class _Ring:
    """What a ring's shards share: the mesh axes of the ring, its length, the window, and the
    shapes of a shard's query tiles and key halves."""

    axes: tuple[str, ...]
    shards: int
    window: int | None
    tile: int  # query rows per tile (C)
    halves: int  # key sub-blocks per block (J), each skipped on its own

    def rotate(self, tree):
        """Every array of `tree` to the next shard of the ring (shard p sends to p + 1)."""
        perm = [(i, (i + 1) % self.shards) for i in range(self.shards)]
        return jax.tree.map(lambda x: jax.lax.ppermute(x, self.axes, perm), tree)

    def query_tiles(self, x_BLNX, k: int):
        """[T, B, K, R, X] from [B, L, N, X]: the shard's rows in tiles, heads folded in."""
        b, rows, n, x = x_BLNX.shape
        tiles, c, g = rows // self.tile, self.tile, n // k
        x_BTCKGX = x_BLNX.reshape(b, tiles, c, k, g, x)
        return x_BTCKGX.transpose(1, 0, 3, 2, 4, 5).reshape(tiles, b, k, c * g, x)

    def rows(self, x_TBKRX, g: int):
        """[B, L, N, X] back from query tiles."""
        t, b, k, r, x = x_TBKRX.shape
        c = r // g
        x_BTCKGX = x_TBKRX.reshape(t, b, k, c, g, x).transpose(1, 0, 3, 2, 4, 5)
        return x_BTCKGX.reshape(b, t * c, k * g, x)

    def split(self, x_BL):
        """The key block's J halves along length (axis 1, or 0 for a [L] array)."""
        axis = 0 if x_BL.ndim == 1 else 1
        return tuple(jnp.split(x_BL, self.halves, axis=axis))

    def merge(self, halves):
        return jnp.concatenate(halves, axis=1)

    def row_tiles(self, seg_BL, pos_L):
        """The positions [T, C] and segment ids [T, B, C] of the shard's query tiles."""
        b = seg_BL.shape[0]
        return pos_L.reshape(-1, self.tile), seg_BL.reshape(b, -1, self.tile).transpose(1, 0, 2)

    def seen(self, fn, state, half, pos_C, seg_BC, g: int):
        """`fn(state, k_BUKH, v_BUKV, mask)` over one key half when these query rows see any
        of its keys; `state` as it is when the causal mask or the window empties the half."""
        k_BUKH, v_BUKV, seg_BU, pos_U = half

        def update(state):
            mask = _ring_mask(pos_C, seg_BC, pos_U, seg_BU, self.window, g)
            return fn(state, k_BUKH, v_BUKV, mask)

        visible = _ring_visible(pos_C, pos_U, self.window)
        return jax.lax.cond(visible, update, lambda state: state, state)


def _ring_tiles(rows: int, query_block: int) -> tuple[int, int]:
    """(query rows per tile, key halves per block) of a shard of `rows` rows: two halves when
    `rows` is even, tiles of `query_block` rows when that divides a half, else a half."""
    halves = 2 if rows % 2 == 0 else 1
    half = rows // halves
    return (query_block if half > query_block and half % query_block == 0 else half), halves


def ring_work(
    s: int, shards: int, *, window=None, balanced=False, query_block=QUERY_BLOCK
) -> np.ndarray:
    """[P, P]: how many (query tile x key half) products shard p computes at hop j (hop 0: its
    own block), by the predicate the ring evaluates (`_ring_visible`) on the same positions."""
    order = balanced_order(s, shards) if balanced else np.arange(s)
    rows = s // shards
    tile, halves = _ring_tiles(rows, query_block)
    shard_pos = order.reshape(shards, rows)
    work = np.zeros((shards, shards), np.int64)
    for p, j in np.ndindex(shards, shards):
        keys = np.split(shard_pos[(p - j) % shards], halves)
        for pos_C in shard_pos[p].reshape(-1, tile):
            work[p, j] += sum(bool(_ring_visible(pos_C, pos_U, window)) for pos_U in keys)
    return work


def _ring_forward(ring: _Ring, q_BLNH, k_BLKH, v_BLKV, seg_BL, pos_L):
    """(output [B, L, N, V] in the values' dtype, log-sum-exp [B, L, N] float32) of this
    shard's rows over every shard's keys."""
    # The masks depend only on positions and segment ids, which a layer stack's scan closes
    # over; differentiated, the scan would compute them for every hop and tile before its loop
    # (loop-invariant values are hoisted) and hold them all. Tied to the queries, they are
    # computed where they are used.
    q_BLNH, seg_BL, pos_L = jax.lax.optimization_barrier((q_BLNH, seg_BL, pos_L))
    b, _, n, _ = q_BLNH.shape
    k, hv = k_BLKH.shape[2], v_BLKV.shape[-1]
    g = n // k
    q_TBKRH = ring.query_tiles(q_BLNH, k)
    tiles, r = q_TBKRH.shape[0], q_TBKRH.shape[3]
    pos_TC, seg_TBC = ring.row_tiles(seg_BL, pos_L)
    state = (
        jnp.full((tiles, b, k, r), MASKED, jnp.float32),
        jnp.zeros((tiles, b, k, r), jnp.float32),
        jnp.zeros((tiles, b, k, r, hv), jnp.float32),
    )

    def step(state, block):
        def tile(xs):
            q_BKRH, pos_C, seg_BC, *tile_state = xs

            def attend(state, k_BUKH, v_BUKV, mask):
                return _ring_forward_block(state, q_BKRH, k_BUKH, v_BUKV, mask)

            tile_state = tuple(tile_state)
            for half in zip(*block):
                tile_state = ring.seen(attend, tile_state, half, pos_C, seg_BC, g)
            return tile_state

        return jax.lax.map(tile, (q_TBKRH, pos_TC, seg_TBC, *state))

    block = tuple(map(ring.split, (k_BLKH, v_BLKV, seg_BL, pos_L)))

    def hop(carry, _):
        block, state = carry
        arriving = ring.rotate(block)  # sent while this block is computed
        return (arriving, step(state, block)), None

    (block, state), _ = jax.lax.scan(hop, (block, state), None, length=ring.shards - 1)
    max_TBKR, sum_TBKR, acc_TBKRV = step(state, block)
    out_TBKRV = (acc_TBKRV / sum_TBKR[..., None]).astype(v_BLKV.dtype)
    lse_TBKR = max_TBKR + jnp.log(sum_TBKR)
    return ring.rows(out_TBKRV, g), ring.rows(lse_TBKR[..., None], g)[..., 0]


def _ring_backward(
    ring: _Ring, q_BLNH, k_BLKH, v_BLKV, seg_BL, pos_L, out_BLNV, lse_BLN, do_BLNV, dlse_BLN
):
    """(dq, dk, dv) of this shard's rows and block: the blocks go around the ring once more,
    each with its key/value gradients accumulated by every shard it visits; one last hop
    brings those home. The log-sum-exp's cotangent (the sinks') joins each row's delta:
    d lse / d score = prob."""
    n, k = q_BLNH.shape[2], k_BLKH.shape[2]
    g = n // k
    delta_BLN = (do_BLNV.astype(jnp.float32) * out_BLNV.astype(jnp.float32)).sum(-1) - dlse_BLN
    q_TBKRH = ring.query_tiles(q_BLNH, k)
    do_TBKRV = ring.query_tiles(do_BLNV.astype(v_BLKV.dtype), k)
    lse_TBKR = ring.query_tiles(lse_BLN[..., None], k)[..., 0]
    delta_TBKR = ring.query_tiles(delta_BLN[..., None], k)[..., 0]
    pos_TC, seg_TBC = ring.row_tiles(seg_BL, pos_L)

    def step(dq_TBKRH, block, dkv):
        def tile(dkv, xs):
            q_BKRH, do_BKRV, lse_BKR, delta_BKR, pos_C, seg_BC, dq_BKRH = xs

            def differentiate(grads, k_BUKH, v_BUKV, mask):
                return _ring_backward_block(
                    grads, q_BKRH, k_BUKH, v_BUKV, do_BKRV, lse_BKR, delta_BKR, mask
                )

            dks, dvs = list(dkv[0]), list(dkv[1])
            for j, half in enumerate(zip(*block)):
                grads = (dq_BKRH, dks[j], dvs[j])
                dq_BKRH, dks[j], dvs[j] = ring.seen(differentiate, grads, half, pos_C, seg_BC, g)
            return (tuple(dks), tuple(dvs)), dq_BKRH

        xs = (q_TBKRH, do_TBKRV, lse_TBKR, delta_TBKR, pos_TC, seg_TBC, dq_TBKRH)
        dkv, dq_TBKRH = jax.lax.scan(tile, dkv, xs)
        return dq_TBKRH, dkv

    block = tuple(map(ring.split, (k_BLKH, v_BLKV, seg_BL, pos_L)))
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dkv = (tuple(map(zeros, block[0])), tuple(map(zeros, block[1])))

    def hop(carry, _):
        block, dkv, dq_TBKRH = carry
        arriving = ring.rotate(block)
        dq_TBKRH, dkv = step(dq_TBKRH, block, dkv)
        return (arriving, ring.rotate(dkv), dq_TBKRH), None

    carry = (block, dkv, zeros(q_TBKRH))
    (block, dkv, dq_TBKRH), _ = jax.lax.scan(hop, carry, None, length=ring.shards - 1)
    dq_TBKRH, dkv = step(dq_TBKRH, block, dkv)
    dk_halves, dv_halves = ring.rotate(dkv)  # home: every shard has visited each block
    dq_BLNH = ring.rows(dq_TBKRH, g).astype(q_BLNH.dtype)
    dk_BLKH = ring.merge(dk_halves).astype(k_BLKH.dtype)
    dv_BLKV = ring.merge(dv_halves).astype(v_BLKV.dtype)
    return dq_BLNH, dk_BLKH, dv_BLKV


def ring_attention(
    q_BSNH,
    k_BTKH,
    v_BTKH,
    segment_ids_BS,
    *,
    query_block: int = QUERY_BLOCK,
    window: int | None = None,
    sinks_N=None,
):
    """`model.context_parallel: ring`: attention under `shard_map` over the mesh, each of the P
    sequence shards keeping its S/P query rows while the key/value blocks go around the ring
    (P - 1 hops forward, P backward). A shard's rows and its key block are each two halves
    of S/2P; a query tile (at most `query_block` rows) skips every key half that the causal
    mask or the window empties for it. In order, shard p computes 4p+3 of the 4P half-block
    products, and as each hop waits for its slowest shard every hop but the first costs 4;
    placed for load balance (`load_balanced`), every shard computes 2 per hop (3 on its own
    block), 2P+1 in all. Sinks scale each row's output by sigmoid(log-sum-exp - sink), outside
    the ring."""
    s = q_BSNH.shape[1]
    mesh = jax.sharding.get_abstract_mesh()
    p = sequence_shards()
    rules = current_rules()
    axes = mesh_axes(("length",), rules, dict(mesh.shape))[0]
    ring = _Ring(axes, p, window, *_ring_tiles(s // p, query_block))
    order = balanced_order(s, p) if rows_balanced() else np.arange(s)
    q_spec = logical_spec(("batch", "length", "act_heads", None), rules)
    kv_spec = logical_spec(("batch", "length", "act_kv_heads", None), rules)
    lse_spec = logical_spec(("batch", "length", "act_heads"), rules)
    inputs = (q_spec, kv_spec, kv_spec, logical_spec(("batch", "length"), rules))
    inputs = (*inputs, logical_spec(("length",), rules))
    outputs = (q_spec, lse_spec)
    forward = jax.shard_map(
        functools.partial(_ring_forward, ring),
        mesh=mesh,
        in_specs=inputs,
        out_specs=outputs,
        check_vma=False,
    )
    backward = jax.shard_map(
        functools.partial(_ring_backward, ring),
        mesh=mesh,
        in_specs=(*inputs, *outputs, *outputs),
        out_specs=inputs[:3],
        check_vma=False,
    )

    # One rule around the two programs over the shards; what the backward pass keeps is what
    # the forward returns (the shard's own inputs, output and log-sum-exp), no block or score.
    @jax.custom_vjp
    def ring_attention_(q_BSNH, k_BTKH, v_BTKH, seg_BS, pos_S):
        return forward(q_BSNH, k_BTKH, v_BTKH, seg_BS, pos_S)

    def forward_rule(*args):
        out_BSNV, lse_BSN = forward(*args)
        return (out_BSNV, lse_BSN), (*args, out_BSNV, lse_BSN)

    def backward_rule(residuals, cotangents):
        return (*backward(*residuals, *cotangents), None, None)

    ring_attention_.defvjp(forward_rule, backward_rule)
    out_BSNV, lse_BSN = ring_attention_(
        q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, jnp.asarray(order, jnp.int32)
    )
    if sinks_N is None:
        return out_BSNV
    # softmax over keys and a sink = the keys' softmax * sum / (sum + exp(sink)).
    kept_BSN = jax.nn.sigmoid(lse_BSN - sinks_N.astype(jnp.float32))
    return (out_BSNV * kept_BSN[..., None]).astype(out_BSNV.dtype)
