"""Attacks on what `kiln import-hf`, `kiln export-hf` and `kiln compare` write, and on a run
directory's own files. An output that cannot be written is bad input: one line naming it, exit 2,
before any work and with nothing written. A full disk is a fault: one line, exit 1, nothing
half-written left behind, and the same command run again after space is freed does the work."""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import SafetensorError

from conftest import files, kiln_main, make_config
from kiln.commands.hf import export_hf
from kiln.runs.checkpoint import Checkpointer, latest_complete_step
from kiln.training import train
from kiln.training.loop import checkpoint_tree
from test_hardening_writes import BATCH, MODEL, ROOT, SEQ, file_in_the_way, read_only_out

ENOSPC = os.strerror(errno.ENOSPC)


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


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, saved_run) -> Path:
    """The saved run as a Hugging Face model directory (config.json, model.safetensors)."""
    out = tmp_path_factory.mktemp("hf") / "model"
    export_hf(saved_run, out)
    return out


def metrics_run(root: Path) -> Path:
    """A run directory holding only a metrics.jsonl of two steps (what `kiln compare` reads)."""
    run = root / "logged"
    run.mkdir()
    rows = [{"step": s, "learning/loss": 5.0 - s} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


# ---------------------------------------------------------------------------------------------
# Unwritable outputs: refused before any work, in one line naming --out


@pytest.mark.parametrize("command", ["import-hf", "export-hf", "compare"])
@pytest.mark.parametrize(
    "where, why",
    [
        pytest.param(read_only_out, "cannot be created or written (Permission denied in {tmp}/ro)",
                     marks=ROOT, id="read-only"),
        pytest.param(lambda _: Path("/proc/kiln-out"),
                     "cannot be created or written (No such file or directory in /proc)", id="proc"),
        pytest.param(file_in_the_way, "cannot be created: {tmp}/afile is not a directory",
                     id="file-in-the-way"),
    ],
)  # fmt: skip
def test_unwritable_output_is_refused_before_any_work(
    tmp_path, saved_run, hf_dir, command, where, why
):
    target = where(tmp_path)  # the directory to write, or (compare) the image's directory
    if command == "import-hf":
        args = ("import-hf", hf_dir, "--out", target)
    elif command == "export-hf":
        args = ("export-hf", saved_run, "--out", target)
    else:
        args = ("compare", metrics_run(tmp_path), "--out", target / "cmp.png")
    before = files(tmp_path)
    proc = kiln_main(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"kiln: error: --out: {target} {why.format(tmp=tmp_path)}; allowed: a directory kiln "
        "can create or write"
    ]
    assert proc.stdout == ""
    assert files(tmp_path) == before


def test_compare_refuses_an_image_path_that_is_a_directory(tmp_path):
    run, out = metrics_run(tmp_path), tmp_path / "cmp.png"
    out.mkdir()
    before = files(tmp_path)
    proc = kiln_main("compare", run, "--out", out)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"kiln: error: --out: {out} is a directory; allowed: the path of an image file"
    ]
    assert files(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# A full disk while writing: one line, exit 1, nothing half-written, and the rerun works


def full_safetensors(tensors, path, metadata=None):
    """safetensors' `save_file` on a disk that fills up: half the file, then its error."""
    Path(path).write_bytes(b"\0" * 4096)
    raise SafetensorError(f"Error while serializing: I/O error: {ENOSPC} (os error 28)")


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, ENOSPC)


@pytest.mark.parametrize("command", ["export-hf", "import-hf", "compare"])
def test_full_disk_keeps_nothing_half_written_and_the_rerun_works(
    tmp_path, monkeypatch, saved_run, hf_dir, command
):
    if command == "export-hf":
        out, then = tmp_path / "hf", "export it"
        args = ("export-hf", saved_run, "--out", out)
        # config.json is written first, then the weights fill the disk.
        monkeypatch.setattr("kiln.commands.hf.save_file", full_safetensors)
    elif command == "import-hf":
        out, then = tmp_path / "imported", "import it"
        args = ("import-hf", hf_dir, "--out", out)
        # orbax has written the step's arrays; the checksums sealing it fill the disk.
        monkeypatch.setattr("kiln.runs.checkpoint.write_manifest", full_disk)
    else:
        out, then = tmp_path / "cmp.png", "plot the runs"
        out.write_bytes(b"the previous image")  # replaced whole or not at all
        args = ("compare", metrics_run(tmp_path), "--out", out)
        monkeypatch.setattr(os, "fsync", full_disk)  # the image's bytes reach no disk
    before = files(tmp_path)
    proc = kiln_main(*args, cwd=tmp_path)
    monkeypatch.undo()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"kiln: error: no space left on device writing {out}; nothing half-written was kept: "
        f"free space, then run the same command again to {then}"
    ]
    assert files(tmp_path) == before  # no partial output, no staging directory
    proc = kiln_main(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if command == "export-hf":
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    elif command == "import-hf":
        assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.yaml"]
        assert latest_complete_step(out / "checkpoints") == 0
    else:
        assert out.read_bytes().startswith(b"\x89PNG")
    assert not list(tmp_path.glob(".*"))  # no staging directory or temporary file


def test_full_disk_into_an_existing_empty_out_leaves_it_empty(tmp_path, monkeypatch, saved_run):
    out = tmp_path / "mounted"  # an existing empty directory (a mount point): staged inside it
    out.mkdir()
    monkeypatch.setattr("kiln.commands.hf.save_file", full_safetensors)
    proc = kiln_main("export-hf", saved_run, "--out", out)
    monkeypatch.undo()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"kiln: error: no space left on device writing {out}; nothing half-written was kept: "
        "free space, then run the same command again to export it"
    ]
    assert list(out.iterdir()) == []  # no staging directory, no entry moved up
    assert kiln_main("export-hf", saved_run, "--out", out).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_staging_directories_of_dead_writers_are_removed(tmp_path, saved_run):
    """A writer that died with its machine leaves its staging directory: beside a new --out,
    or inside an existing empty one, which still counts as empty. The next run removes it."""
    writer = f"partial-{socket.gethostname()}-{dead_pid()}"
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for left in (tmp_path / f".new.{writer}", empty / f".{writer}"):
        left.mkdir()
        (left / "config.json").write_text("{")
    for out in (new, empty):
        proc = kiln_main("export-hf", saved_run, "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]


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


# ---------------------------------------------------------------------------------------------
# Another model in a run directory with metrics but no checkpoint: refused, as with checkpoints


def test_a_model_change_is_refused_before_the_first_checkpoint(tmp_path):
    earlier = run_config(tmp_path)
    run_dir = earlier.run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(earlier.to_yaml())
    rows = [{"step": s, "learning/loss": 6.0 - s} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "c.yaml"
    config.write_text(earlier.to_yaml())
    before = files(tmp_path)
    proc = kiln_main("train", config, "model.d_ff=64", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"kiln: error: model.d_ff: the run in {run_dir} was started with 32, this config says 64; "
        "a run cannot change it, even before its first checkpoint: its directory holds the "
        "metrics of one model and token stream (use a new train.run_name, or --restart to start "
        "this run over)"
    ]
    assert files(tmp_path) == before  # nothing moved aside, nothing written
