"""Distillation: losses against float64 references, balancing and its gradient through gradient
accumulation, tiled == untiled, a frozen teacher, the CLI's refusals, and a resumed run."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from conftest import kiln_main
from kiln import losses
from kiln.config import config_from_dict
from kiln.distill import online as distill
from kiln.errors import KilnError
from kiln.model import create_model
from kiln.parallel.mesh import make_mesh, sharded_init
from kiln.runs.checkpoint import Checkpointer
from kiln.runs.restore import abstract_like, restore, restore_params
from kiln.training import train
from kiln.training.batches import place_batch
from kiln.training.loop import checkpoint_tree

SEQ, BATCH, VOCAB = 16, 16, 384
TEACHER_MODEL = {"vocab_size": VOCAB, "d_model": 32, "num_layers": 2, "num_heads": 4, "d_ff": 64, "max_seq_len": SEQ}  # fmt: skip
STUDENT_MODEL = {"vocab_size": VOCAB, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32, "max_seq_len": SEQ}  # fmt: skip
MESH = {"data": 2, "fsdp": 2, "tensor": 2}  # vocabulary sharded over `tensor` in the tiled loss


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def softmax64(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


# --- losses against float64 references ----------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_soft_loss_matches_float64_reference(temperature):
    rng = np.random.default_rng(1)
    student = rng.normal(size=(3, 5, 50)) * 3
    teacher = rng.normal(size=(3, 5, 50)) * 3
    w = rng.random((3, 5))
    t = temperature
    p_s, p_t = softmax64(student / t), softmax64(teacher / t)
    want = t * t * np.sum(p_t * (np.log(p_t) - np.log(p_s)), -1)  # KL(teacher || student)
    reverse = t * t * np.sum(p_s * (np.log(p_s) - np.log(p_t)), -1)
    assert np.abs(want - reverse).max() > 0.1  # the two directions are distinguishable here

    def weighted(x):
        return jnp.sum(losses.soft_loss(x, jnp.asarray(teacher, jnp.float32), t) * w)

    got = losses.soft_loss(jnp.asarray(student, jnp.float32), jnp.asarray(teacher, jnp.float32), t)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # f32 vs f64: 1e-5 relative
    grad = jax.grad(weighted)(jnp.asarray(student, jnp.float32))
    want_grad = w[..., None] * t * (p_s - p_t)  # d/dx_s of T^2 KL = T (p_s - p_t)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)  # f32: 1e-5 relative


@pytest.mark.parametrize("kind", ["cosine", "mse"])
def test_feature_loss_matches_float64_reference(kind):
    rng = np.random.default_rng(2)
    s, t = rng.normal(size=(2, 3, 4, 8)), rng.normal(size=(2, 3, 4, 8))
    if kind == "mse":
        want = np.mean(np.mean((s - t) ** 2, -1), 0)
    else:
        cos = np.sum(s * t, -1) / (np.linalg.norm(s, axis=-1) * np.linalg.norm(t, axis=-1))
        want = np.mean(1 - cos, 0)
    got = losses.feature_loss(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), kind)
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # f32 vs f64: 1e-5 relative


# Three scalar functions of a parameter vector with derivatives known in closed form.
THETA = np.array([0.3, -1.2, 0.7, 2.0])


def hard64(x):
    return np.sum(x**2) + 1.0, 2 * x


def soft64(x):
    return np.sum(np.sin(x)) + 3.0, np.cos(x)


def feature64(x):
    return np.sum(np.exp(x)) / 10, np.exp(x) / 10


def three_losses(x):
    return jnp.sum(x**2) + 1.0, jnp.sum(jnp.sin(x)) + 3.0, jnp.sum(jnp.exp(x)) / 10


def total_and_grad(**kw):
    def total(x):
        return losses.distillation_loss(*three_losses(x), **kw)[0]

    x = jnp.asarray(THETA, jnp.float32)
    return float(total(x)), np.asarray(jax.grad(total)(x))


def test_dynamic_balance_value_and_gradient():
    alpha = 0.7
    value, grad = total_and_grad(alpha=alpha, beta=1.0, balance="dynamic")
    (h, dh), (s, ds), (f, df) = hard64(THETA), soft64(THETA), feature64(THETA)
    np.testing.assert_allclose(value, (1 + alpha) * h, rtol=1e-6)  # f32 arithmetic: 1e-6
    kd = s + (s / f) * f
    want = dh + alpha * (h / kd) * (ds + (s / f) * df)
    np.testing.assert_allclose(grad, want, rtol=1e-5)  # f32: 1e-5 relative
    _, scales = losses.distillation_loss(h, s, f, alpha=alpha, beta=1.0, balance="dynamic")
    np.testing.assert_allclose(float(scales["feature_mag_scale"]), s / f, rtol=1e-6)
    np.testing.assert_allclose(float(scales["kd_mag_scale"]), h / kd, rtol=1e-6)


def test_balance_none_is_the_weighted_sum():
    alpha, beta = 0.3, 0.25
    value, grad = total_and_grad(alpha=alpha, beta=beta, balance="none")
    (h, dh), (s, ds), (f, df) = hard64(THETA), soft64(THETA), feature64(THETA)
    np.testing.assert_allclose(value, (1 - alpha) * h + alpha * s + beta * f, rtol=1e-6)
    want = (1 - alpha) * dh + alpha * ds + beta * df
    np.testing.assert_allclose(grad, want, rtol=1e-5)  # f32: 1e-5 relative


def test_dynamic_balance_guards_zero_denominators():
    # No feature pairs: feature 0 -> its scale is 0 and kd is the soft loss alone.
    total, scales = losses.distillation_loss(2.0, 0.5, 0.0, alpha=0.5, beta=0.0, balance="dynamic")
    assert float(scales["feature_mag_scale"]) == 0.0
    np.testing.assert_allclose(float(total), 3.0, rtol=1e-6)
    # Nothing left to distil: kd 0 -> total is the hard loss, finite gradient.
    grad = jax.grad(
        lambda h: losses.distillation_loss(h, 0.0, 0.0, alpha=0.5, beta=0.0, balance="dynamic")[0]
    )(2.0)
    assert float(grad) == 1.0


# --- through the models -------------------------------------------------------------------------


def make_config(model=STUDENT_MODEL, tmp_path=None, **sections):
    raw = {
        "model": dict(model),
        "data": {"seq_len": SEQ, "source": "synthetic"},
        "train": {"global_batch_size": BATCH, "steps": 4, "log_every_steps": 1},
        "optim": {"warmup_steps": 0},
        "mesh": dict(MESH),
        "loss": {"z_loss_multiplier": 1e-3},
        "distillation": {
            "alpha": 0.6,
            "temperature": 2.0,
            "layer_map": [[0, 1]],
            "balance": "dynamic",
            "beta": 1.0,  # the feature term at its full balanced weight
            # Random models are near-uniform (soft ~ hard / 300): test the uncapped formula.
            "max_kd_scale": 1000.0,
        },
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    if tmp_path is not None:
        raw["train"]["output_dir"] = str(tmp_path)
    return config_from_dict(raw)


def random_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (BATCH, SEQ + 1))
    real = np.array([SEQ if i % 3 == 0 else (i * 5) % SEQ + 1 for i in range(BATCH)])
    weights = (np.arange(SEQ)[None, :] < real[:, None]).astype(np.float32)
    return {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "positions": np.broadcast_to(np.arange(SEQ), (BATCH, SEQ)).astype(np.int32),
        "segment_ids": (weights > 0).astype(np.int32),
        "weights": weights,
    }


@pytest.fixture(scope="module")
def batch():
    return random_batch()


@pytest.fixture(scope="module")
def teacher():
    """A randomly initialised teacher (two blocks, width 32) on the shared mesh."""
    config = make_config(TEACHER_MODEL)
    state = train.init_state(config)
    return distill.Teacher(config, Path("teacher"), 0, state.graphdef, state.params, state.rest)


def student_loss_and_grads(config, teacher, batch):
    mesh = make_mesh(config)
    state = distill.init_student(config, mesh, teacher.config)
    loss, aux, grads = distill.loss_and_grads(config, teacher, state, batch)
    return float(loss), {k: float(v) for k, v in aux.items()}, host(grads)


@pytest.fixture(scope="module")
def reference(teacher, batch):
    """Untiled, one micro-batch: the path every other one must reproduce."""
    return student_loss_and_grads(make_config(), teacher, batch)


def assert_same(got, want):
    loss, aux, grads = got
    ref_loss, ref_aux, ref_grads = want
    # f32 throughout, sums in another order: 1e-5 relative.
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key in ref_aux:
        np.testing.assert_allclose(aux[key], ref_aux[key], rtol=1e-5, err_msg=key)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        # 1e-5 relative to the largest entry of each gradient.
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


def test_reference_is_sane(reference, batch):
    loss, aux, grads = reference
    assert aux["learning/total_weights"] == batch["weights"].sum()
    hard, soft, feature = aux["distill/hard_loss"], aux["distill/soft_loss"], aux["distill/feature_loss"]  # fmt: skip
    assert np.log(VOCAB) * 0.8 < hard < np.log(VOCAB) * 1.3
    assert soft > 0 and feature > 0 and aux["distill/teacher_loss"] > 0
    np.testing.assert_allclose(loss, 1.6 * hard, rtol=1e-6)  # dynamic: (1 + alpha) hard
    np.testing.assert_allclose(aux["distill/feature_mag_scale"], soft / feature, rtol=1e-6)
    np.testing.assert_allclose(aux["distill/kd_mag_scale"], hard / (2 * soft), rtol=1e-6)
    flat = jax.tree.leaves(grads)
    assert all(np.isfinite(g).all() and np.abs(g).max() > 0 for g in flat)
    # The feature projection (16 -> 32) is a trainable parameter with a gradient.
    assert any(g.shape == (1, 16, 32) for g in flat)


@pytest.mark.parametrize(
    ("accum", "tiles"), [(1, 4), (2, 1), (2, 4)], ids=["tiled", "accum2", "accum2-tiled"]
)
def test_tiling_and_accumulation_agree_with_untiled(reference, teacher, batch, accum, tiles):
    config = make_config(
        train={"gradient_accumulation_steps": accum},
        loss={"num_vocab_tiling": tiles, "z_loss_multiplier": 1e-3},
    )
    assert_same(student_loss_and_grads(config, teacher, batch), reference)


def test_loss_and_grads_compiles_once_per_config(teacher, batch):
    student_loss_and_grads(make_config(loss={"z_loss_multiplier": 2e-3}), teacher, batch)
    traced = []  # the functions JAX traces from here on (its jaxpr-trace events name them)
    listening = [True]

    def listen(event, seconds, *, fun_name="", **_):
        if listening[0] and event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        # A new state and an equal (not the same) config object: the compiled program is reused.
        student_loss_and_grads(make_config(loss={"z_loss_multiplier": 2e-3}), teacher, batch)
    finally:
        listening[0] = False
    assert "objective_loss_and_grads" not in traced, traced


def test_accumulated_dynamic_gradient_is_the_reference_formula(teacher, batch):
    """With two micro-batches, d total = dH + alpha (H/K)(dS + (S/F) dF) at global means."""
    accum = {"gradient_accumulation_steps": 2}

    def grads(**dist):
        config = make_config(train=accum, distillation=dist)
        return student_loss_and_grads(config, teacher, batch)

    _, aux, got = grads(alpha=0.6, balance="dynamic")
    _, _, d_hard = grads(alpha=0.0, beta=0.0, balance="none")
    _, _, d_soft = grads(alpha=1.0, beta=0.0, balance="none")
    _, _, d_hard_feature = grads(alpha=0.0, beta=1.0, balance="none")
    h, s, f = aux["distill/hard_loss"], aux["distill/soft_loss"], aux["distill/feature_loss"]
    kd = s + (s / f) * f
    for g, dh, ds, dhf in zip(*map(jax.tree.leaves, (got, d_hard, d_soft, d_hard_feature))):
        want = dh + 0.6 * (h / kd) * (ds + (s / f) * (dhf - dh))
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_student_identical_to_teacher_has_no_soft_loss(teacher, batch):
    config = make_config(TEACHER_MODEL, distillation={"layer_map": [[0, 0], [1, 1]]})
    mesh = make_mesh(config)
    state = distill.init_student(config, mesh, teacher.config)
    state = state.replace(params=teacher.params)  # equal widths: no projection, same keys
    _, aux, _ = distill.loss_and_grads(config, teacher, state, batch)
    assert abs(float(aux["distill/soft_loss"])) < 1e-6  # KL of a distribution with itself
    assert abs(float(aux["distill/feature_loss"])) < 1e-6  # cosine distance of equal states
    # The teacher's CE has no z-term: the hard loss exceeds it by exactly the student's z-loss.
    np.testing.assert_allclose(
        float(aux["distill/hard_loss"]) - float(aux["learning/z_loss"]),
        float(aux["distill/teacher_loss"]),
        rtol=1e-6,
    )


def test_teacher_is_frozen_and_student_learns(teacher, batch):
    config = make_config(
        train={"gradient_accumulation_steps": 2},
        optim={"learning_rate": 1e-2, "schedule": "constant"},
    )
    mesh = make_mesh(config)
    state = distill.init_student(config, mesh, teacher.config)
    step = distill.make_distill_step(config, teacher, mesh, train.shardings_of(state))
    teacher_before, student_before = host(teacher.params), host(state.params)
    placed = place_batch(batch, mesh, config)
    hard = []
    for _ in range(3):
        state, metrics = step(state, placed)
        hard.append(float(metrics["distill/hard_loss"]))
    for x, y in zip(jax.tree.leaves(teacher_before), jax.tree.leaves(host(teacher.params))):
        np.testing.assert_array_equal(x, y)  # bitwise
    moved = [not np.array_equal(x, y) for x, y in zip(*map(jax.tree.leaves, (student_before, host(state.params))))]  # fmt: skip
    assert all(moved)
    assert hard[2] < hard[0]  # the same batch three times
    assert int(state.step) == 3
    assert {f"distill/{k}" for k in distill.METRICS} <= set(metrics)


def flat(params):
    """{"blocks/attn/wq": array, ...} of an nnx state, on the host."""
    return {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}


def test_checkpoint_of_the_earlier_student_layout_restores_into_the_student(tmp_path, teacher):
    config = make_config()
    mesh = make_mesh(config)
    # How students were built before `Student`: the model with its projection set on it as
    # an attribute, so the projection's keys sat beside the model's at top level.
    old = create_model(config, mesh, seed=5)
    projection = sharded_init(
        lambda: distill.FeatureProjection(1, 16, 32, rngs=nnx.Rngs(6), dtype=jnp.float32),
        mesh,
        config.mesh.rules,
    )
    setattr(old, "distill_projection", projection)  # noqa: B010
    old_state = train.state_from_model(config, mesh, old)
    ckpt = Checkpointer(tmp_path, config.checkpoint)
    ckpt.save(3, checkpoint_tree(old_state), {})
    ckpt.close()

    state = distill.init_student(config, mesh, teacher.config)
    assert flat(state.params).keys() == flat(old_state.params).keys()
    assert "distill_projection/w" in flat(state.params)
    tree, _ = restore(tmp_path / "checkpoints", 3, abstract_like(checkpoint_tree(state)))
    restored = state.replace(**tree)
    for got, want in zip(*map(jax.tree.leaves, (host(checkpoint_tree(restored)), host(checkpoint_tree(old_state)))), strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)  # bitwise
    # `kiln train checkpoint.load_params_from=<distill run>` reads it as a plain model.
    plain = train.init_state(config, mesh)
    params, step, _ = restore_params(tmp_path, plain.params)
    want = flat(old_state.params)
    assert step == 3 and flat(params).keys() == want.keys() - {"distill_projection/w"}
    for key, value in flat(params).items():
        np.testing.assert_array_equal(value, want[key])  # bitwise


def test_schedules_reach_their_end_values():
    cfg = make_config(
        distillation={"schedule": "cosine", "alpha_end": 0.1, "temperature_end": 1.0}
    ).distillation
    start, mid, end = (distill.schedule_values(cfg, s, 11) for s in (0, 5, 10))
    # float32 arithmetic: 1e-6 relative.
    keys = ("alpha", "temperature")
    np.testing.assert_allclose([float(start[k]) for k in keys], [0.6, 2.0], rtol=1e-6)
    np.testing.assert_allclose([float(mid[k]) for k in keys], [0.35, 1.5], rtol=1e-6)
    np.testing.assert_allclose([float(end[k]) for k in keys], [0.1, 1.0], rtol=1e-6)
    assert float(end["beta"]) == 1.0  # no beta_end: constant (make_config's beta)


# --- the command line ---------------------------------------------------------------------------


def write_student(tmp_path, teacher_dir, **distillation):
    config = make_config(tmp_path=tmp_path / "runs", mesh={"data": 1, "fsdp": -1, "tensor": 1})
    raw = config.model_dump(mode="json")
    raw["distillation"].update(teacher_run_dir=str(teacher_dir), **distillation)
    path = tmp_path / "student.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def fake_teacher(tmp_path, **model):
    """A run directory holding only a teacher's config.yaml (enough for the checks that fail)."""
    run_dir = tmp_path / "teacher"
    run_dir.mkdir()
    config = make_config({**TEACHER_MODEL, **model}, mesh={"data": 1, "fsdp": -1, "tensor": 1})
    (run_dir / "config.yaml").write_text(config.to_yaml())
    return run_dir


