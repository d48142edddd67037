"""kiln's losses: cross-entropy with z-loss, one tiled engine, and the distillation losses.

Modules: `core` (the head logits, the mergeable log-normaliser, argument checks),
`cross_entropy`, `kl` and `top_k` (the per-chunk callbacks and their per-token APIs), `tiling`
(a call's static settings: mesh axes, chunking, and their checks), `schedule` (how the engine
walks a shard's tokens: whole chunks, vocabulary chunks or CPU row blocks), `engine` (the tiled chunk
loop, its shard_map plumbing and custom VJP), `lm` (the LM loss) and `distill` (soft, fused
hard + soft, feature and combined distillation losses).

May import: `kiln.errors`, `kiln.util`, `kiln.data`, `kiln.config`, `kiln.parallel`. The losses
see hidden states and a head matrix, never a model.

Public names: those of `__all__` below.
"""

from kiln.losses.core import TopK, logits
from kiln.losses.cross_entropy import cross_entropy
from kiln.losses.distill import (
    distill_loss_sums,
    distillation_loss,
    feature_loss,
    soft_loss_sums,
    top_k_distill_loss_sums,
)
from kiln.losses.kl import soft_loss
from kiln.losses.lm import ahead, ahead_targets, lm_loss
from kiln.losses.schedule import CpuBlocked
from kiln.losses.top_k import top_k_soft_loss

__all__ = [
    "CpuBlocked",
    "TopK",
    "ahead",
    "ahead_targets",
    "cross_entropy",
    "distill_loss_sums",
    "distillation_loss",
    "feature_loss",
    "lm_loss",
    "logits",
    "soft_loss",
    "soft_loss_sums",
    "top_k_distill_loss_sums",
    "top_k_soft_loss",
]
