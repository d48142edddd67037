"""Metrics of a resumed run: each step recorded once in metrics.jsonl and in TensorBoard."""

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import communicate, kiln_env, kiln_main, run_process, wait_until
from kiln.config import config_from_dict
from kiln.runs.checkpoint import latest_complete_step
from kiln.training.metrics import MetricsLogger


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


def test_resume_drops_later_rows_and_a_torn_line_and_purges_tensorboard(tmp_path, capsys):
    log_steps(tmp_path, 0, range(1, 11), lambda s: 1.0 / s)
    # The kill came in the middle of writing step 11's row.
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 11, "learning/lo')
    # Event files are named by the second they were opened in: a resume is never that fast.
    time.sleep(1.1)
    capsys.readouterr()
    log_steps(tmp_path, 6, range(7, 13), lambda s: 2.0 / s)
    assert (
        "kiln: metrics.jsonl: dropped 5 rows of steps 7..11, logged after step 6 by the "
        "interrupted run; line 11 (step 11) was damaged; they are logged again"
    ) in capsys.readouterr().err

    want = [(s, 1.0 / s) for s in range(1, 7)] + [(s, 2.0 / s) for s in range(7, 13)]
    got = [(r["step"], r["learning/loss"]) for r in rows(tmp_path)]
    assert got == want
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]  # no temporary left
    # The torn row is of a step logged again: dropped with the others, nothing set aside.
    assert not (tmp_path / "metrics.jsonl.damaged").exists()
    steps, values = zip(*tensorboard_steps(tmp_path, "learning/loss"), strict=True)
    assert list(steps) == list(range(1, 13))
    # float32 events: 1e-6 relative covers the rounding of the stored values
    np.testing.assert_allclose(values, [v for _, v in want], rtol=1e-6)


@pytest.mark.parametrize(
    ("damage", "where", "fate"),
    [
        (b'{"step": 2, "learning/lo', "line 2 (step 2)", "step 2 is not logged again"),
        (
            b"\x00\x00\x00",
            "line 2 (between steps 1 and 3)",
            "its step, before 4, is not logged again",
        ),
    ],
    ids=["torn", "garbled"],
)
def test_a_damaged_row_before_the_resume_step_is_named_and_kept_aside(
    tmp_path, capsys, damage, where, fate
):
    log_steps(tmp_path, 0, range(1, 7), float)
    path = tmp_path / "metrics.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[1] = damage  # step 2's row, in the middle of the file
    path.write_bytes(b"\n".join(lines))
    capsys.readouterr()
    log_steps(tmp_path, 4, range(5, 8), lambda s: 10.0 * s)

    # Every intact row up to the resume step stays; the later ones are logged again.
    assert [(r["step"], r["learning/loss"]) for r in rows(tmp_path)] == [
        (1, 1.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0), (7, 70.0)
    ]  # fmt: skip
    aside = tmp_path / "metrics.jsonl.damaged"
    assert aside.read_bytes() == damage + b"\n"  # nothing lost
    err = [line for line in capsys.readouterr().err.splitlines() if "metrics.jsonl" in line]
    assert err == [
        "kiln: metrics.jsonl: dropped 2 rows of steps 5..6, logged after step 4 by the "
        "interrupted run; they are logged again",
        f"kiln: metrics.jsonl: {where} is damaged, not a JSON row: moved to {aside} ({fate}); "
        "every intact row is kept",
    ], err


def test_an_intact_file_is_left_as_it_is(tmp_path):
    log_steps(tmp_path, 0, range(1, 4), float)
    before = (tmp_path / "metrics.jsonl").stat()
    log_steps(tmp_path, 3, [4], float)
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4]
    # Appended to in place, not rewritten.
    assert (tmp_path / "metrics.jsonl").stat().st_ino == before.st_ino


# ---------------------------------------------------------------------------------------------
# As a user meets it: `kiln train` killed with kill -9 after a checkpoint, then run again


def write_config(tmp_path: Path, corpus: Path, cache: Path, **checkpoint) -> Path:
    """The run's config; `cache`: the JAX compilation cache its runs share (compile_cache)."""
    cfg = {
        "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_seq_len": 16},
        "data": {"source": "text", "paths": [str(corpus)], "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
        "mesh": {"fsdp": -1},
        "optim": {"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0},
        "train": {"output_dir": str(tmp_path / "runs"), "run_name": "r", "global_batch_size": 8, "log_every_steps": 1, "steps": 12,
                  "compilation_cache_dir": str(cache)},
        "checkpoint": {"every_steps": 4, "keep": 2, "async_save": False, **checkpoint},
        "logging": {"progress": False},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def start_train(config: Path, *overrides) -> subprocess.Popen:
    """`kiln train` in a subprocess, to be killed."""
    return subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "train", str(config), *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=kiln_env(),
    )


def kiln_train(config: Path, *overrides) -> str:
    """`kiln train` in this process, which must succeed; its stderr."""
    proc = kiln_main("train", config, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def without_timing(table: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "goodput/"))} for r in table]


def write_corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    corpus.write_text(" ".join(rng.choice(["kiln", "loss", "step", "mesh"], size=3000)) + "\n")
    return corpus