def assert_refused(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_teacher_directory_exits_2(tmp_path):
    proc = kiln_main("distill", write_student(tmp_path, tmp_path / "nowhere"))
    assert_refused(proc, "distillation.teacher_run_dir", "nowhere")
    assert not (tmp_path / "runs").exists()


def test_vocabulary_mismatch_exits_2(tmp_path):
    teacher_dir = fake_teacher(tmp_path, vocab_size=512)
    proc = kiln_main("distill", write_student(tmp_path, teacher_dir))
    assert_refused(proc, "model.vocab_size", "384", "512")
    assert not (tmp_path / "runs").exists()


def test_bad_layer_map_index_exits_2(tmp_path):
    teacher_dir = fake_teacher(tmp_path)
    proc = kiln_main("distill", write_student(tmp_path, teacher_dir, layer_map=[[0, 2]]))
    assert_refused(proc, "distillation.layer_map", "teacher layer 2", "0..1")
    student = write_student(tmp_path, teacher_dir)
    proc = kiln_main("distill", student, "distillation.layer_map=[[1,0]]")
    assert_refused(proc, "distillation.layer_map", "student layer 1", "0..0")
    assert not (tmp_path / "runs").exists()


# --- end to end ---------------------------------------------------------------------------------


def metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "learning/loss" in r}


