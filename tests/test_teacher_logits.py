"""`kiln teacher-logits` and its reader: the stored top-k is the teacher's, rows follow the data
stream across a resume, shards are published whole and a killed writer resumes to the same
bytes, and a store that does not fit the student's config is refused."""

import json
import shutil
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (
    REPO,
    assert_user_error,
    communicate,
    kiln,
    kiln_env,
    kiln_main,
    make_config,
    run_process,
    start_kiln,
)
from kiln import losses
from kiln.data import make_datasets
from kiln.distill import reader
from kiln.distill.store import read_manifest, shards
from kiln.distill.teacher import load_teacher
from kiln.distill.writer import write_store
from kiln.errors import KilnError
from kiln.parallel.mesh import make_mesh
from kiln.runs import pinned
from kiln.runs.checkpoint import Checkpointer
from kiln.training import train
from kiln.training.loop import checkpoint_tree

SEQ, BATCH, STEPS, K, T = 16, 8, 5, 8, 2.0
TEACHER = {"vocab_size": 384, "d_model": 32, "num_layers": 2, "num_heads": 4, "d_ff": 64,
           "max_seq_len": SEQ, "logit_softcap": 30.0}  # fmt: skip
STUDENT = {**TEACHER, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32}
COMMON = {
    "data": {"seq_len": SEQ, "source": "synthetic", "synthetic_kind": "markov"},
    "mesh": {"data": 2, "fsdp": 2, "tensor": 2},  # vocabulary sharded over `tensor`
    "optim": {"warmup_steps": 0},
    "checkpoint": {"async_save": False},
}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher run directory: config.yaml and one checkpoint (step 2) of an initialised model
    whose final norm is scaled by 30, so its distributions are far from uniform, as a trained
    teacher's are."""
    root = tmp_path_factory.mktemp("teacher-logits")
    config = make_config(
        model=TEACHER, train={"run_name": "teacher", "global_batch_size": BATCH, "steps": 2},
        output_dir=root / "runs", **COMMON,
    )  # fmt: skip
    state = train.init_state(config)
    peaked = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 30 if "final_norm" in jax.tree_util.keystr(path) else x, state.params
    )
    state = state.replace(params=peaked)
    ckpt = Checkpointer(config.run_dir, config.checkpoint)
    ckpt.save(2, checkpoint_tree(state), {})
    ckpt.close()
    (config.run_dir / "config.yaml").write_text(config.to_yaml())
    return config.run_dir


def student_raw(teacher_dir, **distillation):
    config = make_config(
        model=STUDENT,
        train={"run_name": "student", "global_batch_size": BATCH, "steps": STEPS,
               "gradient_accumulation_steps": 2},
        distillation={"teacher_run_dir": str(teacher_dir), "temperature": T, **distillation},
        output_dir=teacher_dir.parent, **COMMON,
    )  # fmt: skip
    return config.model_dump(mode="json")


@pytest.fixture(scope="module")
def store(teacher_dir):
    """A float32 store of top-8, two steps per shard (three shards)."""
    out = teacher_dir.parent.parent / "store"
    write_store(make_config(student_raw(teacher_dir)), out, top_k=K, dtype="float32", shard_steps=2)
    return out


def offline(teacher_dir, store, **sections):
    raw = student_raw(teacher_dir, teacher_logits_dir=str(store))
    return make_config(raw, **sections)


def test_stored_top_k_is_the_online_teachers(teacher_dir, store):
    config = make_config(student_raw(teacher_dir))
    mesh = make_mesh(config)
    teacher = load_teacher(config, mesh)
    model = teacher.model()

    @jax.jit
    def online(batch):
        hidden = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
        x = losses.logits(hidden.hidden, model.head_weight(), softcap=TEACHER["logit_softcap"])
        return (*jax.lax.top_k(x, K), x)

    manifest = read_manifest(store)
    assert (manifest["top_k"], manifest["steps"], manifest["temperature"]) == (K, STEPS, T)
    assert manifest["teacher"]["step"] == 2 and len(shards(manifest)) == 3
    rows = reader.StoreReader(store, manifest, 0, 1, verify=True)
    batches = make_datasets(config).train_iterator()
    for step in range(STEPS):
        batch = next(batches)
        values, ids, x = map(np.asarray, online({k: jnp.asarray(v) for k, v in batch.items()}))
        got = rows.read(step)
        # The writer runs the same float32 computation per micro-batch: 1e-5 relative (f32).
        np.testing.assert_allclose(got["teacher_values"], values, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["teacher_ids"], ids)
        x64 = x.astype(np.float64) / T  # lse over the whole vocabulary, float64 reference
        m = x64.max(-1)
        lse = m + np.log(np.exp(x64 - m[..., None]).sum(-1))
        np.testing.assert_allclose(got["teacher_lse"], lse, rtol=1e-5)


