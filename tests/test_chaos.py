"""Restarts belong to the scheduler: a 2-process run killed with kill -9 five times, at seeded
random moments, and hung once (one process stopped: the hang watchdog, train.hang_timeout_s),
restarted each time as a scheduler would, ends bitwise where an uninterrupted run ends."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import kiln_env, write_config, xla_flags_with
from kiln.config import load_config
from kiln.parallel.mesh import make_mesh
from kiln.runs.checkpoint import latest_complete_step
from kiln.runs.restore import abstract_like, restore
from kiln.training import train
from kiln.training.loop import checkpoint_tree

pytestmark = pytest.mark.slow

STEPS = 12
EXIT_HANG = 75  # kiln.training.watchdog.EXIT_HANG, as a scheduler sees it
TIMEOUT_S = 3
CONFIG = {
    "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_seq_len": 16, "dtype": "float32"},
    "data": {"source": "synthetic", "synthetic_kind": "markov", "paths": [], "seq_len": 16},
    "mesh": {"fsdp": -1},
    "optim": {"learning_rate": 3e-3, "schedule": "constant", "warmup_steps": 0},
    "train": {"run_name": "r", "global_batch_size": 16, "log_every_steps": 1, "steps": STEPS, "hang_timeout_s": TIMEOUT_S},
    "checkpoint": {"every_steps": 2, "keep": 2, "async_save": True},
    # A process whose partner was killed stops (exit 134) this long after the partner's last
    # heartbeat: short, to keep the test short, and far above the pauses of a healthy process.
    "distributed": {"init_timeout_s": 120, "heartbeat_timeout_s": 10},
}  # fmt: skip

# What docs/multihost.md tells a scheduler to restart: a process killed (137), one that JAX
# ended because its partner died (134), and one whose steps stopped finishing (75, the hang
# watchdog: a process waiting in a collective for its killed partner may see that first). Any
# other exit of an interrupted attempt is a failure.
RESTART = {-signal.SIGKILL, -signal.SIGABRT, 134, 137, EXIT_HANG}


def start(config: Path, runs: Path, logs: Path, attempt: int, *more: str) -> list[subprocess.Popen]:
    """Two `kiln train` processes with 1 CPU device each (`scripts/launch_local.sh
    --devices-per-process 1 2`): what is killed and restarted is the process, and a step's
    collectives between processes cost least CPU time with one device in each (gloo: one rank
    per device; 2 devices each took a fifth more CPU time); process i's output (stderr
    merged) goes to logs/<attempt>-<i>.txt."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = xla_flags_with(1)
    command = [sys.executable, "-u", "-m", "kiln.cli", "train", str(config)]
    command += [f"train.output_dir={runs}", "distributed.num_processes=2"]
    command += [f"distributed.coordinator_address=127.0.0.1:{port}", *more]
    procs = []
    for i in range(2):
        with open(logs / f"{attempt}-{i}.txt", "w") as out:
            procs.append(
                subprocess.Popen(
                    [*command, f"distributed.process_id={i}"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=kiln_env(XLA_FLAGS=flags),
                )
            )
    return procs


def last_step(log: Path) -> int:
    """The last step process 0 printed (0 before the first)."""
    found = re.findall(r"^step (\d+)/", log.read_text(), re.M)
    return int(found[-1]) if found else 0


def wait_all(procs: list[subprocess.Popen], limit_s: float = 300) -> list[int]:
    """Exit codes of `procs`, waiting at most `limit_s` for each (then it is killed)."""
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(limit_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"process {proc.args[-1]} did not stop in {limit_s} s") from None
    return codes


def final_state(config: Path, runs: Path):
    """The run's final checkpoint: the whole train state (parameters, optimizer, step)."""
    c = load_config(config, [f"train.output_dir={runs}"])
    _, state = train.abstract_pretraining(c, make_mesh(c))
    directory = c.run_dir / "checkpoints"
    step = latest_complete_step(directory)
    tree, data = restore(directory, step, abstract_like(checkpoint_tree(state)))
    return step, jax.tree.map(np.asarray, jax.device_get(tree)), data


def test_five_kill_9s_a_hang_and_restarts_end_bitwise_where_an_uninterrupted_run_ends(tmp_path):
    config = write_config(tmp_path / "config.yaml", CONFIG)
    logs = tmp_path / "logs"
    logs.mkdir()
    # The reference: one uninterrupted attempt.
    straight = tmp_path / "straight"
    procs = start(config, straight, logs, 0)
    assert wait_all(procs) == [0, 0], (logs / "0-0.txt").read_text()[-3000:]

    runs = tmp_path / "chaos"
    # A hang: process 1 stopped (SIGSTOP) after a step; process 0 waits for it in the next
    # step's collectives, and its watchdog writes its stacks and exits 75 within the timeout.
    # First, from the start, saving every 4 steps: once step 5 is logged (checkpoint 4 is saved
    # or saving), process 0 waits in the collectives of step 6 or 7, not in a save (untimed).
    procs = start(config, runs, logs, 1, "checkpoint.every_steps=4")
    log = logs / "1-0.txt"
    while last_step(log) < 5:
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(0.01)
    os.kill(procs[1].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    hung_code = wait_all(procs[:1])[0]
    detected = time.monotonic() - stopped
    procs[1].kill()  # the scheduler ends the job's other process
    procs[1].wait()
    last = log.read_text().strip().splitlines()[-1]
    assert hung_code == EXIT_HANG, log.read_text()[-3000:]
    assert detected < TIMEOUT_S + 10, detected
    assert last.startswith("kiln: error: train.hang_timeout_s: no training step finished in "), last
    assert "on process 0 of 2" in last and "resume from checkpoint step" in last, last
    (report,) = (runs / "r" / "hangs").glob(f"*-{procs[0].pid}.txt")
    assert str(report) in last
    text = report.read_text()
    assert "process 0 of 2" in text and f"limit {TIMEOUT_S:.1f} s" in text, text[:1000]
    assert "thread MainThread" in text and "kiln/training/loop.py" in text, text[:3000]
    assert "kiln/training/watchdog.py" not in text  # the watchdog's own stack says nothing

    # Then five kill -9s.
    rng = random.Random(47)
    kills = []
    for attempt in range(2, 7):
        procs = start(config, runs, logs, attempt)
        log = logs / f"{attempt}-0.txt"
        victims = rng.choice([(0,), (1,), (0, 1)])
        # Both processes may die in start-up (joining, compiling, restoring). One alone is killed
        # while training: killed before it joined, it would leave its partner waiting
        # distributed.init_timeout_s for it, then exit 1 (as docs/multihost.md says).
        if victims == (0, 1) and rng.random() < 0.5:
            time.sleep(rng.uniform(0, 5))
            moment = "start-up"
        else:  # while training and saving: after a step, part way to the next
            target = rng.randint(2, STEPS - 4)  # a resume then still has steps to kill in
            delay = rng.uniform(0, 0.3)
            while last_step(log) < target and all(p.poll() is None for p in procs):
                time.sleep(0.01)
            time.sleep(delay)
            moment = f"step {last_step(log)}"
        for i in victims:
            os.kill(procs[i].pid, signal.SIGKILL)
        codes = wait_all(procs)
        kills.append((attempt, victims, moment, codes))
        assert all(code in RESTART for code in codes), (kills, log.read_text()[-3000:])

    # The scheduler's last restart runs to the end.
    procs = start(config, runs, logs, 7)
    codes = wait_all(procs)
    assert codes == [0, 0], (kills, (logs / "7-0.txt").read_text()[-3000:])
    assert not [f for f in logs.iterdir() if "another topology" in f.read_text()]

    want, got = final_state(config, straight), final_state(config, runs)
    assert got[0] == want[0] == STEPS
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: the same arithmetic in the same order
    assert got[2] == want[2]  # the data iterator's state
