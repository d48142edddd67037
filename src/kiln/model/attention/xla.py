"""kiln's own attention in XLA operations: every query row against every key
(`dense_attention`), the decode step against a cache (`cached_attention`), and causal attention
that skips the key tiles the mask empties (`causal_attention`, `model.attention: xla`), with the
rows placed for context load balance (`load_balanced`).

The contract (signature, mask, window, sinks) and the einsum letters: `kiln.model.attention`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kiln.parallel.mesh import constrain, current_rules, mesh_axes

# Masked scores: exp(MASKED - max) is exactly 0 in float32, so no gradient leaks through.
MASKED = float(jnp.finfo(jnp.float32).min)
# Query rows per attention block for long sequences: bounds the float32 scores held at once
# to [batch, heads, QUERY_BLOCK, keys].
QUERY_BLOCK = 512
# Keys and values whole along length (what every sequence shard's queries read).
KV_WHOLE = ("batch", None, "act_kv_heads", None)
# Per-shard copies of the key/value tiles [B, P, S/C, C, K, H]: P split like the queries' length.
_KV_TILES = ("batch", "length", None, None, "act_kv_heads", None)


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
    k_BTKH, v_BTKH = constrain(k_BTKH, KV_WHOLE), constrain(v_BTKH, KV_WHOLE)
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


def rows_balanced() -> bool:
    """Whether the [B, S] rows being traced are in `balanced_order` (within `load_balanced`)."""
    return _BALANCED.get()


def balanced_order(s: int, shards: int) -> np.ndarray:
    """[S]: the position in its sequence of each row placed for load balance over `shards`
    sequence shards: shard p's S/P rows are chunk p then chunk 2P-1-p of 2P equal chunks."""
    chunks = np.arange(s).reshape(2 * shards, s // (2 * shards))
    return np.concatenate([np.concatenate([chunks[p], chunks[-1 - p]]) for p in range(shards)])


def fold_tables(
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

    key_tile, owner = fold_tables(p, tiles, c, window, balanced)
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
