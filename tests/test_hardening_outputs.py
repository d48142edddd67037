"""Attacks on a run directory's own files: a file of the wrong kind is bad input, one line
naming it, exit 2, before any work and with nothing written."""

import shutil
from pathlib import Path

import pytest

from conftest import kiln_main, make_config
from kiln.runs.checkpoint import Checkpointer
from kiln.training import train
from kiln.training.loop import checkpoint_tree

SEQ, BATCH = 16, 8
MODEL = {"vocab_size": 384, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32,
         "max_seq_len": SEQ}  # fmt: skip


def run_config(root: Path):
    """The config of a tiny run `r` under `root/runs` (constant schedule: a resume may train on)."""
    return make_config(
        model=MODEL, data={"source": "synthetic", "seq_len": SEQ}, mesh={"fsdp": -1},
        optim={"schedule": "constant", "warmup_steps": 0},
        train={"run_name": "r", "global_batch_size": BATCH, "steps": 4, "log_every_steps": 1},
        checkpoint={"async_save": False}, output_dir=root / "runs",
    )  # fmt: skip


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run directory of 4 steps: config.yaml and a checkpoint at step 2 of an initialised model."""
    config = run_config(tmp_path_factory.mktemp("saved"))
    ckpt = Checkpointer(config.run_dir, config.checkpoint)
    ckpt.save(2, checkpoint_tree(train.init_state(config)), {})
    ckpt.close()
    (config.run_dir / "config.yaml").write_text(config.to_yaml())
    return config.run_dir


def files(root: Path) -> dict[Path, tuple[int, int] | None]:
    """Every path under `root`, with a file's size and modification time."""
    return {
        p: (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
        for p in root.rglob("*")
    }


# ---------------------------------------------------------------------------------------------
# A run directory's own files of the wrong kind: refused naming the file, nothing written


def _a_directory(path: Path) -> None:
    path.mkdir()


def _a_file(path: Path) -> None:
    path.write_text("")


@pytest.mark.parametrize(
    "name, make, found, holds",
    [
        ("metrics.jsonl", _a_directory, "a directory", "a row of metrics per logged step"),
        ("config.yaml", _a_directory, "a directory", "its resolved config"),
        ("tensorboard", _a_file, "not a directory", "its TensorBoard event files"),
        ("checkpoints", _a_file, "not a directory", "its checkpoints"),
    ],
)
def test_a_run_file_of_the_wrong_kind_is_named_before_anything_is_written(
    tmp_path, saved_run, name, make, found, holds
):
    run_dir = tmp_path / "runs" / "r"
    shutil.copytree(saved_run, run_dir)
    config = tmp_path / "c.yaml"
    config.write_text(run_config(tmp_path).to_yaml())
    path = run_dir / name
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    make(path)
    kind = "a directory" if found == "not a directory" else "a regular file"
    before = files(tmp_path)
    proc = kiln_main("train", config, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"kiln: error: {path}: {found}, where the run keeps {holds}; allowed: {kind} or "
        "nothing (move it out of the run directory)"
    ]
    assert files(tmp_path) == before  # config.yaml included: nothing trained, nothing written
