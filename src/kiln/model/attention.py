"""Attention implementations behind one signature, picked by `model.attention` per platform.

Every implementation is `fn(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS) -> out_BSNH`: causal
self-attention that stays inside each packed document (equal segment ids; padding is segment
0 and attends only to padding), grouped-query (query head n reads key/value head n // G),
softmax(q k^T / sqrt(H)) v with float32 scores. Values may be narrower than queries and keys
(multi-head latent attention): the output has the values' width. Einsum letters as in
`kiln.model.llama`, plus R = C*G query rows of one key/value head and P sequence shards.

Two keyword arguments change the mask and the softmax, each None for plain attention:
`window` W (sliding-window attention, a static int): a query at position i sees the keys at
i-W+1..i only (Hugging Face's `sliding_window`); `sinks_N` [N] float32 (attention sinks, as
GPT-OSS): one learned logit per query head that joins every row's softmax denominator without
a value (exp(sink) / (sum + exp(sink)) of the weight goes nowhere).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kiln.errors import KilnError
from kiln.parallel.mesh import constrain, current_rules, logical_spec, mesh_axes, traced_platform

# Masked scores: exp(MASKED - max) is exactly 0 in float32, so no gradient leaks through.
MASKED = float(jnp.finfo(jnp.float32).min)
# Query rows per attention block for long sequences: bounds the float32 scores held at once
# to [batch, heads, QUERY_BLOCK, keys].
QUERY_BLOCK = 512
# Keys and values whole along length (what every sequence shard's queries read).
_KV_WHOLE = ("batch", None, "act_kv_heads", None)
# Per-shard copies of the key/value tiles [B, P, S/C, C, K, H]: P split like the queries' length.
_KV_TILES = ("batch", "length", None, None, "act_kv_heads", None)
# Query and key rows per splash-attention kernel block (capped at the sequence length).
SPLASH_BLOCK = 512


def _sink_rows(sinks_N, k: int, c: int):
    """[K, R]: the sink logit of each query row of each key/value head (R = C*G, c-major)."""
    return jnp.tile(sinks_N.astype(jnp.float32).reshape(k, -1), (1, c))


def _softmax_with_sinks(scores_BKRT, sink_KR):
    """softmax over the keys and a sink per row (a logit with no value): the probabilities of
    the keys, which sum to less than 1."""
    max_BKR = jnp.maximum(scores_BKRT.max(axis=-1), sink_KR)
    exp_BKRT = jnp.exp(scores_BKRT - max_BKR[..., None])
    total_BKR = exp_BKRT.sum(axis=-1) + jnp.exp(sink_KR - max_BKR)
    return exp_BKRT / total_BKR[..., None]


def _rows(
    q_BCKGH, idx_C, seg_BC, k_BTKH, v_BTKH, seg_BT, window=None, sinks_N=None, key_idx_T=None
):
    """Attention of C query rows (at positions idx_C) over the T keys at positions key_idx_T
    (default 0..T-1)."""
    # The G query heads of a key/value head are folded into the rows, R = C*G (c-major, so
    # a sequence-sharded C stays evenly split): one batch and one free dimension a side,
    # which XLA runs markedly faster than two free dimensions on the query side.
    b, c, k, g, h = q_BCKGH.shape
    t = k_BTKH.shape[1]
    q_BKRH = q_BCKGH.transpose(0, 2, 1, 3, 4).reshape(b, k, c * g, h)
    scores_BKRT = jnp.einsum(
        "BKRH,BTKH->BKRT", q_BKRH, k_BTKH, preferred_element_type=jnp.float32
    ) * (h**-0.5)
    # Padding (segment 0) attends only to padding, so no row is ever fully masked.
    same_doc_BCT = seg_BC[:, :, None] == seg_BT[:, None, :]
    keys_T = jnp.arange(t) if key_idx_T is None else key_idx_T
    seen_CT = idx_C[:, None] >= keys_T[None, :]
    if window is not None:
        seen_CT &= idx_C[:, None] - keys_T[None, :] < window
    mask_BCT = same_doc_BCT & seen_CT[None]
    mask_BRT = jnp.broadcast_to(mask_BCT[:, :, None], (b, c, g, t)).reshape(b, c * g, t)
    scores_BKRT = jnp.where(mask_BRT[:, None], scores_BKRT, MASKED)
    if sinks_N is None:
        probs_BKRT = jax.nn.softmax(scores_BKRT, axis=-1)
    else:
        probs_BKRT = _softmax_with_sinks(scores_BKRT, _sink_rows(sinks_N, k, c))
    probs_BKRT = probs_BKRT.astype(v_BTKH.dtype)
    out_BKRH = jnp.einsum("BKRT,BTKH->BKRH", probs_BKRT, v_BTKH)
    return out_BKRH.reshape(b, k, c, g, v_BTKH.shape[-1]).transpose(0, 2, 1, 3, 4)


def dense_attention(
    q_BSNH,
    k_BTKH,
    v_BTKH,
    segment_ids_BS,
    *,
    query_block: int = QUERY_BLOCK,
    window: int | None = None,
    sinks_N=None,
    order=None,
):
    """Every query row against every key, masked afterwards (kiln's attention before skipping).
    `order` [S]: each row's position in its sequence when the rows are not in order (placed for
    load balance, `balanced_order`); None: row i is position i.

    Sequences longer than `query_block` (and a multiple of it) are processed `query_block`
    query rows at a time and recomputed in the backward pass, so the score matrix is never
    whole; the blocks are strided (block j holds rows j, j + S/query_block, ...) so that each
    block is split evenly when the sequence is sharded.
    """
    b, s, n, h = q_BSNH.shape
    k, hv = k_BTKH.shape[2], v_BTKH.shape[-1]
    # Every query shard reads all keys and values: gathered along length once, here.
    k_BTKH, v_BTKH = constrain(k_BTKH, _KV_WHOLE), constrain(v_BTKH, _KV_WHOLE)
    q_BSKGH = q_BSNH.reshape(b, s, k, n // k, h)
    key_idx_T = jnp.arange(s) if order is None else jnp.asarray(order, jnp.int32)
    rows = functools.partial(
        _rows,
        k_BTKH=k_BTKH,
        v_BTKH=v_BTKH,
        seg_BT=segment_ids_BS,
        window=window,
        sinks_N=sinks_N,
        key_idx_T=None if order is None else key_idx_T,
    )

    blocks = s // query_block if s > query_block and s % query_block == 0 else 1
    if blocks == 1:
        return rows(q_BSKGH, key_idx_T, segment_ids_BS).reshape(b, s, n, hv)
    # Row c * blocks + j goes to block j.
    q_JBCKGH = jnp.moveaxis(q_BSKGH.reshape(b, s // blocks, blocks, k, n // k, h), 2, 0)
    idx_JC = key_idx_T.reshape(s // blocks, blocks).T
    seg_JBC = jnp.moveaxis(segment_ids_BS.reshape(b, s // blocks, blocks), 2, 0)
    out_JBCKGH = jax.lax.map(
        jax.checkpoint(lambda a: rows(*a), prevent_cse=False), (q_JBCKGH, idx_JC, seg_JBC)
    )
    return jnp.moveaxis(out_JBCKGH, 0, 2).reshape(b, s, n, hv)


def cached_attention(
    q_BSNH,
    k_BTKH,
    v_BTKH,
    segment_ids_BS,
    segment_ids_BT,
    index,
    *,
    window=None,
    sinks_N=None,
    slots_T=None,
):
    """S new query rows at cache slots index..index+S-1 over a cache of T slots (decoding).

    Slot t is visible to the row at slot i when t <= i (and i - t < window) and their segment
    ids are equal: empty slots and padding (segment 0) are never seen by real tokens, so rows
    of different prompt lengths in one left-padded batch each attend to their own prompt only.
    `slots_T`: the slot of each key when the keys are not slots 0..T-1 in order (a rolling
    cache's ring, then the new tokens).
    """
    b, s, n, h = q_BSNH.shape
    k = k_BTKH.shape[2]
    idx_S = index + jnp.arange(s)
    q_BSKGH = q_BSNH.reshape(b, s, k, n // k, h)
    out = _rows(
        q_BSKGH, idx_S, segment_ids_BS, k_BTKH, v_BTKH, segment_ids_BT, window, sinks_N, slots_T
    )
    return out.reshape(b, s, n, v_BTKH.shape[-1])


def sequence_shards() -> int:
    """How many pieces the mesh of the code being traced cuts the `length` axis into (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    axes = mesh_axes(("length",), current_rules(), dict(mesh.shape))[0]
    return int(np.prod([mesh.shape[a] for a in axes]))


# ---------------------------------------------------------------------------------------------
# Context load balancing: under a causal mask the last of P sequence shards has the most keys to
# read. Placed for balance, shard p holds the sequence's chunks p and 2P-1-p of 2P (zigzag), so
# every shard's queries read as many keys as every other's. The train step places each batch so
# (`load_balanced`), and attention then masks by each row's position in its sequence.

_BALANCED = contextvars.ContextVar("kiln_load_balanced", default=False)


@contextlib.contextmanager
def load_balanced(on: bool = True):
    """Within: the [B, S] rows being traced are in `balanced_order` for the mesh's sequence
    shards (the train step's batch), so attention masks by position, not by row."""
    token = _BALANCED.set(on)
    try:
        yield
    finally:
        _BALANCED.reset(token)


def balanced_order(s: int, shards: int) -> np.ndarray:
    """[S]: the position in its sequence of each row placed for load balance over `shards`
    sequence shards: shard p's S/P rows are chunk p then chunk 2P-1-p of 2P equal chunks."""
    chunks = np.arange(s).reshape(2 * shards, s // (2 * shards))
    return np.concatenate([np.concatenate([chunks[p], chunks[-1 - p]]) for p in range(shards)])


def _fold_tables(
    shards: int, tiles: int, c: int, window: int | None, balanced: bool = False
) -> tuple[np.ndarray, ...]:
    """Per step i and shard p: the key tile and owner (0 low, 1 high, 2 none) of each product.

    Step i pairs each shard's local query tiles i (low) and tiles-1-i (high). A query tile q
    (index in the sequence) reads the key tiles from the first one its window reaches (0
    without a window) to q itself: in order and unwindowed, the low one reads 0..p*tiles+i and
    the high one 0..p*tiles+tiles-1-i, 2*p*tiles+tiles+1 tile products, padded with fully masked
    ones to the last shard's (2P-1)*tiles+1. `balanced` (`balanced_order`): shard p's local
    tiles i and tiles-1-i are tiles p*tiles/2+i and (2P-p)*tiles/2-1-i of the sequence, so every
    shard's step reads P*tiles+1 key tiles, and none is padding. A window of W keys bounds each
    query tile's to W/C + 2.
    """
    steps = tiles // 2

    def keys(q: int) -> range:
        first = 0 if window is None else max(0, (q * c - window + 1) // c)
        return range(first, q + 1)

    def query_tiles(i: int, p: int) -> tuple[int, int]:
        if balanced:
            return p * steps + i, (2 * shards - 1 - p) * steps + steps - 1 - i
        return p * tiles + i, p * tiles + tiles - 1 - i

    spans = {
        (i, p): tuple(keys(q) for q in query_tiles(i, p))
        for i in range(steps)
        for p in range(shards)
    }
    width = max(len(lo) + len(hi) for lo, hi in spans.values())
    key_tile = np.zeros((steps, shards, width), np.int32)
    owner = np.full((steps, shards, width), 2, np.int32)
    for (i, p), (lo, hi) in spans.items():
        key_tile[i, p, : len(lo)], owner[i, p, : len(lo)] = lo, 0
        key_tile[i, p, len(lo) : len(lo) + len(hi)], owner[i, p, len(lo) : len(lo) + len(hi)] = (
            hi,
            1,
        )
    return key_tile, owner


def _take_tiles(x_BPN, tile_PE, copies: bool):
    """[B, P, E, ...]: of each shard p's copy x_BPN[:, p] (N tiles), the tiles tile_PE[p].

    Without `copies`, x_BN has no P axis: one array that every shard reads.
    """
    if not copies:
        return jnp.take(x_BPN, tile_PE, axis=1)
    index = tile_PE.reshape(1, *tile_PE.shape, *(1,) * (x_BPN.ndim - 3))
    return jnp.take_along_axis(x_BPN, index, axis=2)


def _fold_step(xs, k_BPNUKH, v_BPNUKH, seg_BPNU, *, copies: bool, window=None, sinks_N=None):
    """One step of `causal_attention`: each shard's low and high query tile over its key tiles.

    Letters: P shards, E tile products, C query rows and U keys of a tile, N here the global
    key tiles (each shard reads its own copy of them). A product's key tile is `key_tile_PE` in
    the sequence and `source_PE` among the rows as placed. Its scores are masked by causality,
    document and owner; each query row's softmax runs over the products of its owner (low or
    high).
    """
    q_lo, q_hi, seg_lo, seg_hi, pos_lo, pos_hi, key_tile_PE, source_PE, owner_PE = xs
    b, p, c, k, g, h = q_lo.shape
    u = k_BPNUKH.shape[-3]
    e = key_tile_PE.shape[1]
    high_PE = owner_PE == 1
    q_BPECKGH = jnp.where(
        high_PE[None, :, :, None, None, None, None], q_hi[:, :, None], q_lo[:, :, None]
    )
    # Batch dimensions (B, P, K, E) leading and in the same order on both sides: XLA's CPU
    # dot then runs the many small tile products markedly faster than with K after the tiles.
    q_BPKERH = q_BPECKGH.transpose(0, 1, 4, 2, 3, 5, 6).reshape(b, p, k, e, c * g, h)
    k_BPKEUH = _take_tiles(k_BPNUKH, source_PE, copies).transpose(0, 1, 4, 2, 3, 5)
    v_BPKEUH = _take_tiles(v_BPNUKH, source_PE, copies).transpose(0, 1, 4, 2, 3, 5)
    scores_BPKERU = jnp.einsum(
        "BPKERH,BPKEUH->BPKERU", q_BPKERH, k_BPKEUH, preferred_element_type=jnp.float32
    )
    scores_BPEKRU = (scores_BPKERU * h**-0.5).transpose(0, 1, 3, 2, 4, 5)
    seg_q_BPEC = jnp.where(high_PE[None, :, :, None], seg_hi[:, :, None], seg_lo[:, :, None])
    pos_q_PEC = jnp.where(high_PE[:, :, None], pos_hi[:, None], pos_lo[:, None])
    pos_k_PEU = key_tile_PE[:, :, None] * u + jnp.arange(u)
    same_doc_BPECU = (
        seg_q_BPEC[..., :, None] == _take_tiles(seg_BPNU, source_PE, copies)[..., None, :]
    )
    causal_PECU = pos_q_PEC[..., :, None] >= pos_k_PEU[..., None, :]
    if window is not None:
        causal_PECU &= pos_q_PEC[..., :, None] - pos_k_PEU[..., None, :] < window
    # Padding products (owner 2) are masked whole; their row maxima are ignored below.
    mask_BPECU = same_doc_BPECU & (causal_PECU & (owner_PE < 2)[..., None, None])[None]
    mask_BPERU = jnp.broadcast_to(mask_BPECU[:, :, :, :, None], (b, p, e, c, g, u))
    scores_BPEKRU = jnp.where(mask_BPERU.reshape(b, p, e, 1, c * g, u), scores_BPEKRU, MASKED)
    owns = [(owner_PE == o)[None, :, :, None, None] for o in (0, 1)]
    row_max_BPEKR = scores_BPEKRU.max(axis=-1)
    max_lo, max_hi = (jnp.where(own, row_max_BPEKR, MASKED).max(axis=2) for own in owns)
    if sinks_N is not None:  # a row's sink joins its maximum and its sum
        sink_KR = _sink_rows(sinks_N, k, c)
        max_lo, max_hi = jnp.maximum(max_lo, sink_KR), jnp.maximum(max_hi, sink_KR)
    max_BPEKR = jnp.where(owns[1], max_hi[:, :, None], max_lo[:, :, None])
    # Masked scores give exp(MASKED - max) == 0 exactly; each row has its own key unmasked.
    exp_BPEKRU = jnp.exp(scores_BPEKRU - max_BPEKR[..., None])
    sums_BPEKR = exp_BPEKRU.sum(axis=-1)
    sum_lo, sum_hi = (jnp.where(own, sums_BPEKR, 0.0).sum(axis=2) for own in owns)
    if sinks_N is not None:
        sum_lo, sum_hi = sum_lo + jnp.exp(sink_KR - max_lo), sum_hi + jnp.exp(sink_KR - max_hi)
    sum_BPEKR = jnp.where(owns[1], sum_hi[:, :, None], sum_lo[:, :, None])
    # Normalised before the value product (as the dense path does), so that the backward
    # pass does not need that product's output and recomputes only the scores.
    probs_BPEKRU = (exp_BPEKRU / sum_BPEKR[..., None]).astype(v_BPNUKH.dtype)
    out_BPKERH = jnp.einsum(
        "BPKERU,BPKEUH->BPKERH",
        probs_BPEKRU.transpose(0, 1, 3, 2, 4, 5),
        v_BPKEUH,
        preferred_element_type=jnp.float32,
    )
    out_BPEKRH = out_BPKERH.transpose(0, 1, 3, 2, 4, 5)
    outs = []
    for own in owns:
        out_BPKRH = jnp.where(own[..., None], out_BPEKRH, 0.0).sum(axis=2)
        out_BPKCGH = out_BPKRH.reshape(b, p, k, c, g, -1).astype(v_BPNUKH.dtype)
        outs.append(out_BPKCGH.transpose(0, 1, 3, 2, 4, 5))
    return tuple(outs)


def causal_attention(
    q_BSNH,
    k_BTKH,
    v_BTKH,
    segment_ids_BS,
    *,
    query_block: int = QUERY_BLOCK,
    shards: int | None = None,
    window: int | None = None,
    sinks_N=None,
):
    """`dense_attention`, but key tiles wholly above the causal diagonal (or wholly before a
    `window`) are never computed.

    Each of the P sequence shards (`shards`; None = the traced mesh's) is cut into query
    tiles of C = query_block/(2P) rows. Step i of a `lax.map` takes, from every shard, its
    tiles i and last-i (so a step holds query_block rows, evenly split over the shards) and
    computes only the C x C tile products on or below the diagonal, a constant count per
    step: unsharded, (S/C + 1)/(2 S/C) of the dense scores (0.52 at S = 8192); sharded, the
    last shard's count bounds every shard's, (2P-1)/2P of dense at long sequences. Each step
    is recomputed in the backward pass. Keys and values are gathered along length once per
    call, so a sequence-sharded layer sums their gradients over the shards once, not once per
    step. Sequences of one block, sequences that are not a multiple of query_block, and meshes
    whose 2P does not divide query_block take the dense path (for one block, exactly its
    computation; with several, its key/value gradients are summed over the shards per block).
    """
    b, s, n, h = q_BSNH.shape
    k = k_BTKH.shape[2]
    p = sequence_shards() if shards is None else shards
    masks = dict(window=window, sinks_N=sinks_N)
    balanced = p > 1 and _BALANCED.get()
    order = balanced_order(s, p) if balanced else None
    if s <= query_block or s % query_block or query_block % (2 * p):
        return dense_attention(
            q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, query_block=query_block, order=order, **masks
        )
    c = query_block // (2 * p)
    tiles, steps = s // p // c, s // p // c // 2
    q_BPLCKGH = q_BSNH.reshape(b, p, tiles, c, k, n // k, h)
    seg_BPLC = segment_ids_BS.reshape(b, p, tiles, c)
    pos_PLC = jnp.asarray(np.arange(s) if order is None else order, jnp.int32).reshape(p, tiles, c)

    def lo_hi(x, axis):
        """Tiles 0..steps-1 and tiles-1..steps along `axis` (the local tiles), moved first."""
        lo = jax.lax.slice_in_dim(x, 0, steps, axis=axis)
        hi = jnp.flip(jax.lax.slice_in_dim(x, steps, tiles, axis=axis), axis)
        return jnp.moveaxis(lo, axis, 0), jnp.moveaxis(hi, axis, 0)

    key_tile, owner = _fold_tables(p, tiles, c, window, balanced)
    # Where each tile of the sequence is among the tiles as placed.
    placed = np.arange(s // c) if order is None else np.argsort(order[::c] // c)
    xs = (*lo_hi(q_BPLCKGH, 2), *lo_hi(seg_BPLC, 2), *lo_hi(pos_PLC, 1), key_tile)
    xs = (*xs, placed[key_tile].astype(np.int32), owner)

    def per_shard(x_BT, names):
        """[B, P, S/C, C, ...]: one copy of x's tiles per sequence shard, placed on that shard."""
        x_BNU = x_BT.reshape(b, s // c, c, *x_BT.shape[2:])
        if p == 1:  # unsharded: the one array
            return x_BNU
        return constrain(jnp.broadcast_to(x_BNU[:, None], (b, p, *x_BNU.shape[1:])), names)

    # Every shard reads all keys and values, from its own copy: the copies are gathered once,
    # before the loop, and in the backward pass each shard accumulates its key/value gradients
    # in its copy over the steps; they are summed over the shards once, after the loop. Read
    # from one replicated array, the partial gradients were all-reduced at every step.
    kv_tiles = (
        per_shard(k_BTKH, _KV_TILES),
        per_shard(v_BTKH, _KV_TILES),
        per_shard(segment_ids_BS, _KV_TILES[:4]),
    )
    step = jax.checkpoint(
        lambda xs: _fold_step(xs, *kv_tiles, copies=p > 1, **masks), prevent_cse=False
    )
    out_lo, out_hi = jax.lax.map(step, xs)
    out_LBPCKGH = jnp.concatenate([out_lo, jnp.flip(out_hi, 0)], axis=0)
    return jnp.moveaxis(out_LBPCKGH, 0, 2).reshape(b, s, n, v_BTKH.shape[-1])


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
    order = balanced_order(s, p) if _BALANCED.get() else np.arange(s)
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


def cudnn_arguments(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, window: int | None = None) -> dict:
    """Arguments of `jax.nn.dot_product_attention` for kiln's mask: causal and same document.

    JAX 0.10.2's `jax.nn.dot_product_attention` has no segment ids; packed documents are a
    boolean mask [B, 1, S, T] (same segment), which JAX turns into an additive bias that
    cuDNN reads from memory (B*S*T elements in the compute dtype), combined with cuDNN's own
    causal mask, which skips the blocks above the diagonal; a window is cuDNN's
    `local_window_size` (W-1 keys to the left, none to the right).
    """
    same_doc_B1ST = (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]
    return dict(
        query=q_BSNH,
        key=k_BTKH,
        value=v_BTKH,
        mask=same_doc_B1ST,
        is_causal=True,
        scale=q_BSNH.shape[-1] ** -0.5,
        local_window_size=None if window is None else (window - 1, 0),
    )


HALF = (jnp.bfloat16, jnp.float16)


def check(name: str, platform: str, dtype, *, sinks: bool = False) -> None:
    """Refuse, in one line, an implementation that cannot run on `platform` for this `dtype`
    (or, `sinks`, for a model with attention sinks)."""
    if name == "cudnn" and sinks:
        raise KilnError(
            "model.attention: 'cudnn' has no attention sinks (model.attention_sinks: true); "
            "use 'xla'"
        )
    needs = {"cudnn": "gpu", "splash": "tpu"}.get(name)
    if needs is not None and platform != needs:
        raise KilnError(
            f"model.attention: got {name!r}, which runs on {needs.upper()} only, but the "
            f"devices are {platform!r}; use 'auto' or 'xla'"
        )
    if name == "cudnn" and jnp.dtype(dtype) not in HALF:
        raise KilnError(
            f"model.attention: 'cudnn' needs model.dtype bfloat16 or float16, got "
            f"{jnp.dtype(dtype).name}; use 'xla' for float32"
        )


def cudnn_attention(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, *, window=None, sinks_N=None):
    """cuDNN's fused attention (`jax.nn.dot_product_attention`), bf16/fp16 on NVIDIA GPUs.
    It has no attention sinks (refused when the model has them, `check`)."""
    check("cudnn", traced_platform(), q_BSNH.dtype, sinks=sinks_N is not None)
    k_BTKH, v_BTKH = constrain(k_BTKH, _KV_WHOLE), constrain(v_BTKH, _KV_WHOLE)
    args = cudnn_arguments(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, window)
    try:
        return jax.nn.dot_product_attention(**args, implementation="cudnn")
    except (NotImplementedError, ValueError, RuntimeError) as e:
        raise KilnError(f"model.attention: 'cudnn' refused this model: {e}; use 'xla'") from e


def splash_attention(
    q_BSNH,
    k_BTKH,
    v_BTKH,
    segment_ids_BS,
    *,
    block: int = SPLASH_BLOCK,
    interpret: bool = False,
    window: int | None = None,
    sinks_N=None,
):
    """Pallas splash attention (TPU), under `shard_map` over batch and heads.

    Inside each shard one kernel call per batch row (vmapped), with a causal mask (a
    `LocalMask` of W-1 keys to the left with a window), the segment ids and the sinks (the
    kernel's own); the kernel skips the blocks the mask empties. On a sequence-sharded mesh
    (`model.context_parallel: all_gather`) each shard keeps its own queries and reads the
    keys and values gathered whole: the kernel is made for the whole [S, S] mask split into
    the shards' query rows (`q_seq_shards`), its mask blocks passed into the `shard_map` split
    the same way, so each shard computes only its rows' attention. Under load balance a
    shard's rows are chunks p and 2P-1-p: the mask's query positions are those
    (`balanced_order`), and the gathered keys go back in order inside the shard.
    `interpret=True` runs the kernel in Pallas' interpreter (CPU; tests only).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if not interpret:
        check("splash", traced_platform(), q_BSNH.dtype)
    s, h = q_BSNH.shape[1], q_BSNH.shape[3]
    blk = min(block, s)
    if s % blk or blk % 128:
        raise KilnError(
            f"model.attention: 'splash' needs data.seq_len a multiple of 128 (and of {block} "
            f"when longer), got {s}"
        )

    def make_kernel(heads: int, head_shards: int = 1, q_shards: int = 1, rows=None):
        """The kernel for `heads` query heads over the [S, S] mask, its query rows at positions
        `rows` (None: in order), split into `q_shards` pieces and the heads into
        `head_shards`; query blocks no longer than a piece."""
        bq = min(blk, s // q_shards)
        if (s // q_shards) % bq or bq % 128:
            raise KilnError(
                f"model.attention: 'splash' on {q_shards} sequence shards needs data.seq_len / "
                f"{q_shards} a multiple of 128 (and of {block} when longer), got {s // q_shards}"
            )
        if window is None:
            one = splash.CausalMask((s, s))
        else:
            one = splash.LocalMask((s, s), window_size=(window - 1, 0), offset=0)
        if rows is not None:
            one.q_sequence = rows.astype(np.int32)
        sizes = dict(block_q=bq, block_kv=blk, block_q_dkv=bq, block_kv_dkv=blk)
        sizes.update(block_q_dq=bq, block_kv_dq=blk)
        return splash.make_splash_mha(
            splash.MultiHeadMask([one] * heads),
            block_sizes=splash.BlockSizes(**sizes),
            head_shards=head_shards,
            q_seq_shards=q_shards,
            interpret=interpret,
        )

    def run(kernel, q_BSNH, k_BTKH, v_BTKH, seg_BS, seg_BT, sinks_N):
        # The kernel does not scale the scores: scale the queries (exact for H a power of 4).
        q_BNSH = (q_BSNH * h**-0.5).astype(q_BSNH.dtype).transpose(0, 2, 1, 3)
        k_BKTH, v_BKTH = k_BTKH.transpose(0, 2, 1, 3), v_BTKH.transpose(0, 2, 1, 3)
        segments = splash.SegmentIds(q=seg_BS, kv=seg_BT)
        if sinks_N is None:
            out_BNSH = jax.vmap(kernel)(q_BNSH, k_BKTH, v_BKTH, segments)
        else:
            sinks_N = sinks_N.astype(jnp.float32)
            out_BNSH = jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(
                q_BNSH, k_BKTH, v_BKTH, segments, sinks_N
            )
        return out_BNSH.transpose(0, 2, 1, 3)

    def per_shard(q_BSNH, k_BTKH, v_BTKH, seg_BS, sinks_N):
        kernel = make_kernel(q_BSNH.shape[2])
        return run(kernel, q_BSNH, k_BTKH, v_BTKH, seg_BS, seg_BS, sinks_N)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return per_shard(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, sinks_N)
    rules = current_rules()
    kv_spec = logical_spec(("batch", None, "act_kv_heads", None), rules)
    sinks_spec = None if sinks_N is None else logical_spec(("act_heads",), rules)
    p = sequence_shards()
    if p == 1:
        q_spec = logical_spec(("batch", None, "act_heads", None), rules)
        seg_spec = logical_spec(("batch", None), rules)
        return jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, seg_spec, sinks_spec),
            out_specs=q_spec,
            check_vma=False,
        )(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, sinks_N)

    # Sequence shards: each keeps its query rows; keys, values and their segment ids whole.
    heads_axes, seq_axes = mesh_axes(("act_heads", "length"), rules, dict(mesh.shape))
    balanced = _BALANCED.get()
    order = balanced_order(s, p) if balanced else None
    kernel = make_kernel(
        q_BSNH.shape[2],
        head_shards=int(np.prod([mesh.shape[a] for a in heads_axes])),
        q_shards=p,
        rows=order,
    )
    spec = jax.sharding.PartitionSpec(heads_axes or None, seq_axes)
    kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, spec))
    back = None if order is None else np.argsort(order)

    def per_rows(kernel, q_BSNH, k_BTKH, v_BTKH, seg_BS, seg_BT, sinks_N):
        if back is not None:  # the gathered keys are in balanced order: back in order
            k_BTKH, v_BTKH, seg_BT = (jnp.take(x, back, axis=1) for x in (k_BTKH, v_BTKH, seg_BT))
        return run(kernel, q_BSNH, k_BTKH, v_BTKH, seg_BS, seg_BT, sinks_N)

    q_spec = logical_spec(("batch", "length", "act_heads", None), rules)
    seg_q_spec = logical_spec(("batch", "length"), rules)
    seg_kv_spec = logical_spec(("batch", None), rules)
    return jax.shard_map(
        per_rows,
        mesh=mesh,
        in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, seg_q_spec, seg_kv_spec, sinks_spec),
        out_specs=q_spec,
        check_vma=False,
    )(kernel, q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, segment_ids_BS, sinks_N)


IMPLEMENTATIONS = {
    "xla": causal_attention,
    "cudnn": cudnn_attention,
    "splash": splash_attention,
}
# What `auto` picks per platform; a GPU falls back to `xla` unless the compute dtype is
# bf16/fp16 (cuDNN's fused attention has no float32 kernel).
AUTO = {"tpu": "splash", "gpu": "cudnn", "cpu": "xla"}


def resolve(name: str, dtype) -> str:
    """The implementation `model.attention=name` runs for `dtype` activations on this platform."""
    if name != "auto":
        return name
    chosen = AUTO.get(traced_platform(), "xla")
    if chosen == "cudnn" and jnp.dtype(dtype) not in HALF:
        return "xla"
    return chosen


def attention(
    q_BSNH,
    k_BTKH,
    v_BTKH,
    segment_ids_BS,
    *,
    implementation: str = "auto",
    context: str = "all_gather",
    window: int | None = None,
    sinks_N=None,
):
    """Causal, same-document, grouped-query attention by `implementation` (a `model.attention`),
    within a sliding `window` and with attention sinks when given (module docstring). On a
    sequence-sharded mesh, `context` (`model.context_parallel`) says how every shard's queries
    reach all keys: `all_gather` (gathered once per layer, then `implementation`) or `ring`
    (`ring_attention`, kiln's own blocks whatever the platform).

    Values narrower than the queries go through `xla` as they are; the fused kernels (splash,
    cuDNN) take one head width, so they get the values zero-padded to it and the output is
    cut back (the padded columns of the output are exactly 0).
    """
    p = sequence_shards()
    if context == "ring" and p > 1:
        return ring_attention(
            q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, window=window, sinks_N=sinks_N
        )
    name = resolve(implementation, q_BSNH.dtype)
    h, hv = q_BSNH.shape[-1], v_BTKH.shape[-1]
    fn = functools.partial(IMPLEMENTATIONS[name], window=window, sinks_N=sinks_N)
    if name == "cudnn" and p > 1 and _BALANCED.get():
        # cuDNN sees the whole sequence in order: rows back in order for it (splash places
        # the rows of a balanced shard itself).
        order = balanced_order(q_BSNH.shape[1], p)
        back, kernel = np.argsort(order), fn

        def fn(q, k, v, seg):
            q, k, v, seg = (jnp.take(x, back, axis=1) for x in (q, k, v, seg))
            return jnp.take(kernel(q, k, v, seg), order, axis=1)

    if name == "xla" or hv == h:
        return fn(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS)
    if hv > h:
        raise KilnError(
            f"model.attention: {name!r} needs values no wider than queries, got {hv} > {h}; "
            "use 'xla'"
        )
    v_BTKH = jnp.pad(v_BTKH, ((0, 0), (0, 0), (0, 0), (0, h - hv)))
    return fn(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS)[..., :hv]
