"""The language-model loss of hidden states through the head: untiled, or through the tiled engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kiln.losses import engine
from kiln.losses import tiling as tl
from kiln.losses.core import check_cap, check_smoothing, check_targets, check_z, f32, weighted_sum
from kiln.losses.cross_entropy import CrossEntropy, weighted_cross_entropy
from kiln.losses.schedule import CpuBlocked, ScheduleName


def lm_loss(
    hidden_BSD: jax.Array,
    head_DV: jax.Array,
    targets_BS: jax.Array,
    weights_BS: jax.Array,
    *,
    z_loss_multiplier: float = 0.0,
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    num_vocab_tiling: int = 1,
    mesh: Mesh | None = None,
    rules: dict[str, list[str]] | None = None,
    vocab_chunk_size: int | None = None,
    schedule: ScheduleName | CpuBlocked = "auto",
) -> dict[str, jax.Array]:
    """Weighted LM loss sums: hidden [B, S, D], head [D, V], targets [B, S] int, weights [B, S].

    logits = `kiln.losses.logits(hidden, head, softcap=logit_softcap)`; per-token loss as in
    `cross_entropy`. Returns float32 scalars `loss_sum = sum(w * loss)` (z-term included),
    `z_loss_sum = sum(w * z lse^2)` and `weight_sum = sum(w)`, differentiable in hidden, head
    and (floating) weights from any combination of them. `num_vocab_tiling > 1` computes the
    same values and gradients in that many token chunks without materialising the logits; on a
    `mesh`, `rules` (default `kiln.config.DEFAULT_AXIS_RULES`) give the mesh axes of `batch`,
    `length` and `vocab`. `vocab_chunk_size` also cuts each shard's vocabulary into chunks of
    that many entries (online logsumexp, then a second pass that recomputes each chunk's
    logits for the gradients: 4/3 of the matmul FLOPs, for loss memory independent of the
    vocabulary). `schedule` picks how the tiled loss walks each shard's tokens (`auto`,
    `whole`, `cpu_blocked` or a `CpuBlocked(chunk_bytes, block_bytes)`; see
    `kiln.losses.schedule`): the same values either way, up to summation order. A target
    outside [0, V) with nonzero weight, or a negative or non-finite weight, is a ValueError
    when targets and weights are concrete, and makes the sums NaN under `jit`.
    """
    z, eps = check_z(z_loss_multiplier), check_smoothing(label_smoothing)
    cap = check_cap("logit_softcap", logit_softcap)
    tiling = tl.make_tiling(
        (CrossEntropy(z=z, eps=eps, vocab=head_DV.shape[-1]),),
        (("loss",),),
        hidden_BSD,
        head_DV,
        num_vocab_tiling=num_vocab_tiling,
        vocab_chunk_size=vocab_chunk_size,
        mesh=mesh,
        rules=rules,
        schedule=schedule,
        student_cap=cap,
    )
    weights_BS = check_targets(targets_BS, weights_BS, tiling.vocab)
    if tiling.tiled:
        inputs = tl.Inputs(hidden_BSD, head_DV, targets_BS, weights_BS)
        out = engine.run(tiling, inputs, jnp.ones((1,), f32))
        return {k: out[k] for k in ("loss_sum", "z_loss_sum", "weight_sum")}
    x = tl.whole_logits(hidden_BSD, head_DV, cap, mesh, tiling.axes)
    loss, z_loss = weighted_cross_entropy(x, targets_BS, weights_BS, z=z, eps=eps)
    w = weights_BS.astype(f32)
    return {
        "loss_sum": weighted_sum(loss, w),
        "z_loss_sum": weighted_sum(z_loss, w),
        "weight_sum": jnp.sum(w),
    }


def ahead(x_BS: jax.Array, depth: int) -> jax.Array:
    """x moved `depth` positions left along the sequence, 0 in the last `depth` positions:
    position i holds x[i + depth] (the token a multi-token prediction module reads)."""
    b, s = x_BS.shape
    depth = min(depth, s)
    fill = jnp.zeros((b, depth), x_BS.dtype)
    return jnp.concatenate([x_BS[:, depth:], fill], axis=1)


def ahead_targets(
    targets_BS: jax.Array, weights_BS: jax.Array, segment_ids_BS: jax.Array, depth: int
) -> tuple[jax.Array, jax.Array]:
    """Targets and weights `depth` tokens further ahead (multi-token prediction): position i
    gets targets[i + depth] and weights[i + depth] when i + depth is inside the sequence and
    the same document (segment id > 0 and equal), else target 0 with weight 0."""
    same_BS = (ahead(segment_ids_BS, depth) == segment_ids_BS) & (segment_ids_BS > 0)
    targets = jnp.where(same_BS, ahead(targets_BS, depth), 0)
    weights = jnp.where(same_BS, ahead(weights_BS, depth), jnp.zeros((), weights_BS.dtype))
    return targets, weights
