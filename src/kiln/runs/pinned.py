"""What a run's inputs were, pinned in `RUN_DIR/inputs.json`: a resume on other inputs is refused.

Config fields that define the token stream are frozen on resume (`kiln.training.resume.FROZEN_ON_RESUME`);
this file covers what the config does not show: the corpus behind `data.paths` (files, sizes,
documents and tokens after tokenization), the document split it gave, and for distillation the
teacher's checkpoint step, which a resumed student keeps even when the teacher run has moved on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kiln.config import Config
from kiln.errors import KilnError
from kiln.runs import local_tier
from kiln.runs.checkpoint import latest_complete_step

PINNED = "inputs.json"


def recorded(config: Config) -> dict[str, Any] | None:
    """The inputs this run was started with, if it is being resumed and recorded them."""
    path = config.run_dir / PINNED
    saved = latest_complete_step(config.run_dir / "checkpoints") is not None
    if not path.is_file() or not (saved or local_tier.own_steps(config)):
        return None
    try:
        inputs = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KilnError(f"{path}: unreadable ({e}); it records this run's inputs") from None
    if not isinstance(inputs, dict):
        raise KilnError(f"{path}: not a JSON object; it records this run's inputs")
    return inputs


def check_data(config: Config, current: dict[str, Any]) -> None:
    """KilnError (one line, naming what changed) if the corpus or its split differ from the record."""
    before = recorded(config)
    if before is None:
        return
    fields = (("corpus", "data.paths"), ("split", "data.eval_fraction"))
    if config.data.sources:  # by source name: {"corpus": {name: ...}, "split": {name: ...}}
        fields = (("corpus", "data.sources"), ("split", "data.sources"))
    for key, field in fields:
        old, new = before.get(key), current.get(key)
        if old is None or old == new:
            continue
        diff = ", ".join(
            f"{k} {old.get(k)!r} -> {(new or {}).get(k)!r}"
            for k in sorted(set(old) | set(new or {}))
            if old.get(k) != (new or {}).get(k)
        )
        raise KilnError(
            f"{field}: the {key} of this run changed since it started ({diff}); a resumed run "
            "must read the same inputs (restore them, or start a new train.run_name)"
        )


def teacher_step(config: Config) -> int | None:
    """The teacher step this distillation run was started with (None for a new run)."""
    before = recorded(config)
    teacher = (before or {}).get("teacher")
    return None if teacher is None else int(teacher["step"])


def write(run_dir: Path, inputs: dict[str, Any]) -> None:
    """Record the inputs (process 0, once the run directory exists), atomically."""
    path = Path(run_dir) / PINNED
    tmp = path.with_name(f".{PINNED}.tmp")
    tmp.write_text(json.dumps(inputs, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
