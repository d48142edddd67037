"""The config schema: processes and the console."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from kiln.config.schema.base import Count, PositiveInt, Section


class DistributedConfig(Section):
    """Multi-process runs through jax.distributed."""

    coordinator_address: str | None = Field(
        None,
        description="host:port of process 0's coordinator; null = single process (unless auto).",
    )
    num_processes: PositiveInt = Field(1, description="Total number of processes.")
    process_id: Count = Field(0, description="This process's index in [0, num_processes).")
    auto: bool = Field(
        False,
        description="Let jax.distributed.initialize() detect the cluster (SLURM, TPU pods, GKE, Open MPI).",
    )
    init_timeout_s: PositiveInt = Field(
        300,
        description="Seconds to wait for all processes before giving up with an error.",
    )
    heartbeat_timeout_s: PositiveInt = Field(
        100,
        description="Seconds without a heartbeat after which a process counts as dead and every other process stops.",
    )

    @pydantic.field_validator("coordinator_address")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        if address is not None:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("allowed: host:port with a port in 1..65535, e.g. 10.0.0.1:8476")
        return address


class WandbConfig(Section):
    """Where Weights & Biases mirrors the metrics (needs the optional extra kiln[wandb])."""

    project: str = Field(min_length=1, description="W&B project the run is logged to.")
    entity: str | None = Field(
        None, description="W&B user or team owning the project; null = the logged-in default."
    )
    mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="online (stream to the W&B server), offline (write under {run_dir}/wandb for `wandb sync`), disabled (no-op).",
    )


class LoggingConfig(Section):
    """Console and performance reporting."""

    peak_tflops_per_device: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Peak TFLOP/s of one device for perf/mfu; null = look up known GPUs/TPUs (a device kind not in the table, e.g. CPU, logs no perf/mfu).",
    )
    progress: bool = Field(True, description="Show a progress bar when the console is a terminal.")
    wandb: WandbConfig | None = Field(
        None,
        description="null = TensorBoard and metrics.jsonl only; {project, entity, mode} = also mirror every logged metric to Weights & Biases (pip install 'kiln[wandb]').",
    )