def test_reader_rows_follow_the_data_stream_across_a_resume(teacher_dir, store):
    config = offline(teacher_dir, store)
    datasets = make_datasets(config)
    straight = reader.with_teacher_logits(config, datasets, datasets.train_iterator())
    want = [next(straight) for _ in range(STEPS)]
    rows = reader.StoreReader(store, read_manifest(store), 0, 1, verify=False)
    for step, batch in enumerate(want):
        for key, value in rows.read(step).items():
            if key != "row_crc":
                np.testing.assert_array_equal(batch[key], value)
    first = reader.with_teacher_logits(config, datasets, datasets.train_iterator())
    next(first), next(first), next(first)
    state = json.loads(json.dumps(first.get_state()))  # as a checkpoint stores it
    resumed = reader.with_teacher_logits(config, datasets, datasets.train_iterator())
    resumed.set_state(state)
    for step in (3, 4):
        got = next(resumed)
        assert got.keys() == want[step].keys()
        for key in got:
            np.testing.assert_array_equal(got[key], want[step][key])
    # A reader of two processes gets each its half of every batch.
    half = reader.StoreReader(store, read_manifest(store), 1, 2, verify=False).read(4)
    for key in reader.TEACHER_KEYS:
        np.testing.assert_array_equal(half[key], want[4][key][BATCH // 2 :])


def test_rows_of_another_stream_are_refused(teacher_dir, store):
    config = offline(teacher_dir, store)
    datasets = make_datasets(config)
    batches = reader.with_teacher_logits(config, datasets, datasets.train_iterator())
    next(batches)
    batches.step = 0  # out of step with the data: batch 1 meets the rows of batch 0
    with pytest.raises(KilnError, match="row 0 of batch 0 is not the one the store"):
        next(batches)


@pytest.mark.parametrize(
    ("sections", "needle"),
    [
        ({"data": {"seed": 7}}, "data.seed: 7, but the store"),
        ({"data": {"seq_len": 8}}, "data.seq_len: 8, but the store"),
        ({"train": {"global_batch_size": 16}}, "train.global_batch_size: 16"),
        ({"data": {"synthetic_kind": "uniform"}}, "data.synthetic_kind: 'uniform'"),
        ({"train": {"steps": STEPS + 1}}, "train.steps: 6, but the store in"),
        ({"distillation": {"temperature": 1.0}}, "distillation.temperature: 1.0, but"),
        (
            {"distillation": {"schedule": "linear", "temperature_end": 1.0}},
            "distillation.temperature_end: 1.0 moves",
        ),
        (
            {"distillation": {"layer_map": [[0, 1]]}},
            "distillation.layer_map: [[0, 1]]; the feature",
        ),
    ],
)
def test_store_that_does_not_fit_the_config_is_refused(teacher_dir, store, sections, needle):
    with pytest.raises(KilnError) as e:
        reader.check(offline(teacher_dir, store, **sections))
    assert needle in str(e.value) and "\n" not in str(e.value), e.value


def test_missing_or_damaged_shard_is_refused(teacher_dir, store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    config = offline(teacher_dir, copy)
    datasets = make_datasets(config)
    names = [n for _, _, n in shards(read_manifest(copy))]
    with (copy / names[1] / "lse.npy").open("r+b") as f:  # same size, other bytes
        f.seek(-4, 2)
        f.write(b"\xff\xff\xff\xff")
    batches = reader.with_teacher_logits(config, datasets, datasets.train_iterator())
    next(batches), next(batches)  # shard 0 is intact
    with pytest.raises(KilnError, match=f"shard .*{names[1]} is damaged .*lse.npy fails its CRC"):
        next(batches)
    with (copy / names[2] / "ids.npy").open("r+b") as f:
        f.truncate(100)
    batches.set_state({**batches.get_state(), "next_index": 4})
    with pytest.raises(KilnError, match=r"ids\.npy has 100 bytes"):
        next(batches)
    shutil.rmtree(copy / names[0])
    with pytest.raises(KilnError, match=f"shard .*{names[0]} is missing; the store is incomplete"):
        reader.with_teacher_logits(config, datasets, datasets.train_iterator())


def test_distill_refuses_a_store_of_other_data_with_exit_2(teacher_dir, store, tmp_path):
    """By subprocess: the whole stderr of each process, `kiln distill` and `kiln
    teacher-logits`, is the one error line (no start-up output, no traceback)."""
    path = tmp_path / "student.yaml"
    path.write_text(offline(teacher_dir, store).to_yaml())
    proc = kiln("distill", path, "data.seed=3")
    assert_user_error(proc, "data.seed: 3, but the store in")
    assert not (teacher_dir.parent / "student").exists()
    proc = kiln("teacher-logits", path, "--out", store, "--top-k", 4, "--dtype", "float32")
    assert_user_error(proc, "--out", "top_k 8, this run would write 4")


def test_a_new_store_takes_the_teachers_latest_step_whatever_a_student_run_pinned(
    teacher_dir, tmp_path
):
    # A student run of this config resumed from teacher step 1, which the teacher no longer
    # has: its inputs.json pins it. The store is not that run's: it takes the latest, step 2.
    config = make_config(student_raw(teacher_dir), train={"run_name": "pinned-student"})
    ckpt = Checkpointer(config.run_dir, config.checkpoint)
    ckpt.save(1, checkpoint_tree(train.init_state(config)), {})
    ckpt.close()
    pinned.write(config.run_dir, {"teacher": {"run_dir": str(teacher_dir), "step": 1}})
    assert pinned.teacher_step(config) == 1
    line = write_store(config, tmp_path / "store", top_k=K, dtype="float32", shard_steps=STEPS)
    assert read_manifest(tmp_path / "store")["teacher"]["step"] == 2
    assert line.endswith(f"teacher {teacher_dir} step 2, 1 shard per process")


@pytest.mark.slow
def test_killed_writer_resumes_to_the_same_bytes(teacher_dir, store, tmp_path):
    path = tmp_path / "student.yaml"
    path.write_text(make_config(student_raw(teacher_dir)).to_yaml())
    out = tmp_path / "store"
    args = ("teacher-logits", path, "--out", out, "--top-k", K, "--dtype", "float32")
    proc = start_kiln(*args, "--shard-steps", 2)
    for line in proc.stderr:  # killed once the first shard is published
        if line.startswith("teacher-logits: steps 0..1 written"):
            proc.send_signal(signal.SIGKILL)
            break
    communicate(proc)
    assert proc.returncode == -signal.SIGKILL
    names = [n for _, _, n in shards(read_manifest(store))]
    assert (out / names[0] / "shard.json").is_file()
    proc = kiln_main(*args, "--shard-steps", 2)  # the resume: in this process
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 shard of" in proc.stderr or "2 shards of" in proc.stderr, proc.stderr
    written = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert written == sorted(p.relative_to(store) for p in store.rglob("*"))  # no staging left
    for rel in written:
        if (store / rel).is_file():
            assert (store / rel).read_bytes() == (out / rel).read_bytes(), rel


@pytest.mark.slow
def test_two_processes_write_the_store_of_one(teacher_dir, store, tmp_path):
    path = tmp_path / "student.yaml"
    path.write_text(make_config(student_raw(teacher_dir)).to_yaml())
    out = tmp_path / "store"
    args = ("--out", out, "--top-k", K, "--dtype", "float32", "--shard-steps", 2)
    launch = REPO / "scripts" / "launch_local.sh"
    proc = run_process(
        ["bash", *map(str, (launch, "--teacher-logits", 2, path, *args))],
        env=kiln_env(PYTHON=sys.executable),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two, one = read_manifest(out), read_manifest(store)
    assert two["writer_processes"] == 2 and {**two, "writer_processes": 1} == one
    assert sorted({n.split(".rows-")[1] for _, _, n in shards(two)}) == ["000000-000004", "000004-000008"]  # fmt: skip
    whole = reader.StoreReader(store, one, 0, 1, verify=True)
    halves = reader.StoreReader(out, two, 0, 1, verify=True)
    for step in range(STEPS):
        want, got = whole.read(step), halves.read(step)
        for key in ("teacher_ids", "row_crc"):
            np.testing.assert_array_equal(got[key], want[key])
        for key in ("teacher_values", "teacher_lse"):
            # The same float32 arithmetic on the same mesh, split over two processes: 1e-5.
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5)


# --- kiln distill from the store ----------------------------------------------------------------


def run_metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "learning/loss" in r}


def student_abstract(config):
    """The student's train state as sharded shapes (as `kiln compile` lowers it): the restore
    target of its checkpoints, with nothing initialised."""
    from kiln.distill.offline import stored_teacher
    from kiln.distill.online import student_builder

    teacher = stored_teacher(config, read_manifest(config.distillation.teacher_logits_dir))
    builder = student_builder(config, teacher.config)
    return train.abstract_train_state(config, make_mesh(config), builder)


def saved_state(config, state, step=None):
    """(step, state, data state) of the run's checkpoint of `step` (default: its latest),
    restored into the shapes and shardings of `state`."""
    from kiln.runs.checkpoint import latest_complete_step
    from kiln.runs.restore import abstract_like, restore

    directory = config.run_dir / "checkpoints"
    step = latest_complete_step(directory) if step is None else step
    tree, data_state = restore(directory, step, abstract_like(checkpoint_tree(state)))
    return step, jax.tree.map(np.asarray, tree), data_state


@pytest.mark.slow
def test_distill_from_the_store_trains_and_a_killed_run_resumes_bitwise(teacher_dir, store, tmp_path):  # fmt: skip
    def student(name):
        config = offline(
            teacher_dir, store, train={"run_name": name, "log_every_steps": 1},
            optim={"schedule": "constant", "learning_rate": 1e-2},
            loss={"num_vocab_tiling": 2}, checkpoint={"every_steps": 2, "async_save": False},
            distillation={"teacher_run_dir": None, "alpha": 1.0},  # loss = soft
        )  # fmt: skip
        path = tmp_path / f"{name}.yaml"
        path.write_text(config.to_yaml())
        return path, config

    path, straight = student("straight")
    proc = kiln_main("distill", path)  # the kill needs a process; the other runs do not
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"teacher logits from {store}" in proc.stderr
    want = run_metrics(straight.run_dir)
    assert sorted(want) == [1, 2, 3, 4, 5]
    for step, record in want.items():  # alpha 1, balance none: the loss is the soft loss
        assert record["learning/loss"] == record["distill/soft_loss"] > 0, (step, record)
        assert 0 < record["distill/teacher_tail_mass"] < 1 and "distill/teacher_loss" not in record

    path, killed = student("killed")
    proc = start_kiln("distill", path, merged=True)
    for line in proc.stdout:
        if line.startswith("step 3/5"):  # the checkpoint of step 2 is written (synchronously)
            proc.send_signal(signal.SIGKILL)
            break
    communicate(proc)
    assert proc.returncode == -signal.SIGKILL
    proc = kiln_main("distill", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from step" in proc.stderr, proc.stderr[-3000:]
    got = run_metrics(killed.run_dir)
    for step in (3, 4, 5):
        for key in ("learning/loss", "distill/soft_loss", "distill/hard_loss"):
            assert got[step][key] == want[step][key], (step, key)  # bitwise
    student = student_abstract(straight)  # of the killed run too: the same student
    (a_step, a, a_data) = saved_state(straight, student)
    (b_step, b, b_data) = saved_state(killed, student)
    assert a_step == b_step == 5 and a_data == b_data
    _, early, _ = saved_state(straight, student, step=2)
    moved = [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(early["params"]), jax.tree.leaves(a["params"]))]  # fmt: skip
    assert all(moved)  # every parameter trained on after step 2
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)  # bitwise


def test_compile_lowers_the_offline_step_with_the_stores_rows(teacher_dir, store):
    """`kiln compile` of an offline config lowers the step `kiln distill` runs: the batch
    carries the store's top-k rows, and the arguments hold no teacher parameters."""
    from kiln.commands.compile import lower_step

    config = offline(teacher_dir, store)
    lowered, command, objective, _ = lower_step(config, jax.devices())
    assert command == "kiln distill" and objective.teacher_params is None
    batch = next(a for a in lowered.args_info[0] if isinstance(a, dict))  # (state, batch)
    assert batch["teacher_values"].shape == (BATCH, config.data.seq_len, K)
    assert batch["teacher_ids"].dtype == jnp.int32 and len(batch["teacher_lse"].shape) == 2
    online = lower_step(make_config(student_raw(teacher_dir)), jax.devices())[0]
    # Offline the compiled step's inputs are the student's state and the batch only.
    assert (
        lowered.compile().memory_analysis().argument_size_in_bytes
        < online.compile().memory_analysis().argument_size_in_bytes
    )
