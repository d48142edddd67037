"""The offline soft loss from a teacher's stored top-k logits: chunk callback and per-token API.

Per token the store holds the teacher's K largest logits v_i (after its soft-cap), their ids,
and lse = logsumexp(teacher / T) over the whole vocabulary. With b = student / T, q = softmax(b)
and the teacher's tempered probabilities of the stored ids p_i = exp(v_i / T - lse):

tail bucket (default): the ids outside the top-k form one bucket,

    p_tail = max(1 - sum_i p_i, 0)   (0 when K = V),   q_tail = sum_{j not in top-k} q_j
    soft   = T^2 [sum_i p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail)]
    d soft / d student_j = T (M q_j - r_j),  r_j = p_j on the top-k, p_tail q_j / q_tail off it

with M = sum_i p_i + p_tail (1, unless rounded stored values make sum_i p_i exceed 1). It is
the online soft loss with the teacher's distribution replaced by r; with K = V it is the online
soft loss. log q_tail = logsumexp_{j not in top-k} b_j - logsumexp_j b_j, never log(1 - sum_i q_i)
(which cancels when the top-k hold almost all of q).

renormalised: p'_i = softmax_i(v_i / T) and q'_i = softmax_i(b_i) over the K ids only,

    soft = T^2 sum_i p'_i (log p'_i - log q'_i),  d soft / d student_j = T (q'_j - p'_j) on the
    top-k, 0 elsewhere.

As in `kl`, a KL is evaluated as a sum of non-negative terms, sum over buckets of q g(d) with
d = log p - log q and g(d) = e^d (d - 1) + 1, plus M - 1 (the terms' p sum to M, their q to 1).
An error e in the student's log-normaliser then changes the value by e (M - 1) + O(e^2) only.

Tiled, a block of the student's vocabulary meets the top-k ids that fall in it: a scatter marks
them, a gather reads their logits. The statistics (the student's logits at the K ids, and the
max and sum of exponentials of the block's other entries) merge across vocabulary chunks and
shards; the teacher's rows ride along unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kiln.losses.core import ChunkLogits, TopK, check_temperature, f32, pmax, psum
from kiln.losses.kl import _SERIES, SoftTerm, _expm1_minus_x


class LSE(NamedTuple):
    """Max m (-inf for no entries) and s = sum exp(x - m) of a piece of a row."""

    m: jax.Array
    s: jax.Array


def _finite(m):
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _lse_merge(a: LSE, b: LSE) -> LSE:
    m = jnp.maximum(a.m, b.m)
    c = _finite(m)
    return LSE(m, a.s * jnp.exp(a.m - c) + b.s * jnp.exp(b.m - c))


def _lse_reduce(a: LSE, axes: tuple[str, ...]) -> LSE:
    if not axes:
        return a
    m = jax.lax.pmax(a.m, axes)
    return LSE(m, jax.lax.psum(a.s * jnp.exp(a.m - _finite(m)), axes))


def _lse_value(a: LSE) -> jax.Array:
    """log sum exp; -inf for an empty piece."""
    return a.m + jnp.log(a.s)


def _masked_lse(x_nc: jax.Array, skip_nc: jax.Array, axes: tuple[str, ...]) -> LSE:
    """`LSE` of each row's entries where `skip` is False (rows sharded over mesh `axes`)."""
    m = pmax(jnp.max(jnp.where(skip_nc, -jnp.inf, x_nc), axis=-1), axes)
    e = jnp.where(skip_nc, 0.0, jnp.exp(x_nc - _finite(m)[..., None]))
    return LSE(m, psum(jnp.sum(e, axis=-1), axes))


def _per_row(f, ndim: int):
    for _ in range(ndim - 1):
        f = jax.vmap(f)
    return f


def scatter(col_nK: jax.Array, vals_nK: jax.Array, width: int, fill) -> jax.Array:
    """[..., width] of `fill` with vals_nK at columns col_nK (a column >= width is dropped)."""

    def row(col, vals):
        return jnp.full((width,), fill, vals.dtype).at[col].set(vals, mode="drop")

    return _per_row(row, col_nK.ndim)(col_nK, vals_nK)


def gather(x_nc: jax.Array, col_nK: jax.Array) -> jax.Array:
    """x at columns col_nK, 0 where the column is outside the block (>= its width)."""
    width = x_nc.shape[-1]
    got = jnp.take_along_axis(x_nc, jnp.minimum(col_nK, width - 1), axis=-1)
    return jnp.where(col_nK < width, got, 0.0)


