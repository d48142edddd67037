"""Metrics of a resumed run: each step recorded once in metrics.jsonl and in TensorBoard."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kiln.checkpoint import latest_complete_step
from kiln.config import config_from_dict
from kiln.metrics import MetricsLogger


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensorboard_steps(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def log_steps(run_dir: Path, start_step: int, steps, loss) -> None:
    config = config_from_dict({"train": {"steps": 20}, "logging": {"progress": False}})
    logger = MetricsLogger(run_dir, config, enabled=True, start_step=start_step)
    for step in steps:
        logger.write(step, {"learning/loss": loss(step)})
    logger.close()


def test_resume_drops_later_rows_and_a_torn_line_and_purges_tensorboard(tmp_path):
    log_steps(tmp_path, 0, range(1, 11), lambda s: 1.0 / s)
    # The kill came in the middle of writing step 11's row.
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 11, "learning/lo')
    # Event files are named by the second they were opened in: a resume is never that fast.
    time.sleep(1.1)
    log_steps(tmp_path, 6, range(7, 13), lambda s: 2.0 / s)

    want = [(s, 1.0 / s) for s in range(1, 7)] + [(s, 2.0 / s) for s in range(7, 13)]
    got = [(r["step"], r["learning/loss"]) for r in rows(tmp_path)]
    assert got == want
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    steps, values = zip(*tensorboard_steps(tmp_path, "learning/loss"), strict=True)
    assert list(steps) == list(range(1, 13))
    # float32 events: 1e-6 relative covers the rounding of the stored values
    np.testing.assert_allclose(values, [v for _, v in want], rtol=1e-6)


def test_an_intact_file_is_left_as_it_is(tmp_path):
    log_steps(tmp_path, 0, range(1, 4), float)
    before = (tmp_path / "metrics.jsonl").stat()
    log_steps(tmp_path, 3, [4], float)
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4]
    # Appended to in place, not rewritten.
    assert (tmp_path / "metrics.jsonl").stat().st_ino == before.st_ino


# ---------------------------------------------------------------------------------------------
# As a user meets it: `kiln train` killed with kill -9 after a checkpoint, then run again


def write_config(tmp_path: Path, corpus: Path) -> Path:
    cfg = {
        "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_seq_len": 16},
        "data": {"source": "text", "paths": [str(corpus)], "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
        "mesh": {"fsdp": -1},
        "optim": {"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0},
        "train": {"output_dir": str(tmp_path / "runs"), "run_name": "r", "global_batch_size": 8, "log_every_steps": 1, "steps": 12},
        "checkpoint": {"every_steps": 4, "keep": 2, "async_save": False},
        "logging": {"progress": False},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def kiln_train(config: Path, *overrides) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "train", str(config), *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return err


def without_timing(table: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in table]


@pytest.mark.slow
def test_kill_9_then_resume_logs_each_step_once(tmp_path):
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    corpus.write_text(" ".join(rng.choice(["kiln", "loss", "step", "mesh"], size=3000)) + "\n")
    (tmp_path / "straight").mkdir()
    straight = kiln_train(write_config(tmp_path / "straight", corpus))
    config = write_config(tmp_path, corpus)
    run_dir = tmp_path / "runs" / "r"
    killed = kiln_train(config, "train.steps=100000")  # never finishes by itself
    try:
        deadline = time.monotonic() + 600
        # Past the checkpoint at step 4, so steps after it are logged twice without the fix.
        while not (run_dir / "metrics.jsonl").is_file() or len(rows(run_dir)) < 6:
            assert killed.poll() is None, killed.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 6"
            time.sleep(0.01)
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.communicate(timeout=60)
    finish(straight)
    complete_lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    logged = [json.loads(line)["step"] for line in complete_lines]
    last_checkpoint = latest_complete_step(run_dir / "checkpoints")
    if last_checkpoint >= 12:
        pytest.skip("the killed run got past step 12 before the kill")
    assert max(logged) > last_checkpoint  # there is something to drop

    err = finish(kiln_train(config))
    assert f"resuming from step {last_checkpoint}" in err
    want = rows(tmp_path / "straight" / "runs" / "r")
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, 13))
    assert without_timing(got) == without_timing(want)  # bitwise: resume is exact
    tb = tensorboard_steps(run_dir, "learning/loss")
    assert [s for s, _ in tb] == list(range(1, 13))
    # float32 events against the float64 JSON values: 1e-6 relative covers the rounding
    np.testing.assert_allclose([v for _, v in tb], [r["learning/loss"] for r in want], rtol=1e-6)