@pytest.fixture(scope="module")
def straight(tmp_path_factory, compile_cache) -> list[dict]:
    """The rows of the 12-step run that nothing interrupted, the reference of the tests below."""
    tmp_path = tmp_path_factory.mktemp("straight")
    kiln_train(write_config(tmp_path, write_corpus(tmp_path), compile_cache))
    return rows(tmp_path / "runs" / "r")


@pytest.mark.slow
def test_kill_9_then_resume_logs_each_step_once(tmp_path, straight, compile_cache):
    corpus = write_corpus(tmp_path)
    config = write_config(tmp_path, corpus, compile_cache)
    run_dir = tmp_path / "runs" / "r"
    killed = start_train(config, "train.steps=100000")  # never finishes by itself
    try:
        # Past the checkpoint at step 4, so steps after it are logged twice without the fix.
        wait_until(
            lambda: (run_dir / "metrics.jsonl").is_file() and len(rows(run_dir)) >= 6,
            killed,
            "step 6",
        )
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        communicate(killed)
    complete_lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    logged = [json.loads(line)["step"] for line in complete_lines]
    last_checkpoint = latest_complete_step(run_dir / "checkpoints")
    if last_checkpoint >= 12:
        pytest.skip("the killed run got past step 12 before the kill")
    assert max(logged) > last_checkpoint  # there is something to drop

    err = kiln_train(config)
    assert f"resuming from step {last_checkpoint}" in err
    want = straight
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, 13))
    assert without_timing(got) == without_timing(want)  # bitwise: resume is exact
    tb = tensorboard_steps(run_dir, "learning/loss")
    assert [s for s, _ in tb] == list(range(1, 13))
    # float32 events against the float64 JSON values: 1e-6 relative covers the rounding
    np.testing.assert_allclose([v for _, v in tb], [r["learning/loss"] for r in want], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# A full disk, then a read-only checkpoints directory, then a resume


class DiskFills:
    """A file on a disk that fills up half-way through its write number `rows`: the fault is
    injected in the file object kiln gets from open(), below kiln's code."""

    def __init__(self, fh, rows: int):
        self.fh, self.rows = fh, rows

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def write(self, data):
        self.rows -= 1
        if self.rows < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.fh.write(bytes(data) if self.rows else bytes(data[: len(data) // 2]))


def open_filling_metrics(rows: int):
    """builtins.open, but metrics.jsonl opened to append is on a disk that fills at write `rows`."""
    real_open = builtins.open

    def fake_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return DiskFills(fh, rows) if str(file).endswith("metrics.jsonl") and "a" in mode else fh

    return fake_open


def read_only(path: Path, command: list[str]) -> list[str]:
    """`command` with `path` read-only: chmod for a user, a read-only bind mount for root
    (who writes through chmod) in a private user and mount namespace."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return command
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("running as root without user namespaces: no way to make a path read-only")
    mount = f'mount --bind {path} {path} && mount -o remount,bind,ro {path} && exec "$@"'
    return ["unshare", "-rm", "sh", "-c", mount, "sh", *command]


@pytest.mark.slow
def test_full_then_read_only_disk_then_resume_logs_what_an_uninterrupted_run_logs(
    tmp_path, straight, compile_cache, monkeypatch
):
    config = write_config(tmp_path, write_corpus(tmp_path), compile_cache, async_save=True)
    run_dir = tmp_path / "runs" / "r"
    env = kiln_env()
    # 1. The disk fills up half-way through the row of step 6 (after the checkpoint of step 4).
    monkeypatch.setattr(builtins, "open", open_filling_metrics(6))
    full = kiln_main("train", config)
    monkeypatch.undo()
    assert full.returncode == 1, full.stderr[-3000:]
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    errors = [line for line in full.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and "no space left on device writing" in errors[0], full.stderr
    assert str(run_dir / "metrics.jsonl") in errors[0]
    assert (run_dir / "metrics.jsonl").read_bytes().endswith(b"\n")  # nothing torn
    assert not (run_dir / "kiln.lock").exists()

    # 2. Resumed with a read-only checkpoints directory: the first save fails in one line.
    kept = latest_complete_step(run_dir / "checkpoints")
    assert kept is not None and kept < 12
    checkpoints = run_dir / "checkpoints"
    command = [sys.executable, "-m", "kiln.cli", "train", str(config)]
    blocked = run_process(read_only(checkpoints, command), env=env)
    checkpoints.chmod(0o755)
    assert blocked.returncode == 1, blocked.stderr[-3000:]
    assert "Traceback" not in blocked.stderr and "Event loop" not in blocked.stderr
    errors = [line for line in blocked.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1, blocked.stderr[-3000:]
    assert f"cannot write {checkpoints}" in errors[0] and f"(step {kept})" in errors[0]
    assert latest_complete_step(checkpoints) == kept  # the last good checkpoint stays

    # 3. With the disk fixed, the run resumes and ends as if nothing had happened.
    assert f"resuming from step {kept}" in kiln_train(config)
    got = rows(run_dir)
    assert (run_dir / "metrics.jsonl").read_bytes().endswith(b"\n")
    assert [r["step"] for r in got] == list(range(1, 13))  # strictly increasing, each once
    assert without_timing(got) == without_timing(straight)  # bitwise: resume is exact
