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
E_q[x] = sum_v exp(b_v - m_b) x_v / s_b, with m_b and s_b the student's normaliser (max and sum
of exponentials): two row sums per token beyond the normalisers, each a plain reduction.
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
    axis_size,
    check_temperature,
    f32,
    merge,
    pmax,
    psum,
    reduce,
)

_SERIES = 0.5  # |d'| up to which g and e^d' - 1 come from the Taylor series of E


class KLStats(NamedTuple):
    """Normalisers of the teacher's (a) and the student's (b) logits over T."""

    a: Normaliser
    b: Normaliser


class KLSums(NamedTuple):
    """Per-token sums over the vocabulary, in units of the student's normaliser s_b = sum exp(b - m_b):
    s_b E_q[g(d')] and s_b E_q[e^d' - 1]."""

    g: jax.Array
    u: jax.Array


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


def _tempered_normaliser(x_nV: jax.Array, t: jax.Array, axes: tuple[str, ...]) -> Normaliser:
    """`normaliser(x / t)` without an [n, V] array of x / t for its maximum.

    max(x / t) is max(x) / t bit for bit (x -> x / t rounds monotonically for t > 0), and the
    row maximum of x is the one the cross-entropy of the same logits takes, so the scaled
    logits feed only the exponentials.
    """
    m_n = pmax(jnp.max(x_nV, axis=-1), axes) / t
    m_n = jnp.where(jnp.isfinite(m_n), m_n, 0.0)
    s_n = psum(jnp.sum(jnp.exp(x_nV / t - m_n[..., None]), axis=-1), axes)
    zero = jnp.zeros_like(m_n)
    return Normaliser(m_n, s_n, zero, jnp.full((), x_nV.shape[-1] * axis_size(axes), f32))


class SoftTerm:
    """A soft-loss callback's one term, `self.name`, differentiable in the student."""

    name: str

    @property
    def terms(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def differentiable(self) -> tuple[str, ...]:
        return (self.name,)


@dataclasses.dataclass(frozen=True)
class SoftKL(SoftTerm):
    """Chunk callback: per-token `soft` = T^2 KL(teacher_T || student_T), differentiable in the student."""

    name: str = "soft"

    def stats(self, lg: ChunkLogits, axes: tuple[str, ...]) -> KLStats:
        t = lg.temperature
        a = _tempered_normaliser(lg.teacher, t, axes)
        return KLStats(a, _tempered_normaliser(lg.student, t, axes))

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
        """Two row sums of terms scaled by s_b, so that sum q is s_b itself (no third sum).

        q s_b = exp(b - m_b) is the student's normaliser's exponential (computed once) and
        p s_b = exp(a - m_a) s_b / s_a; each sum is a plain reduction of one array.
        """
        t = lg.temperature
        q = jnp.exp(lg.student / t - st.b.m[..., None])
        p = jnp.exp(lg.teacher / t - st.a.m[..., None]) * (st.b.s / st.a.s)[..., None]
        d = self.log_ratio(lg, st)
        small = jnp.abs(d) <= _SERIES
        e = _expm1_minus_x(d)
        g = jnp.where(small, q * (d * d + (d - 1.0) * e), p * (d - 1.0) + q)
        u = jnp.where(small, q * (d + e), p - q)
        return KLSums(jnp.sum(g, axis=-1), jnp.sum(u, axis=-1))

    def values(self, st, sums: KLSums, valid_n, temperature) -> dict[str, jax.Array]:
        w = sums.u / st.b.s
        kl = (sums.g / st.b.s) / (1.0 + w) - _log_ratio_excess(w)
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
    gradients too. The temperature must be finite and > 0: a ValueError when its value is
    known, a NaN result when it is traced (`kiln.losses.core.checked`).
    """
    temperature = check_temperature(temperature)
    return _soft_loss(student_logits, teacher_logits, jnp.asarray(temperature, f32))
