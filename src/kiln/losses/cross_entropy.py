"""Cross-entropy with z-loss and label smoothing: the per-chunk callback and the per-token API.

Per token, with logits x over V entries, target y, z-loss weight z and label smoothing eps
(target distribution t = (1-eps) onehot(y) + eps/V), m = max(x), s = sum_v exp(x_v - m):

    lse  = m + log s
    loss = (1-eps)(m - x_y) + eps mean_v(m - x_v) + log s + z lse^2
         = sum_v t_v (lse - x_v) + z lse^2
    d loss / d x = (1 + 2 z lse) softmax(x) - t

The loss is assembled from shifted quantities (m - x_y, x - m, log s), never as lse - x_y: at
logits near 1e4 that difference of two rounded numbers near 1e4 loses ~1e-4 relative.
A target outside [0, V) has no target logit: its loss is NaN (its gradient stays finite, so
a token masked out by weight 0 or `jnp.where` costs nothing).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kiln.losses.core import (
    ChunkLogits,
    Normaliser,
    check_smoothing,
    check_z,
    f32,
    merge,
    normaliser,
    psum,
    reduce,
    scored,
)


class CEStats(NamedTuple):
    """Per-token statistics of one model's logits: its normaliser and its target logit."""

    norm: Normaliser
    x_y: jax.Array


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """Chunk callback: cross-entropy of the `source` model's logits ("student" or "teacher").

    Per-token terms `loss` (z-term included) and `z_loss` under the names given; only the
    student's are differentiable (the teacher is a constant).
    """

    z: float
    eps: float
    vocab: int
    source: str = "student"
    loss_name: str = "loss"
    z_name: str | None = "z_loss"

    @property
    def terms(self) -> tuple[str, ...]:
        return (self.loss_name,) + ((self.z_name,) if self.z_name else ())

    @property
    def differentiable(self) -> tuple[str, ...]:
        return self.terms if self.source == "student" else ()

    def stats(self, lg: ChunkLogits, axes: tuple[str, ...]) -> CEStats:
        x = getattr(lg, self.source)
        x_y = target_logit(x, lg.hit, lg.target)
        return CEStats(normaliser(x, axes, shifted_sum=bool(self.eps)), psum(x_y, axes))

    def merge(self, a: CEStats, b: CEStats) -> CEStats:
        return CEStats(merge(a.norm, b.norm), a.x_y + b.x_y)

    def reduce(self, st: CEStats, axes: tuple[str, ...]) -> CEStats:
        return CEStats(reduce(st.norm, axes), psum(st.x_y, axes))

    def sums(self, lg: ChunkLogits, st: CEStats) -> tuple:
        return ()  # everything is in the statistics

    def values(self, st: CEStats, sums: tuple, ok_n, temperature) -> dict[str, jax.Array]:
        m, s, c, _ = st.norm
        ce = m - st.x_y
        if self.eps:
            ce = (1.0 - self.eps) * ce - (self.eps / self.vocab) * c
        ce = jnp.where(ok_n, ce + jnp.log(s), jnp.nan)
        z_term = self.z * jnp.square(m + jnp.log(s)) if self.z else jnp.zeros_like(ce)
        out = {self.loss_name: ce + z_term if self.z else ce}
        if self.z_name:
            out[self.z_name] = z_term
        return out

    def dlogits(self, lg: ChunkLogits, st: CEStats, cts: dict[str, jax.Array]):
        """d(sum_n ct_loss loss + ct_z z-term)/dx [n, c] float32, or None without cotangents.

        coef = ct_loss (1 + 2 z lse) + ct_z 2 z lse scales the pure softmax, before the smoothed
        target is subtracted. softmax = exp(x - m) / s, not exp(x - lse): lse rounded to
        float32 would cost ~1e-4 relative at logits ~1e4.
        """
        if self.source != "student":
            return None
        ct_loss = cts.get(self.loss_name)
        ct_z = cts.get(self.z_name) if self.z and self.z_name else None
        if ct_loss is None and ct_z is None:
            return None
        m, s = st.norm.m, st.norm.s
        lse = m + jnp.log(s) if self.z else None
        coef = jnp.zeros_like(m)
        if ct_loss is not None:
            coef = coef + (ct_loss * (1.0 + 2.0 * self.z * lse) if self.z else ct_loss)
        if ct_z is not None:
            coef = coef + ct_z * (2.0 * self.z * lse)
        x = lg.student
        g = (coef / s)[..., None] * jnp.exp(x - m[..., None])
        if ct_loss is not None:
            g = g - jnp.where(lg.hit, (1.0 - self.eps) * ct_loss[..., None], 0.0)
            if self.eps:
                g = g - (self.eps / self.vocab) * ct_loss[..., None]
        return g


