"""`kiln distill`: from a teacher run (online) or from a store of its logits (offline)."""

from __future__ import annotations

from kiln.config import Config
from kiln.distill import offline, online
from kiln.training.train import TrainState


def run(config: Config, restart: bool = False, whole_process: bool = False) -> TrainState | None:
    """Distil into `config`'s student: offline when `distillation.teacher_logits_dir` is set.
    `restart`, `whole_process`: see `kiln.training.runner.prepare_run`."""
    if config.distillation.teacher_logits_dir:
        return offline.run(config, restart, whole_process)
    return online.run(config, restart, whole_process)
