"""Checkpoint integrity: each step sealed by a manifest of checksums; damage of any kind is
reported as damage and the newest intact step restored; pinned inputs of a resumed run."""

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import make_config
from kiln.distill import online as distill
from kiln.errors import KilnError
from kiln.parallel.mesh import make_mesh
from kiln.runs import pinned
from kiln.runs.checkpoint import Checkpointer, complete_steps
from kiln.runs.restore import abstract_like, restore, restore_newest_intact, restore_params
from kiln.training import train
from kiln.training.loop import checkpoint_tree, skip_cause
from kiln.util import checksums
from kiln.util.checksums import set_aside

MODEL = {"vocab_size": 384, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32, "max_seq_len": 16}  # fmt: skip


def tiny_config(tmp_path, **sections):
    return make_config(
        model={**MODEL, **sections.pop("model", {})},
        data={"source": "synthetic", "seq_len": 16},
        mesh={"fsdp": -1},
        train={"global_batch_size": 8, "steps": 4, **sections.pop("train", {})},
        output_dir=tmp_path,
        **sections,
    )


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    """A tiny train state, and the same with every parameter shifted (a distinct 'later' step)."""
    config = tiny_config(tmp_path_factory.mktemp("cfg"))
    state = train.init_state(config)
    later = state.replace(step=state.step + 2, params=jax.tree.map(lambda p: p + 1.0, state.params))
    return config, state, later


def write_two(run_dir: Path, states, *, async_save: bool) -> Path:
    """Checkpoints at steps 1 and 3 (the later state), sealed; returns the checkpoints dir."""
    config, state, later = states
    ckpt = Checkpointer(run_dir, config.checkpoint.model_copy(update={"async_save": async_save}))
    ckpt.save(1, checkpoint_tree(state.replace(step=state.step + 1)), {"next_index": 1})
    ckpt.save(3, checkpoint_tree(later.replace(step=later.step + 1)), {"next_index": 3})
    ckpt.close()
    return run_dir / "checkpoints"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, states):
    """write_two's checkpoints, saved once with async saves and once without."""
    root = tmp_path_factory.mktemp("saved")
    return {a: write_two(root / f"async_{a}", states, async_save=a) for a in (True, False)}


def save_two(run_dir: Path, saved, *, async_save=True) -> Path:
    """A copy of the `saved` checkpoints in `run_dir` (tests damage their own); the dir."""
    shutil.copytree(saved[async_save], run_dir / "checkpoints")
    return run_dir / "checkpoints"