def target_logit(x_nV: jax.Array, hit_nV: jax.Array, target_n: jax.Array | None) -> jax.Array:
    """x[n, target] per row, 0 where the target is not in the block: the same number either way.

    A masked sum stays local to a vocabulary shard or chunk; with the whole row at hand a
    gather reads one entry per row instead of the block.
    """
    if target_n is None:
        return jnp.sum(jnp.where(hit_nV, x_nV, 0.0), axis=-1)
    vocab = x_nV.shape[-1]
    ok = (target_n >= 0) & (target_n < vocab)
    col = jnp.clip(target_n, 0, vocab - 1)[..., None]
    return jnp.where(ok, jnp.take_along_axis(x_nV, col, axis=-1)[..., 0], 0.0)


def target_hit(vocab: int, targets: jax.Array) -> jax.Array:
    return jnp.arange(vocab) == targets[..., None]


def _rows(logits, targets, z, eps):
    """The `CrossEntropy` callback on logits [..., V] (no reshape: shardings stay as given)."""
    vocab = logits.shape[-1]
    lg = ChunkLogits(logits.astype(f32), None, target_hit(vocab, targets), None)
    loss = CrossEntropy(z=z, eps=eps, vocab=vocab)
    return lg, loss, loss.stats(lg, ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _cross_entropy(logits, targets, ok, z, eps):
    return _cross_entropy_fwd(logits, targets, ok, z, eps)[0]


def _cross_entropy_fwd(logits, targets, ok, z, eps):
    _, loss, st = _rows(logits, targets, z, eps)
    out = loss.values(st, (), ok, None)
    # Logits are an input (already live); the rest is a few floats per token.
    return (out["loss"], out["z_loss"]), (logits, targets, ok, st)


def _cross_entropy_bwd(z, eps, res, cts):
    logits, targets, ok, st = res
    lg, loss, _ = _rows(logits, targets, z, eps)
    ct_loss, ct_z = (c.astype(f32) for c in cts)
    grad = loss.dlogits(lg, st, {"loss": ct_loss, "z_loss": ct_z}).astype(logits.dtype)
    return grad, np.zeros(targets.shape, jax.dtypes.float0), np.zeros(ok.shape, jax.dtypes.float0)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    *,
    z_loss_multiplier: float = 0.0,
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy with z-loss, in float32: logits [..., V], targets [...] int.

    Returns `(loss, z_loss)`, both float32 [...]: `loss = (1-eps)(lse - x_y) +
    eps (lse - mean(x)) + z lse^2` (computed from max-shifted terms, see the module docstring)
    and `z_loss = z lse^2`, lse = logsumexp(x). The gradient w.r.t. logits is exactly
    `(1 + 2 z lse) softmax(x) - ((1-eps) onehot(y) + eps/V)`. `z_loss_multiplier` (finite,
    >= 0) and `label_smoothing` (in [0, 1)) are static Python numbers; a target outside [0, V)
    gives a NaN loss (mask such tokens with `jnp.where`, not by multiplying with 0).
    """
    z, eps = check_z(z_loss_multiplier), check_smoothing(label_smoothing)
    return _cross_entropy(logits, targets, scored(targets, None, logits.shape[-1]), z, eps)


def weighted_cross_entropy(logits, targets, weights, *, z: float, eps: float):
    """`cross_entropy` (no checks) whose loss is NaN only where an out-of-range target has weight."""
    return _cross_entropy(logits, targets, scored(targets, weights, logits.shape[-1]), z, eps)
