"""Optional experiment tracking: Weights & Biases mirrors what MetricsLogger writes."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from kiln.config import Config
from kiln.errors import KilnError

RUN_ID_FILE = "wandb_run_id"


def check_wandb(config: Config) -> None:
    """KilnError (exit 2) when logging.wandb is set but the wandb package cannot be imported."""
    cfg = config.logging.wandb
    if cfg is None or cfg.mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise KilnError(
            f"logging.wandb: set (project {cfg.project!r}), but the wandb package is not "
            "installed; install the extra with pip install 'kiln[wandb]', or remove logging.wandb"
        ) from None


class WandbMirror:
    """One W&B run per kiln run directory: a resumed kiln run resumes the same W&B run."""

    def __init__(self, run_dir: Path, config: Config):
        import wandb

        cfg = config.logging.wandb
        # The id is kept in the run directory, so a resume (even on another machine) continues
        # the W&B run; steps it logs again after the checkpoint are ones W&B already has.
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        if run_id is None:
            run_id = secrets.token_hex(8)
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(run_dir),
            name=config.train.run_name,
            id=run_id,
            resume="allow",
            config=config.model_dump(mode="json"),
        )

    def log(self, step: int, values: dict[str, Any]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()
