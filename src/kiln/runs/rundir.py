"""A run directory on disk: what a run writes, `--restart` (the earlier run moved aside), and the
history of its config.yaml. Whether a config may continue a run is `kiln.training.resume`."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.config import Config

# What `--restart` moves aside: everything a run writes (a lock file or the like stays).
RUN_FILES = ("checkpoints", "tensorboard", "metrics.jsonl", "metrics.jsonl.damaged", "config.yaml")


class RunComplete(Exception):
    """The run's latest checkpoint is at or past train.steps: nothing to train, nothing written."""


def metrics_rows(run_dir: Path) -> int:
    """Rows of the run's metrics.jsonl (0 when there is none)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except FileNotFoundError:
        return 0


def restart_target(run_dir: Path) -> Path | None:
    """Where `--restart` moves the earlier run: run_dir/restart-N, the first N free."""
    if not any((run_dir / name).exists() for name in RUN_FILES):
        return None
    n = 1
    while (run_dir / f"restart-{n}").exists():
        n += 1
    return run_dir / f"restart-{n}"


def move_aside(run_dir: Path, target: Path) -> None:
    """Move the earlier run's files (and config history) into `target`."""
    target.mkdir(parents=True)
    names = [*RUN_FILES, *(p.name for p in run_dir.glob("config.*.yaml"))]
    for name in names:
        if (run_dir / name).exists():
            os.replace(run_dir / name, target / name)


def keep_config_history(run_dir: Path, config: Config, step: int) -> str | None:
    """Before a changed config.yaml is replaced, keep the old one as config.<step>.yaml (the
    config of the steps up to `step`); the first one kept for a step stays. Returns its name."""
    path = run_dir / "config.yaml"
    if not path.is_file() or path.read_text() == config.to_yaml():
        return None
    kept = run_dir / f"config.{step}.yaml"
    if kept.exists():
        return None
    os.replace(path, kept)
    return kept.name
