"""Multi-process runs on 127.0.0.1: 2 processes x 4 CPU devices against 1 process x 8 devices."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, kiln, kiln_env, kiln_main, run_process, write_config

pytestmark = pytest.mark.slow

LAUNCH = REPO / "scripts" / "launch_local.sh"

# Gradient accumulation and the vocabulary-tiled loss both run across the process boundary: the
# fsdp axis spans all 8 devices, so each process holds half of every parameter and batch.
CONFIG = {
    "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_seq_len": 16, "dtype": "float32"},
    "data": {"source": "synthetic", "synthetic_kind": "markov", "paths": [], "seq_len": 16},
    "mesh": {"fsdp": -1},
    "optim": {"learning_rate": 3e-3, "schedule": "constant", "warmup_steps": 0},
    "loss": {"num_vocab_tiling": 2, "z_loss_multiplier": 1e-4},
    "train": {"run_name": "r", "global_batch_size": 16, "gradient_accumulation_steps": 2, "log_every_steps": 1, "steps": 5},
    "checkpoint": {"every_steps": 5, "async_save": False},
    "distributed": {"init_timeout_s": 120, "heartbeat_timeout_s": 30},
}  # fmt: skip


def write_run_config(tmp: Path) -> Path:
    return write_config(tmp / "config.yaml", CONFIG)


def one_process(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`kiln train` in this process, with the 8 devices of conftest's XLA_FLAGS: a run of one
    process needs no process of its own, and computes as a `kiln` subprocess does."""
    return kiln_main("train", config, *overrides)


def two_processes(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`scripts/launch_local.sh 2 ...`: two processes with 4 devices each."""
    return run_process(
        ["bash", str(LAUNCH), "2", str(config), *overrides], env=kiln_env(PYTHON=sys.executable)
    )


def four_devices(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`scripts/launch_local.sh --devices-per-process 4 1 ...`: one process with 4 devices, as on
    a machine that has only those (kiln's mesh spans every device present)."""
    command = ["bash", str(LAUNCH), "--devices-per-process", "4", "1", str(config), *overrides]
    return run_process(command, env=kiln_env(PYTHON=sys.executable))


def moved(stderr: str) -> list[str]:
    """The lines a resume on another topology printed."""
    return [line for line in stderr.splitlines() if "resuming on another topology" in line]


def data_state(run_dir: Path, step: int) -> dict:
    """The data iterator's state saved with checkpoint `step` (orbax's JSON item)."""
    return json.loads((run_dir / "checkpoints" / str(step) / "data" / "metadata").read_text())


def losses(run_dir: Path) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["learning/loss"] for r in records if "learning/loss" in r}


def figures(run_dir: Path, steps) -> list[tuple[float, float]]:
    """(loss, grad norm) of each of `steps`."""
    rows = {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }
    return [(rows[s]["learning/loss"], rows[s]["learning/grad_norm"]) for s in steps]


def assert_close(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        # 1e-5 relative: the same arithmetic, only the order of cross-process sums may differ.
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)


