"""The hang watchdog (train.hang_timeout_s): a 2-process run with one process stopped."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import communicate, kiln_env, write_config

pytestmark = pytest.mark.slow

EXIT_HANG = 75  # kiln.training.watchdog.EXIT_HANG, as a scheduler sees it
TIMEOUT_S = 3

CONFIG = {
    "model": {"vocab_size": 384, "d_model": 32, "num_layers": 2, "num_heads": 4, "d_ff": 64, "max_seq_len": 16, "dtype": "float32"},
    "data": {"source": "synthetic", "synthetic_kind": "markov", "paths": [], "seq_len": 16},
    "mesh": {"fsdp": -1},
    "optim": {"learning_rate": 3e-3, "schedule": "constant", "warmup_steps": 0},
    "train": {"run_name": "r", "global_batch_size": 16, "log_every_steps": 1, "steps": 20, "hang_timeout_s": TIMEOUT_S},
    "checkpoint": {"every_steps": 10, "async_save": False},
    # Above the hang timeout: JAX's own heartbeat check would end the run first, without stacks.
    "distributed": {"init_timeout_s": 120, "heartbeat_timeout_s": 60},
}  # fmt: skip


def start(config: Path, runs: Path) -> list[subprocess.Popen]:
    """Two `kiln train` processes with 4 CPU devices each, as scripts/launch_local.sh starts
    them, but each with its own pipes (process 0: stdout and stderr merged, to read its steps)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # conftest's flags (fast compilation), with 4 devices per process instead of 8.
    flags = os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=4")
    env = kiln_env(XLA_FLAGS=flags)
    command = [sys.executable, "-u", "-m", "kiln.cli", "train", str(config)]
    command += [f"train.output_dir={runs}", "distributed.num_processes=2"]
    command += [f"distributed.coordinator_address=127.0.0.1:{port}"]
    return [
        subprocess.Popen(
            [*command, f"distributed.process_id={i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if i == 0 else subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]


def rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


def test_a_stopped_process_is_found_and_the_run_resumes_bitwise(tmp_path):
    config = write_config(tmp_path / "config.yaml", CONFIG)
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "r"
    procs = start(config, runs)
    try:
        # Stop process 1 once process 0 has logged step 13 (checkpoint 10 is saved): process 0
        # then waits for it in the next step's collectives.
        for line in procs[0].stdout:
            if line.startswith("step 13/"):
                os.kill(procs[1].pid, signal.SIGSTOP)
                stopped = time.monotonic()
                break
        else:
            raise AssertionError(f"process 0 ended with {procs[0].wait()} before step 13")
        out, _ = communicate(procs[0])
        detected = time.monotonic() - stopped
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == EXIT_HANG, out[-3000:]
    assert detected < TIMEOUT_S + 10, detected
    last = out.strip().splitlines()[-1]
    assert last.startswith("kiln: error: train.hang_timeout_s: no training step finished in "), last
    assert "on process 0 of 2" in last and "resume from checkpoint step 10" in last, last
    (report,) = (run_dir / "hangs").iterdir()
    assert report.name == f"{socket.gethostname()}-{procs[0].pid}.txt" and str(report) in last
    text = report.read_text()
    assert "process 0 of 2" in text and f"limit {TIMEOUT_S:.1f} s" in text, text[:1000]
    assert "thread MainThread" in text and "kiln/training/loop.py" in text, text[:3000]
    assert "kiln/training/watchdog.py" not in text  # the watchdog's own stack says nothing

    # The steps after checkpoint 10 that the stopped run logged are computed again alike.
    before = rows(run_dir)
    hung_at = max(before)
    assert hung_at >= 13, sorted(before)
    procs = start(config, runs)
    outs = [communicate(p) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][0][-3000:]
    assert "resuming from step 10" in outs[0][0]
    after = rows(run_dir)
    assert sorted(after) == list(range(1, 21))
    for step in range(1, hung_at + 1):
        assert after[step]["learning/loss"] == before[step]["learning/loss"], step
        assert after[step]["learning/grad_norm"] == before[step]["learning/grad_norm"], step
    # Goodput: the hung attempt's steps after checkpoint 10 are lost work.
    final = after[20]
    assert final["goodput/attempts"] == 2 and final["goodput/lost_steps"] == hung_at - 10
