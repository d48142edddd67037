"""`kiln train`: pre-train a model from its config."""

from __future__ import annotations

from kiln.config import Config
from kiln.training.runner import execute
from kiln.training.train import TrainState, abstract_pretraining, pretraining


def run(config: Config, restart: bool = False, whole_process: bool = False) -> TrainState | None:
    """`kiln train`: validate against devices, data and any earlier run; then train and save.

    `restart` starts the run over, `whole_process` counts its start-up from the start of the
    process (see `kiln.training.runner.prepare_run`); None when it was complete.
    """
    return execute(
        config,
        pretraining,
        command="kiln train",
        restart=restart,
        whole_process=whole_process,
        abstract=abstract_pretraining,
    )