def test_two_processes_match_one_and_checkpoints_move_between_them(tmp_path):
    config = write_run_config(tmp_path)
    runs = tmp_path / "runs"

    # Reference: one process, 8 steps, checkpoints at steps 5 and 8.
    ref = one_process(config, f"train.output_dir={runs}", "train.run_name=ref", "train.steps=8")
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = losses(runs / "ref")
    assert sorted(want) == list(range(1, 9))

    # Two processes, 5 steps: the same losses; only process 0 writes the run directory's logs.
    # Each also saves its shards to a local tier at steps 2 and 4 (persistent: 3 and 5).
    local = tmp_path / "node-local"
    tiers = [
        f"checkpoint.local_dir={local}",
        "checkpoint.local_every_steps=2",
        "checkpoint.async_save=true",
    ]
    two = two_processes(
        config, f"train.output_dir={runs}", "train.run_name=two", "checkpoint.every_steps=3", *tiers
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert sorted(losses(runs / "two")) == [1, 2, 3, 4, 5]
    assert_close(losses(runs / "two"), want, range(1, 6))
    assert sorted(p.name for p in (local / "two").iterdir()) == ["process_0", "process_1"]
    printed = [line for line in two.stdout.splitlines() if "step 5/5" in line]
    assert printed and all(line.startswith("[0] ") for line in printed), printed
    assert len(list((runs / "two" / "tensorboard").iterdir())) == 1  # one event file
    assert (runs / "two" / "checkpoints" / "5").is_dir()

    # A copy for the 4-device resume below.
    shutil.copytree(runs / "two", runs / "four")

    # Without step 5 the local step 4 is newer than the persistent step 3, but process 1's part
    # of it is gone (its host's disk): two processes resume from the persistent tier, and the
    # losses and grad norms of steps 4 and 5 are bitwise those computed before.
    before = figures(runs / "two", [4, 5])
    shutil.rmtree(runs / "two" / "checkpoints" / "5")
    shutil.rmtree(local / "two" / "process_1")
    again = two_processes(config, f"train.output_dir={runs}", "train.run_name=two", *tiers)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from step 3 (" in again.stderr, again.stderr[-3000:]
    skipped = (
        "local checkpoint step 4 skipped: not complete on every process (missing on process 1)"
    )
    assert skipped in again.stderr, again.stderr[-3000:]
    assert figures(runs / "two", [4, 5]) == before

    # The 2-process checkpoint resumes in one process, and says the topology changed.
    resumed = one_process(config, f"train.output_dir={runs}", "train.run_name=two", "train.steps=8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 5" in resumed.stderr
    assert moved(resumed.stderr) == [
        "kiln: resuming on another topology: 2 processes x 4 cpu devices (fsdp 8) -> "
        "1 process x 8 cpu devices (fsdp 8)"
    ], resumed.stderr[-3000:]
    assert_close(losses(runs / "two"), want, range(6, 9))

    # And on 4 devices, with twice the gradient accumulation (4 micro-batches of 4 sequences
    # instead of 2 of 8) to keep the global batch: the same batches in the same order.
    resumed = four_devices(
        config,
        f"train.output_dir={runs}",
        "train.run_name=four",
        "train.steps=8",
        "train.gradient_accumulation_steps=4",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert moved(resumed.stderr) == [
        "[0] kiln: resuming on another topology: 2 processes x 4 cpu devices (fsdp 8) -> "
        "1 process x 4 cpu devices (fsdp 4)"
    ], resumed.stderr[-3000:]
    assert data_state(runs / "four", 8) == data_state(runs / "ref", 8)
    assert sorted(losses(runs / "four")) == list(range(1, 9))
    # 1e-5 relative, as above: only the order of the sums differs (micro-batches, shards).
    assert_close(losses(runs / "four"), want, range(6, 9))

    # And the reverse: the reference run cut back to its step-5 checkpoint, resumed by two for
    # one step (each step of two processes costs each of them tenths of a CPU second in gloo).
    shutil.copytree(runs / "ref", runs / "cut")
    shutil.rmtree(runs / "cut" / "checkpoints" / "8")
    (runs / "cut" / "metrics.jsonl").unlink()
    resumed = two_processes(
        config, f"train.output_dir={runs}", "train.run_name=cut", "train.steps=6"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 5" in resumed.stderr
    assert moved(resumed.stderr) == [
        "[0] kiln: resuming on another topology: 1 process x 8 cpu devices (fsdp 8) -> "
        "2 processes x 4 cpu devices (fsdp 8)"
    ], resumed.stderr[-3000:]
    assert sorted(losses(runs / "cut")) == [6]
    assert_close(losses(runs / "cut"), want, [6])


@pytest.mark.parametrize("present", [0, 1], ids=["coordinator-alone", "coordinator-missing"])
def test_a_process_that_never_starts_stops_the_other_with_a_clear_message(tmp_path, present):
    config = write_run_config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    timeout_s = 5
    # By subprocess: the process joins jax.distributed, and kiln's deadline ends it (os._exit).
    proc = kiln(
        "train",
        config,
        f"train.output_dir={tmp_path / 'runs'}",
        f"distributed.coordinator_address={address}",
        "distributed.num_processes=2",
        f"distributed.process_id={present}",
        f"distributed.init_timeout_s={timeout_s}",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("kiln: error: distributed.init_timeout_s:"), lines[-5:]
    assert f"process {present} of 2" in lines[-1] and address in lines[-1]
    # kiln's own deadline fired: JAX's, 15 s later, aborts with an RPC trace instead.
    assert not (tmp_path / "runs").exists()  # nothing written