def biggest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def garble(path: Path) -> None:
    path.write_bytes(b"\x00{" * (path.stat().st_size // 2) + b"}" * (path.stat().st_size % 2))


DAMAGE = {
    "flipped byte": (lambda d: flip_byte(biggest_file(d)), "does not match its checksum"),
    "truncated file": (lambda d: truncate(biggest_file(d)), "bytes, "),
    "missing _METADATA": (
        lambda d: os.remove(d / "state" / "_METADATA"),
        "state/_METADATA is missing",
    ),
    "garbage data/metadata": (
        lambda d: garble(d / "data" / "metadata"),
        "data/metadata does not match its checksum",
    ),
    "empty step directory": (
        lambda d: [shutil.rmtree(d), d.mkdir()],
        "the step directory is empty",
    ),
    "save never sealed": (lambda d: os.remove(d / checksums.MANIFEST), "its save did not finish"),
}


def test_manifest_lists_every_file_with_its_crc32(tmp_path, saved):
    directory = save_two(tmp_path, saved)
    for step in (1, 3):
        step_dir = directory / str(step)
        manifest = json.loads((step_dir / checksums.MANIFEST).read_text())
        files = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())
        assert sorted(manifest["files"]) == [f for f in files if f != checksums.MANIFEST]
        for rel, entry in manifest["files"].items():
            data = (step_dir / rel).read_bytes()  # reference: zlib over the whole file at once
            assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert complete_steps(directory) == [3, 1]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_latest_is_skipped_for_the_newest_intact(tmp_path, states, saved, kind):
    _, state, _ = states
    directory = save_two(tmp_path, saved, async_save=kind != "truncated file")
    damage, reason = DAMAGE[kind]
    damage(directory / "3")
    skipped = []
    abstract = abstract_like(checkpoint_tree(state))
    step, tree, data = restore_newest_intact(
        directory, abstract, checksums=True, skipped=lambda s, r: skipped.append((s, r))
    )
    assert (step, data, int(tree["step"])) == (1, {"next_index": 1}, 1)
    for got, want in zip(host(tree["params"]).values(), host(state.params).values(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert len(skipped) == 1 and skipped[0][0] == 3 and reason in skipped[0][1], skipped
    assert "does not match this model" not in skipped[0][1]
    # Named explicitly, the damaged step is an error that says damaged.
    with pytest.raises(KilnError, match=f"checkpoints/3 is damaged: .*{re.escape(reason[:12])}"):
        restore(directory, 3, abstract)
    # The same verification for parameters only (load_params_from, teacher, export-hf).
    _, got_step, notes = restore_params(tmp_path, abstract["params"], what="checkpoint.load_params_from")  # fmt: skip
    assert got_step == 1
    if kind != "save never sealed":  # an unfinished save is not a checkpoint: nothing to say
        assert len(notes) == 1 and "step 3 skipped, it is damaged" in notes[0], notes
    with pytest.raises(KilnError, match=r"checkpoint.load_params_from: .*3 is damaged"):
        restore_params(directory / "3", abstract["params"], what="checkpoint.load_params_from")
    # Set aside, so the resumed run saves step 3 anew.
    set_aside(directory, [3])
    assert complete_steps(directory) == [1]
    assert (tmp_path / "damaged-checkpoints" / "3").is_dir()


def test_every_checkpoint_damaged_is_refused(tmp_path, states, saved):
    _, state, _ = states
    directory = save_two(tmp_path, saved)
    for step in (1, 3):
        flip_byte(biggest_file(directory / str(step)))
    with pytest.raises(KilnError, match=r"no intact checkpoint in .*step 3: .*; step 1: "):
        restore_newest_intact(
            directory, abstract_like(checkpoint_tree(state)), checksums=True, skipped=print
        )


def test_verify_off_checks_sizes_only(tmp_path, states, saved):
    _, state, _ = states
    directory = save_two(tmp_path, saved)
    abstract = abstract_like(checkpoint_tree(state))
    flip_byte(biggest_file(directory / "3" / "data"))  # data/metadata: JSON no more
    truncate(biggest_file(directory / "1"))
    with pytest.raises(KilnError, match=r"checkpoints/1 is damaged: .* bytes, "):
        restore(directory, 1, abstract, checksums=False)


def test_a_different_model_is_not_called_damage(tmp_path, saved):
    directory = save_two(tmp_path, saved)
    other = tiny_config(tmp_path, model={"d_ff": 48})
    _, state = train.abstract_pretraining(other, make_mesh(other))  # its shapes: nothing run
    with pytest.raises(KilnError, match=r"3 does not match this model: .*w_down.* shape") as e:
        restore_newest_intact(
            directory, abstract_like(checkpoint_tree(state)), checksums=True, skipped=print
        )
    assert "damaged" not in str(e.value)


def legacy(step_dir: Path) -> None:
    """A checkpoint of a kiln from before manifests: no manifest, no seal in orbax's metadata."""
    os.remove(step_dir / checksums.MANIFEST)
    meta = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    meta["custom_metadata"] = {}
    (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))


def test_checkpoints_from_before_manifests_load_and_nan_is_caught(tmp_path, states, saved):
    _, state, later = states
    directory = save_two(tmp_path, saved)
    legacy(directory / "1")
    legacy(directory / "3")
    abstract = abstract_like(checkpoint_tree(state))
    tree, _ = restore(directory, 3, abstract)
    for got, want in zip(host(tree["params"]).values(), host(later.params).values(), strict=True):
        np.testing.assert_array_equal(got, want)
    # Unverifiable byte damage that yields a NaN is still refused (finite values are checked).
    shutil.rmtree(directory / "3")
    ckpt = Checkpointer(tmp_path, states[0].checkpoint)
    nan = jax.tree.map(lambda p: p.at[(0,) * p.ndim].set(np.nan), later.params)
    ckpt.save(3, checkpoint_tree(later.replace(params=nan)), {})
    ckpt.close()
    legacy(directory / "3")
    skipped = []
    step, _, _ = restore_newest_intact(
        directory, abstract, checksums=True, skipped=lambda s, r: skipped.append(r)
    )
    assert step == 1 and "holds non-finite values" in skipped[0], skipped


def test_skip_cause_names_non_finite_parameters(states):
    _, state, _ = states
    assert "the batches or the numerics" in skip_cause(state)
    nan = jax.tree.map(lambda p: p * np.nan, state.params)
    assert "parameters hold non-finite values" in skip_cause(state.replace(params=nan))


def test_teacher_step_is_pinned_for_a_resumed_student(tmp_path, states, saved):
    config = states[0]
    teacher_dir = tmp_path / "teacher"
    save_two(teacher_dir, saved)
    (teacher_dir / "config.yaml").write_text(config.to_yaml())
    student = tiny_config(
        tmp_path,
        train={"run_name": "student"},
        distillation={"teacher_run_dir": str(teacher_dir), "layer_map": []},
    )
    assert distill.read_teacher_config(student)[2] == 3  # a new student: the latest
    # The student ran from teacher step 1 and has a checkpoint: it keeps step 1.
    save_two(student.run_dir, saved)
    pinned.write(student.run_dir, {"teacher": {"run_dir": str(teacher_dir), "step": 1}})
    assert distill.read_teacher_config(student)[2] == 1
    shutil.rmtree(teacher_dir / "checkpoints" / "1")
    with pytest.raises(KilnError, match=r"distillation.teacher_run_dir: .*teacher's step 1"):
        distill.read_teacher_config(student)


def test_small_replicated_arrays_are_saved_whole_without_compiling_slices(
    tmp_path, states, monkeypatch
):
    """orbax's replica-parallel save cuts each replica's copy of a replicated array into slices,
    one compiled program per slice shape (56 at the first save of a two-layer DeepSeek model);
    below `REPLICA_PARALLEL_MIN_BYTES` one replica writes the array whole. The same state is
    sliced when the minimum is 0, and both saves restore to it."""
    from kiln.runs import checkpoint

    config, state, _ = states
    slices = []
    real = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: slices.append(1) or real(*a, **k))
    tree = checkpoint_tree(state)
    for minimum, run in ((checkpoint.REPLICA_PARALLEL_MIN_BYTES, "whole"), (0, "sliced")):
        monkeypatch.setattr(checkpoint, "REPLICA_PARALLEL_MIN_BYTES", minimum)
        slices.clear()
        ckpt = Checkpointer(tmp_path / run, config.checkpoint)
        ckpt.save(1, tree, {})
        ckpt.close()
        assert (slices == []) == (run == "whole"), run
        got, _ = restore(tmp_path / run / "checkpoints", 1, abstract_like(tree))
        for x, y in zip(jax.tree.leaves(host(got)), jax.tree.leaves(host(tree)), strict=True):
            np.testing.assert_array_equal(x, y)
