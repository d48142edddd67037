"""A run directory before a run starts: may this config continue it, is it finished already,
`--restart` (the earlier run moved aside), and the history of its config.yaml."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.config import Config, OptimConfig
from kiln.errors import KilnError

# What `--restart` moves aside: everything a run writes (a lock file or the like stays).
RUN_FILES = ("checkpoints", "tensorboard", "metrics.jsonl", "config.yaml")
# A learning rate above the finished schedule's by more than float32 rounding is a jump up.
LR_RTOL = 1e-6


class RunComplete(Exception):
    """The run's latest checkpoint is at or past train.steps: nothing to train, nothing written."""


def metrics_rows(run_dir: Path) -> int:
    """Rows of the run's metrics.jsonl (0 when there is none)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except FileNotFoundError:
        return 0


def check_start(config: Config, previous: Config | None, latest: int | None) -> None:
    """Refuse (KilnError) or finish (RunComplete) a start that would not train what it says.

    `previous` is the run directory's config.yaml and `latest` its latest complete checkpoint.
    """
    run_dir, steps = config.run_dir, config.train.steps
    if latest is None:
        rows = metrics_rows(run_dir)
        if rows:
            raise KilnError(
                f"train.run_name: {run_dir} has {rows} rows of metrics but no checkpoint to "
                "resume from; starting over would mix two runs in its metrics.jsonl: run again "
                "with --restart (moves the earlier run aside) or use a new train.run_name"
            )
        return
    if latest >= steps:
        raise RunComplete(
            f"run complete at step {latest} (train.steps={steps}); nothing trained, {run_dir} "
            f"left as it was; {_way_on(config.optim, latest)}"
        )
    if previous is not None and previous.train.steps != steps:
        jump = lr_jump(config.optim, latest, previous.train.steps, steps)
        if jump is not None:
            before, after = jump
            raise KilnError(
                f"train.steps: {previous.train.steps} -> {steps} moves the {config.optim.schedule} "
                f"schedule backwards at the resume step {latest + 1}: the learning rate would "
                f"jump from {before:.4g} to {after:.4g}; keep train.steps={previous.train.steps}, "
                f"or start a new run from these weights ({_new_run(run_dir)})"
            )


def lr_jump(optim: OptimConfig, step: int, old_steps: int, new_steps: int):
    """(old, new) learning rate of the update after checkpoint `step` when `train.steps` changes,
    if the new schedule is higher there; None when it is not (a later, equal or lower rate)."""
    from kiln.optim import make_schedule  # jax: only once the run has started it

    old = float(make_schedule(optim, old_steps)(step))  # the update after step N uses lr(N)
    new = float(make_schedule(optim, new_steps)(step))
    return (old, new) if new > old * (1 + LR_RTOL) else None


def _way_on(optim: OptimConfig, latest: int) -> str:
    """What to do with a finished run: more steps only where the schedule allows them."""
    if lr_jump(optim, latest, latest, latest + 1) is None:
        return "use a new train.run_name or raise train.steps"
    return f"use a new train.run_name (the {optim.schedule} schedule has ended)"


def _new_run(run_dir: Path) -> str:
    return f"train.run_name=NEW checkpoint.load_params_from={run_dir}, with a schedule of its own"


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
