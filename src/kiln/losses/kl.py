"""The soft loss T^2 KL(softmax(teacher / T) || softmax(student / T)): chunk callback and per-token API.

With a = teacher / T, b = student / T, p = softmax(a), q = softmax(b) and
d_v = log p_v - log q_v, KL = sum_v p_v d_v = sum_v q_v g(d_v) with g(d) = e^d (d - 1) + 1 >= 0.
The second form is a sum of non-negative terms, so a small KL keeps float32 *relative*
precision (the first loses ~1e-7 absolute to cancellation, and comes out negative). It is
evaluated without forming the difference of two log-normalisers exactly: for any shift c0
(here the float32 estimate of lse(a) - lse(b)) and d' = (teacher - student) / T - c0,

    Z = E_q[e^d'],   KL = E_q[g(d')] / Z - (log Z - 1 + 1/Z),

exact whatever c0's rounding error (then Z = 1 + O(1e-7) and the last term is O(1e-14)).
Near d' = 0, g(d') = d'^2 + (d' - 1) E(d') and e^d' - 1 = d' + E(d') with E(d) = e^d - 1 - d
from its Taylor series (|d'| <= 1/2, terms to d^9: relative error < 1e-7); elsewhere
q g(d') = p (d' - 1) + q from the two softmaxes, which needs no further exponential.
The gradient w.r.t. the student's logits is T (q - p).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kiln.losses.core import (
    ChunkLogits,
    Normaliser,
    check_temperature,
    f32,
    merge,
    normaliser,
    reduce,
)

_SERIES = 0.5  # |d'| up to which g and e^d' - 1 come from the Taylor series of E


class KLStats(NamedTuple):
    """Normalisers of the teacher's (a) and the student's (b) logits over T."""

    a: Normaliser
    b: Normaliser


class KLSums(NamedTuple):
    """Per-token sums over the vocabulary: E_q[g(d')], E_q[e^d' - 1] and sum q, unnormalised."""

    g: jax.Array
    u: jax.Array
    q: jax.Array


def _expm1_minus_x(d):
    """e^d - 1 - d for |d| <= 1/2 by Horner's rule (Taylor terms d^2/2! ... d^9/9!)."""
    acc = jnp.full_like(d, 1.0 / 362880.0)
    for k in (40320.0, 5040.0, 720.0, 120.0, 24.0, 6.0, 2.0):
        acc = acc * d + 1.0 / k
    return acc * d * d


def _log_ratio_excess(w):
    """h(Z) = log Z - 1 + 1/Z at Z = 1 + w, without cancellation for small w."""
    series = w * w * (0.5 - w * (2.0 / 3.0 - 0.75 * w))
    return jnp.where(jnp.abs(w) < 1e-3, series, jnp.log1p(w) - w / (1.0 + w))


def _add(a, b):
    return tuple(x + y for x, y in zip(a, b))


def _row_sums(*xs_nV, block: int = 4096):
    """Sums over the last axis of several arrays in one pass (a variadic reduction).

    A single reduction over the chunk instead of one per array cuts the soft loss's
    elementwise time on CPU; summing blocks of `block` entries first keeps the rounding of
    long rows near float32 level (a flat variadic reduce adds sequentially: ~2e-5 relative
    at 32k entries, ~4e-6 with blocks of 4096).
    """
    vocab = xs_nV[0].shape[-1]
    blocked = vocab % block == 0 and vocab > block
    if blocked:
        xs_nV = tuple(x.reshape(*x.shape[:-1], vocab // block, block) for x in xs_nV)
    zeros = (jnp.zeros((), f32),) * len(xs_nV)
    partial = jax.lax.reduce(xs_nV, zeros, _add, (xs_nV[0].ndim - 1,))
    return tuple(jnp.sum(p, axis=-1) for p in partial) if blocked else partial


@dataclasses.dataclass(frozen=True)
class SoftKL:
    """Chunk callback: per-token `soft` = T^2 KL(teacher_T || student_T), differentiable in the student."""

    name: str = "soft"

    @property
    def terms(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def differentiable(self) -> tuple[str, ...]:
        return (self.name,)

    def stats(self, lg: ChunkLogits, axes: tuple[str, ...]) -> KLStats:
        t = lg.temperature
        a = normaliser(lg.teacher / t, axes, shifted_sum=False)
        return KLStats(a, normaliser(lg.student / t, axes, shifted_sum=False))

    def merge(self, x: KLStats, y: KLStats) -> KLStats:
        return KLStats(merge(x.a, y.a), merge(x.b, y.b))

    def reduce(self, st: KLStats, axes: tuple[str, ...]) -> KLStats:
        return KLStats(reduce(st.a, axes), reduce(st.b, axes))

    def probs(self, lg: ChunkLogits, st: KLStats) -> tuple[jax.Array, jax.Array]:
        """(p, q): the teacher's and the student's softmax at temperature T on this chunk."""
        t = lg.temperature
        p = jnp.exp(lg.teacher / t - st.a.m[..., None]) / st.a.s[..., None]
        q = jnp.exp(lg.student / t - st.b.m[..., None]) / st.b.s[..., None]
        return p, q

    def log_ratio(self, lg: ChunkLogits, st: KLStats) -> jax.Array:
        """d' = (teacher - student) / T - c0 ~ log p - log q; the difference first, so it is exact."""
        c0 = (st.a.m - st.b.m) + jnp.log(st.a.s / st.b.s)
        return (lg.teacher - lg.student) / lg.temperature - c0[..., None]

    def sums(self, lg: ChunkLogits, st: KLStats) -> KLSums:
        p, q = self.probs(lg, st)
        d = self.log_ratio(lg, st)
        small = jnp.abs(d) <= _SERIES
        e = _expm1_minus_x(d)
        g = jnp.where(small, q * (d * d + (d - 1.0) * e), p * (d - 1.0) + q)
        u = jnp.where(small, q * (d + e), p - q)
        return KLSums(*_row_sums(g, u, q))

    def values(self, st, sums: KLSums, valid_n, temperature) -> dict[str, jax.Array]:
        w = sums.u / sums.q
        kl = (sums.g / sums.q) / (1.0 + w) - _log_ratio_excess(w)
        # Only rounding can make it negative (by ~1e-21 at identical logits): clamp.
        return {self.name: jnp.square(temperature) * jnp.maximum(kl, 0.0)}

    def dlogits(self, lg: ChunkLogits, st: KLStats, cts: dict[str, jax.Array]):
        ct = cts.get(self.name)
        if ct is None:
            return None
        p, q = self.probs(lg, st)
        return (ct * lg.temperature)[..., None] * (q - p)


def _rows(student, teacher, temperature):
    """The `SoftKL` callback on logits [..., V] (no reshape: shardings stay as given)."""
    lg = ChunkLogits(student.astype(f32), teacher.astype(f32), None, temperature)
    kl = SoftKL()
    return lg, kl, kl.stats(lg, ())


@jax.custom_vjp
def _soft_loss(student, teacher, temperature):
    return _soft_loss_fwd(student, teacher, temperature)[0]


def _soft_loss_fwd(student, teacher, temperature):
    lg, kl, st = _rows(student, teacher, temperature)
    soft = kl.values(st, kl.sums(lg, st), None, temperature)["soft"]
    return soft, (student, teacher, temperature, st, soft)


def _soft_loss_bwd(res, ct):
    """Exact: d/d student = T (q - p), d/d teacher = T p (d - KL), d/dT from both and the T^2."""
    student, teacher, t, st, soft = res
    lg, kl, _ = _rows(student, teacher, t)
    ct = ct.astype(f32)[..., None]
    p, q = kl.probs(lg, st)
    d_b = q - p  # d KL / d b
    d_a = p * (kl.log_ratio(lg, st) - (soft / jnp.square(t))[..., None])  # d KL / d a
    # d/dT of T^2 KL(a(T), b(T)) with a = x_t / T, b = x_s / T; a and b enter shifted by their
    # maxima (d_a and d_b sum to 0 over the vocabulary), so large logits lose no precision.
    shifted_a = lg.teacher / t - st.a.m[..., None]
    shifted_b = lg.student / t - st.b.m[..., None]
    d_t = 2.0 * soft / t - t * jnp.sum(d_a * shifted_a + d_b * shifted_b, axis=-1)
    return (
        (ct * t * d_b).astype(student.dtype),
        (ct * t * d_a).astype(teacher.dtype),
        jnp.sum(ct[..., 0] * d_t).astype(t.dtype),
    )


_soft_loss.defvjp(_soft_loss_fwd, _soft_loss_bwd)


def soft_loss(
    student_logits: jax.Array, teacher_logits: jax.Array, temperature: float | jax.Array
) -> jax.Array:
    """Per-token `T^2 KL(p_t || p_s)`, float32: logits [..., V] -> [...].

    p_t = softmax(teacher / T), p_s = softmax(student / T):
    `T^2 sum_v p_t,v (log p_t,v - log p_s,v)`, evaluated as a sum of non-negative terms (module
    docstring) so it keeps float32 relative precision down to KL ~ 1e-12 and is never negative.
    The gradient w.r.t. student logits is `T (p_s - p_t)`; the T^2 keeps it on the scale of the
    hard loss's as T changes. Teacher logits and a traced temperature get their exact
    gradients too. A Python-number temperature must be > 0.
    """
    check_temperature(temperature)
    return _soft_loss(student_logits, teacher_logits, jnp.asarray(temperature, f32))
