"""A run directory on disk: what a run writes, `--restart` (the earlier run moved aside), and the
history of its config.yaml. Whether a config may continue a run is `kiln.training.resume`."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.config import Config
from kiln.errors import KilnError

# What `--restart` moves aside: everything a run writes (a lock file or the like stays).
RUN_FILES = (
    "checkpoints",
    "tensorboard",
    "metrics.jsonl",
    "metrics.jsonl.damaged",
    "config.yaml",
    "hangs",
)

# What a run writes in its directory: name -> (whether it is a directory, what it holds).
RUN_ENTRIES = {
    "config.yaml": (False, "its resolved config"),
    "metrics.jsonl": (False, "a row of metrics per logged step"),
    "metrics.jsonl.damaged": (False, "the damaged rows of metrics.jsonl set aside"),
    "inputs.json": (False, "the inputs it pinned"),
    "checkpoints": (True, "its checkpoints"),
    "tensorboard": (True, "its TensorBoard event files"),
    "hangs": (True, "the reports of processes that hung (train.hang_timeout_s)"),
}


class RunComplete(Exception):
    """The run's latest checkpoint is at or past train.steps: nothing to train, nothing written."""


def check_entries(run_dir: Path, restart: bool = False) -> None:
    """KilnError naming the first path of `run_dir` that a run writes but that is of the other
    kind (a directory where a file goes, or the reverse): checked before anything is written.
    `restart`: what `--restart` moves aside is not checked."""
    for name, (is_dir, holds) in RUN_ENTRIES.items():
        path = run_dir / name
        if (restart and name in RUN_FILES) or not (path.exists() or path.is_symlink()):
            continue
        if is_dir and not path.is_dir():
            found = "not a directory"
        elif not is_dir and path.is_dir():
            found = "a directory"
        elif not (is_dir or path.is_file()):
            found = "not a regular file"
        else:
            continue
        kind = "a directory" if is_dir else "a regular file"
        raise KilnError(
            f"{path}: {found}, where the run keeps {holds}; allowed: {kind} or nothing (move it "
            "out of the run directory)"
        )


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