def block_columns(ids_nK: jax.Array, first, width: int) -> jax.Array:
    """Each id's column in the block of `width` ids from `first`, or `width` if not in it."""
    col = ids_nK - first
    return jnp.where((col >= 0) & (col < width), col, width)


def _g_terms(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """q g(d) = p (log p - log q) - p + q >= 0 per entry, d = log p - log q; 0 log 0 = 0."""
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    d = log_p - log_q
    small = jnp.abs(d) <= _SERIES
    ds = jnp.clip(d, -_SERIES, _SERIES)
    near = q * (ds * ds + (ds - 1.0) * _expm1_minus_x(ds))
    far = jnp.where(p > 0, p * (jnp.where(p > 0, d, 0.0) - 1.0), 0.0) + q
    return jnp.where(small, near, far)


class TopKStats(NamedTuple):
    """The student's logits at the top-k ids, the normaliser of its others, the teacher's rows."""

    x_top: jax.Array  # [n, K] soft-capped student logits at the ids (0 for ids in no block)
    tail: LSE | None  # of b = student / T over the ids outside the top-k; None if renormalised
    top: TopK


class Rows(NamedTuple):
    """Per-token log-probabilities of the top-k entries and of the tail bucket."""

    log_p: jax.Array  # [n, K] teacher's
    log_q: jax.Array  # [n, K] student's
    lse_b: jax.Array  # [n] the student's log-normaliser of b (over the top-k if renormalised)
    p_tail: jax.Array  # [n]
    lse_tail: jax.Array  # [n] logsumexp of b over the tail (-inf when it is empty)
    mass: jax.Array  # [n] M = sum_i p_i + p_tail


@dataclasses.dataclass(frozen=True)
class TopKKL(SoftTerm):
    """Chunk callback: per-token `soft` from the teacher's stored top-k, differentiable in the student."""

    vocab: int
    renormalize: bool = False
    name: str = "soft"

    def stats(self, lg: ChunkLogits, axes: tuple[str, ...]) -> TopKStats:
        x_top = psum(gather(lg.student, lg.top_col), axes)
        tail = None
        if not self.renormalize:
            width = lg.student.shape[-1]
            in_top = scatter(lg.top_col, jnp.ones(lg.top_col.shape, bool), width, False)
            tail = _masked_lse(lg.student / lg.temperature, in_top, axes)
        return TopKStats(x_top, tail, lg.top)

    def merge(self, x: TopKStats, y: TopKStats) -> TopKStats:
        tail = None if x.tail is None else _lse_merge(x.tail, y.tail)
        return TopKStats(x.x_top + y.x_top, tail, x.top)

    def reduce(self, st: TopKStats, axes: tuple[str, ...]) -> TopKStats:
        tail = None if st.tail is None else _lse_reduce(st.tail, axes)
        return TopKStats(psum(st.x_top, axes), tail, st.top)

    def sums(self, lg: ChunkLogits, st: TopKStats) -> tuple:
        return ()  # everything is in the statistics

    def rows(self, st: TopKStats, t: jax.Array) -> Rows:
        b, v = st.x_top / t, st.top.values.astype(f32) / t
        m = jnp.max(b, axis=-1)
        top = LSE(m, jnp.sum(jnp.exp(b - m[..., None]), axis=-1))
        zero = jnp.zeros_like(m)
        if self.renormalize:
            lse_b = _lse_value(top)
            log_p = jax.nn.log_softmax(v, axis=-1)
            return Rows(log_p, b - lse_b[..., None], lse_b, zero, zero - jnp.inf, zero + 1.0)
        full = _lse_merge(top, st.tail)
        lse_b = _lse_value(full)
        log_p = v - st.top.lse.astype(f32)[..., None]
        p_top = jnp.sum(jnp.exp(log_p), axis=-1)
        p_tail = zero if v.shape[-1] >= self.vocab else jnp.maximum(1.0 - p_top, 0.0)
        return Rows(log_p, b - lse_b[..., None], lse_b, p_tail, _lse_value(st.tail), p_top + p_tail)

    def values(self, st: TopKStats, sums, valid_n, temperature) -> dict[str, jax.Array]:
        r = self.rows(st, temperature)
        kl = jnp.sum(_g_terms(r.log_p, r.log_q), axis=-1)
        if not self.renormalize:
            log_q_tail = r.lse_tail - r.lse_b
            # p_tail = 0 (or K = V, an empty tail): the bucket's term is q_tail.
            some = r.p_tail > 0
            log_p_tail = jnp.log(jnp.where(some, r.p_tail, 1.0))
            tail = _g_terms(log_p_tail, jnp.where(some, log_q_tail, 0.0))
            kl = kl + jnp.where(some, tail, jnp.exp(log_q_tail)) + (r.mass - 1.0)
        return {self.name: jnp.square(temperature) * jnp.maximum(kl, 0.0)}

    def dlogits(self, lg: ChunkLogits, st: TopKStats, cts: dict[str, jax.Array]):
        ct = cts.get(self.name)
        if ct is None:
            return None
        t = lg.temperature
        r = self.rows(st, t)
        b = lg.student / t
        # The teacher's probabilities at the block's top-k entries; -1 marks the others.
        p_block = scatter(lg.top_col, jnp.exp(r.log_p), b.shape[-1], -1.0)
        in_top = p_block >= 0
        q = jnp.exp(b - r.lse_b[..., None])
        if self.renormalize:
            g = jnp.where(in_top, q - p_block, 0.0)
        else:
            tail = r.p_tail[..., None] * jnp.exp(b - _finite(r.lse_tail)[..., None])
            g = r.mass[..., None] * q - jnp.where(in_top, p_block, tail)
        return (ct * t)[..., None] * g


def teacher_stats(top: TopK, targets: jax.Array, temperature, vocab: int):
    """Per token: 1.0 if the target is among the stored ids (else 0.0), and the tail mass p_tail."""
    hit = jnp.any(top.ids == targets[..., None], axis=-1).astype(f32)
    if top.ids.shape[-1] >= vocab:
        return hit, jnp.zeros(hit.shape, f32)
    log_p = top.values.astype(f32) / temperature - top.lse.astype(f32)[..., None]
    return hit, jnp.maximum(1.0 - jnp.sum(jnp.exp(log_p), axis=-1), 0.0)


def _whole(student, top: TopK, temperature, renormalize: bool):
    """The `TopKKL` callback on whole logits [..., V] (one block: no reshape, shardings kept)."""
    vocab = student.shape[-1]
    top = TopK(top.values.astype(f32), top.ids, top.lse.astype(f32))
    lg = ChunkLogits(
        student.astype(f32), None, None, temperature, top=top,
        top_col=block_columns(top.ids, 0, vocab),
    )  # fmt: skip
    kl = TopKKL(vocab, renormalize)
    return lg, kl, kl.stats(lg, ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _top_k_soft(student, top, temperature, renormalize):
    return _top_k_soft_fwd(student, top, temperature, renormalize)[0]


def _top_k_soft_fwd(student, top, temperature, renormalize):
    _, kl, st = _whole(student, top, temperature, renormalize)
    return kl.values(st, (), None, temperature)[kl.name], (student, top, temperature)


def _top_k_soft_bwd(renormalize, res, ct):
    student, top, t = res
    lg, kl, st = _whole(student, top, t, renormalize)
    grad = kl.dlogits(lg, st, {kl.name: ct.astype(f32)})
    d_top = TopK(
        jnp.zeros_like(top.values), np.zeros(top.ids.shape, jax.dtypes.float0),
        jnp.zeros_like(top.lse),
    )  # fmt: skip
    return grad.astype(student.dtype), d_top, jnp.zeros_like(t)


_top_k_soft.defvjp(_top_k_soft_fwd, _top_k_soft_bwd)


def top_k_soft_loss(
    student_logits: jax.Array, top: TopK, temperature: float | jax.Array, *, renormalize=False
) -> jax.Array:
    """Per-token soft loss [...] of student logits [..., V] against a teacher's stored top-k.

    The tail-bucket or renormalised `T^2 KL` of the module docstring, float32. The stored rows
    and the temperature (the one the stored lse was computed at) are constants: only the
    student's logits get a gradient, `T (M q - r)` or `T (q' - p')`.
    """
    temperature = check_temperature(temperature)
    return _top_k_soft(student_logits, top, jnp.asarray(temperature, f32), bool(renormalize))
