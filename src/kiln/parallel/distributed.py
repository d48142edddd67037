"""Multi-process runs: joining the other processes through jax.distributed, and leaving them.

Every process runs the same program on its own devices; `initialize` must come before any
device is touched (the run functions call it first). Failure is bounded in time: start-up
gives up after `distributed.init_timeout_s`, and once running, a process that stops sending
heartbeats for `distributed.heartbeat_timeout_s` makes JAX terminate all the others.
"""

from __future__ import annotations

import os
import sys
import threading

import jax

from kiln.config import Config
from kiln.errors import KilnError, first_line

# JAX's own start-up deadline ends in an abort with an RPC trace; kiln's watchdog fires first.
_JAX_DEADLINE_MARGIN_S = 15


def initialize(config: Config) -> None:
    """Join the other processes of the run (no-op for one process); on CPU, collectives use gloo."""
    d = config.distributed
    if not d.auto and d.num_processes == 1:
        return
    if jax.distributed.is_initialized():
        return  # a second run in this Python process keeps the cluster of the first
    if not d.auto and d.coordinator_address is None:
        raise KilnError(
            f"distributed.coordinator_address: required with num_processes={d.num_processes} "
            "(host:port of process 0, the same on every process), or set distributed.auto: true"
        )
    if d.auto:
        who = "this process (cluster detected by JAX)"
        where = d.coordinator_address or "the coordinator JAX detected"
    else:
        who = f"process {d.process_id} of {d.num_processes}"
        where = d.coordinator_address
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    watchdog = threading.Timer(
        d.init_timeout_s,
        _give_up,
        args=(
            f"distributed.init_timeout_s: {who} waited {d.init_timeout_s} s at {where} and not "
            "every process arrived; start all processes with the same coordinator_address and "
            "num_processes (process 0 hosts the coordinator), and check that its port is reachable",
        ),
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=d.coordinator_address,
            num_processes=None if d.auto else d.num_processes,
            process_id=None if d.auto else d.process_id,
            cluster_detection_method=None if d.auto else "deactivate",
            initialization_timeout=d.init_timeout_s + _JAX_DEADLINE_MARGIN_S,
            heartbeat_timeout_seconds=d.heartbeat_timeout_s,
            # A process that fails alone waits this long for the others at exit, then all stop.
            shutdown_timeout_seconds=d.heartbeat_timeout_s,
        )
        jax.devices()  # the backends exchange device lists with every process here
    except (RuntimeError, ValueError) as e:
        message = first_line(e)
        if "must be called before" in message:
            message = "JAX was already in use in this process; start a fresh process per run"
        raise KilnError(
            f"distributed: cannot join the run as {who} at {where}: {message}"
        ) from None
    finally:
        watchdog.cancel()


def _give_up(message: str) -> None:
    print(f"kiln: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def joined() -> bool:
    """Whether this process is one of several of a run."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def leave_if_joined(code: int) -> None:
    """After an error, exit at once with `code` if this process is one of several.

    A normal exit would first wait at JAX's shutdown barrier for processes that are waiting for
    this one; exiting at once stops its heartbeat, so the others stop within
    `distributed.heartbeat_timeout_s` and this process keeps its own exit code.
    """
    if joined():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