def final_params(config_path):
    from kiln.config import load_config
    from kiln.runs.checkpoint import latest_complete_step
    from kiln.runs.restore import abstract_like, restore
    from kiln.training.loop import checkpoint_tree

    config = load_config(config_path)
    teacher_cfg, _, _ = distill.read_teacher_config(config)
    # The student's state as shapes and shardings (as `kiln compile` lowers it): nothing to
    # initialise for a restore target.
    builder = distill.student_builder(config, teacher_cfg)
    state = train.abstract_train_state(config, make_mesh(config), builder)
    directory = config.run_dir / "checkpoints"
    tree, _ = restore(directory, latest_complete_step(directory), abstract_like(checkpoint_tree(state)))  # fmt: skip
    return host(tree)


@pytest.mark.slow
def test_distillation_run_resumes_like_a_training_run(tmp_path, teacher):
    # The teacher's run directory: its config and a checkpoint of the module's random teacher
    # (a student reads nothing else of the run, so it need not have trained).
    teacher_dir = tmp_path / "runs" / "teacher"
    ckpt = Checkpointer(teacher_dir, teacher.config.checkpoint)
    model = nnx.merge(teacher.graphdef, teacher.params, teacher.rest)
    ckpt.save(3, checkpoint_tree(train.state_from_model(teacher.config, make_mesh(teacher.config), model)), {})  # fmt: skip
    ckpt.close()
    run = make_config(TEACHER_MODEL, tmp_path=tmp_path / "runs", mesh={"data": 1, "fsdp": -1, "tensor": 1}, train={"run_name": "teacher"})  # fmt: skip
    (teacher_dir / "config.yaml").write_text(run.to_yaml())

    def student(name, steps):
        # A constant schedule: the run's checkpoint of step 4 is that of a run of 4 steps.
        raw = yaml.safe_load(write_student(tmp_path, teacher_dir).read_text())
        raw["optim"]["schedule"] = "constant"
        raw["train"].update(run_name=name, steps=steps, gradient_accumulation_steps=2)
        raw["checkpoint"].update(every_steps=2, async_save=False)
        raw["loss"]["num_vocab_tiling"] = 2
        out = tmp_path / f"{name}.yaml"
        out.write_text(yaml.safe_dump(raw))
        return out

    # In this process too: the runs are compared with one another.
    config = student("run", 6)
    proc = kiln_main("distill", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "run"
    want = metrics(run_dir)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    assert all(k in want[6] for k in [f"distill/{m}" for m in distill.METRICS])
    assert all(k in want[6] for k in ("learning/grad_norm", "perf/tokens_per_sec"))
    # The console shows the parts of the balanced total, not only the total.
    line = next(x for x in proc.stdout.splitlines() if x.startswith("step 6/6  loss"))
    assert f"hard {want[6]['distill/hard_loss']:.4f}" in line, line
    assert f"soft {want[6]['distill/soft_loss']:.4f}" in line, line
    a = final_params(config)

    # The run as if stopped after its save of step 4, then started again.
    shutil.rmtree(run_dir / "checkpoints" / "6")
    proc = kiln_main("distill", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from step 4" in proc.stderr
    got = metrics(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):
        for key in ("learning/loss", "distill/soft_loss", "distill/feature_loss"):
            assert got[step][key] == want[step][key], (step, key)  # bitwise
    b = final_params(config)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)  # bitwise


def test_a_teacher_whose_config_does_not_match_its_checkpoint_names_the_teacher_field(
    tmp_path, teacher
):
    # The teacher's checkpoint holds d_ff 64; its config.yaml, edited, says 128.
    run_dir = tmp_path / "teacher"
    state = train.state_from_model(
        teacher.config,
        make_mesh(teacher.config),
        nnx.merge(teacher.graphdef, teacher.params, teacher.rest),
    )
    ckpt = Checkpointer(run_dir, teacher.config.checkpoint)
    ckpt.save(2, checkpoint_tree(state), {})
    ckpt.close()
    edited = make_config({**TEACHER_MODEL, "d_ff": 128})
    (run_dir / "config.yaml").write_text(edited.to_yaml())
    student = make_config(distillation={"teacher_run_dir": str(run_dir)})
    with pytest.raises(KilnError) as e:
        distill.load_teacher(student, make_mesh(student))
    assert str(e.value).startswith("distillation.teacher_run_dir: "), e.value
    assert "does not match this model" in str(e.value) and "\n" not in str(e.value)
