"""Whether a config may start or continue the run in its directory: a finished run, another
optimizer than the checkpoint's, or a longer schedule whose learning rate would jump at the
resume step, is refused (or, when finished, reported) before anything is written; a run with
metrics but no checkpoint starts over (with the same model and token stream: another one is
refused, `resume_changes`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.config import Config, OptimConfig, read_run_config
from kiln.errors import KilnError
from kiln.runs.rundir import RunComplete, metrics_rows
from kiln.training.optim import make_schedule
from kiln.util.humanize import plural

# A learning rate above the finished schedule's by more than float32 rounding is a jump up.
LR_RTOL = 1e-6


def starts_over(run_dir: Path, latest: int | None) -> str | None:
    """Why a run with nothing to resume starts over as `--restart` does (its earlier files moved
    aside, so no row of the earlier run mixes with the new ones): it logged metrics but has no
    checkpoint (`latest` is None). None when it has one, or logged nothing."""
    rows = metrics_rows(run_dir) if latest is None else 0
    if not rows:
        return None
    return (
        f"{run_dir} has {plural(rows, 'row')} of metrics but no checkpoint to resume from (the "
        "run stopped before its first save, or its checkpoints were removed): starting over "
        "from step 0"
    )


def check_start(config: Config, previous: Config | None, latest: int | None) -> None:
    """Refuse (KilnError) or finish (RunComplete) a start that would not train what it says.

    `previous` is the run directory's config.yaml and `latest` its latest complete checkpoint.
    """
    run_dir, steps = config.run_dir, config.train.steps
    if latest is None:
        return
    if latest >= steps:
        raise RunComplete(
            f"run complete at step {latest} (train.steps={steps}); nothing trained, {run_dir} "
            f"left as it was; {_way_on(config.optim, latest)}"
        )
    if previous is not None and previous.optim.name != config.optim.name:
        raise KilnError(
            f"optim.name: {previous.optim.name} -> {config.optim.name} on resume: the checkpoint "
            f"at step {latest} holds {previous.optim.name}'s state; keep "
            f"optim.name={previous.optim.name}, or start a new run from these weights "
            f"({_new_run(run_dir)})"
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


# Sections and fields a resumed run may not change: they define the model and the token stream.
FROZEN_ON_RESUME = (
    "model",
    "data.source",
    "data.synthetic_kind",
    "data.paths",
    "data.eval_paths",
    "data.on_decode_error",
    "data.field",
    "data.tokenizer",
    "data.seq_len",
    "data.seed",
    "data.eval_fraction",
    "data.sources",
    "train.global_batch_size",
    "distillation.teacher_run_dir",
    "distillation.teacher_logits_dir",
)


def previous_config(run_dir: Path) -> Config | None:
    """The resolved config of an earlier invocation in this run directory, if it left one
    (with or without checkpoints: its metrics belong to that config)."""
    if not (run_dir / "config.yaml").is_file():
        return None
    return read_run_config(run_dir, "resume (the earlier run's config)")


def resume_changes(old: Config, new: Config, resumed: bool = True) -> list[str]:
    """Changed fields as 'a.b: old -> new'; a KilnError if a frozen field changed, whether the
    run resumes a checkpoint (`resumed`) or has none yet: its directory holds one model and
    token stream."""
    before, after = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    changes = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key):
            continue
        if any(key == f or key.startswith(f + ".") for f in FROZEN_ON_RESUME):
            if resumed:
                why = "a resumed run cannot change it"
                ways = "checkpoint.load_params_from to start from its weights, or "
            else:
                why = (
                    "a run cannot change it, even before its first checkpoint: its directory "
                    "holds the metrics of one model and token stream"
                )
                ways = ""
            raise KilnError(
                f"{key}: the run in {new.run_dir} was started with {before.get(key)!r}, this config "
                f"says {after.get(key)!r}; {why} (use a new train.run_name, or {ways}--restart "
                "to start this run over)"
            )
        changes.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    return changes


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and not (prefix == "mesh." and k == "rules"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
