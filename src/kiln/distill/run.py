"""`kiln distill`: from a teacher run (online) or from a store of its logits (offline)."""

from __future__ import annotations

from kiln.config import Config
from kiln.distill import offline, online
from kiln.training.train import TrainState


def run(config: Config, restart: bool = False) -> TrainState | None:
    """Distil into `config`'s student: offline when `distillation.teacher_logits_dir` is set."""
    if config.distillation.teacher_logits_dir:
        return offline.run(config, restart)
    return online.run(config, restart)
