"""The train step: exact gradient accumulation, tiled == untiled through the whole model,
skipping non-finite steps, and one training run end to end."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import REPO, kiln_main
from kiln.config import MESH_AXES, config_from_dict
from kiln.data.eval_tasks import parse_task, task_path
from kiln.errors import RunStopped
from kiln.training import pretrain, runner, train
from kiln.training.batches import place_batch

SEQ, BATCH, VOCAB = 16, 32, 128
MODEL = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "d_ff": 64,
    "max_seq_len": SEQ,
}


def make_config(tmp_path=None, **sections):
    raw = {
        "model": dict(MODEL),
        "data": {"seq_len": SEQ},
        "train": {"global_batch_size": BATCH, "steps": 4, "log_every_steps": 1},
        "optim": {"warmup_steps": 0},
        "mesh": {"fsdp": -1},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    if tmp_path is not None:
        raw["train"]["output_dir"] = str(tmp_path)
    return config_from_dict(raw)


def uneven_batch(seed=0):
    """A global batch whose rows hold very different numbers of real tokens, and two documents."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    real = np.array([SEQ if i % 4 == 0 else (i * 5) % SEQ for i in range(BATCH)])
    weights = (np.arange(SEQ)[None, :] < real[:, None]).astype(np.float32)
    segments = np.where(np.arange(SEQ)[None, :] < SEQ // 3, 1, 2) * (weights > 0)
    starts = np.where(segments == 2, SEQ // 3, 0)
    return {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "positions": (np.arange(SEQ)[None, :] - starts).astype(np.int32) * (weights > 0),
        "segment_ids": segments.astype(np.int32),
        "weights": weights,
    }


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def one_device_mesh():
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(
        (1,) * len(MESH_AXES), MESH_AXES, axis_types=axis_types, devices=jax.devices()[:1]
    )


def init(config):
    """Train state on the configured mesh, or on one device when the mesh sizes multiply to 1."""
    sizes = [getattr(config.mesh, a) for a in MESH_AXES]
    return train.init_state(config, one_device_mesh() if set(sizes) == {1} else None)


def loss_and_grads(config, batch, state=None):
    state = init(config) if state is None else state
    loss, aux, grads = train.loss_and_grads(config, state, batch)
    return float(loss), {k: float(v) for k, v in aux.items()}, host(grads)


@pytest.fixture(scope="module")
def batch():
    return uneven_batch()


@pytest.fixture(scope="module")
def reference(batch):
    """One device, no accumulation, untiled: the path every other one must reproduce."""
    return loss_and_grads(make_config(mesh={"fsdp": 1}, loss={"z_loss_multiplier": 1e-2}), batch)


def assert_same(got, want):
    loss, aux, grads = got
    ref_loss, ref_aux, ref_grads = want
    # f32 throughout; sums over 300 tokens in another order: 1e-5 relative.
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["learning/z_loss"], ref_aux["learning/z_loss"], rtol=1e-5)
    assert aux["learning/total_weights"] == ref_aux["learning/total_weights"]
    flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for g, r in zip(flat, ref_flat, strict=True):
        # 1e-5 relative to the largest entry of each gradient (entries near zero have no
        # meaningful elementwise relative error).
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


def test_reference_is_sane(reference, batch):
    loss, aux, grads = reference
    assert aux["learning/total_weights"] == batch["weights"].sum()
    assert np.log(VOCAB) * 0.8 < loss < np.log(VOCAB) * 1.3
    assert 0 < aux["learning/z_loss"] < loss
    assert all(np.isfinite(g).all() and np.abs(g).max() > 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    ("accum", "tiles", "mesh"),
    [
        (2, 1, {"fsdp": 1}),
        (1, 4, {"fsdp": 1}),
        (4, 4, {"fsdp": 1}),
        (1, 1, {"fsdp": 8}),
        (4, 1, {"fsdp": 8}),
        (4, 16, {"fsdp": 8}),
        (2, 2, {"data": 2, "fsdp": 2, "tensor": 2}),
        (2, 4, {"data": 4, "fsdp": 1, "tensor": 2}),
    ],
)
def test_accumulation_tiling_and_sharding_agree(reference, batch, accum, tiles, mesh):
    config = make_config(
        mesh=mesh,
        train={"gradient_accumulation_steps": accum},
        loss={"num_vocab_tiling": tiles, "z_loss_multiplier": 1e-2},
    )
    assert_same(loss_and_grads(config, batch), reference)


def test_vocabulary_chunks_agree(reference, batch):
    # Online logsumexp over 32-entry chunks of each 64-entry vocabulary shard (tensor=2).
    loss = {"num_vocab_tiling": 2, "vocab_chunk_size": 32, "z_loss_multiplier": 1e-2}
    config = make_config(mesh={"data": 2, "fsdp": 2, "tensor": 2}, loss=loss)
    assert_same(loss_and_grads(config, batch), reference)


# Non-default logical-axis rules: an axis claimed by an earlier dimension is not reused by a
# later one (length on fsdp after batch took it; vocab on [tensor, fsdp]); or the sequence
# split over fsdp while the batch stays on data.
NON_DEFAULT_RULES = [
    {"length": ["fsdp"], "vocab": ["tensor", "fsdp"], "act_vocab": ["tensor", "fsdp"]},
    {"batch": ["data"], "length": ["fsdp"], "embed": ["fsdp", "tensor"], "mlp": ["fsdp"]},
]


RULES_LOSS = {"num_vocab_tiling": 2, "z_loss_multiplier": 1e-2}


def one_train_step(config, batch, state=None):
    """Metrics and parameters after one whole train step (update included), on the host."""
    state = init(config) if state is None else state
    mesh = train.mesh_of(state)
    step = train.make_train_step(config, mesh, train.shardings_of(state))
    state, metrics = step(state, place_batch(batch, mesh, config))
    return host(metrics), host(state.params)


@pytest.fixture(scope="module")
def one_device_step(batch):
    """`one_train_step` on one device with two micro-batches: what every rule set must give."""
    one = make_config(mesh={"fsdp": 1}, train={"gradient_accumulation_steps": 2}, loss=RULES_LOSS)
    return one_train_step(one, batch)


@pytest.mark.parametrize("rules", NON_DEFAULT_RULES)
def test_non_default_rules_train_like_one_device(reference, batch, one_device_step, rules):
    mesh = {"data": 2, "fsdp": 2, "tensor": 2, "rules": rules}
    config = make_config(mesh=mesh, train={"gradient_accumulation_steps": 2}, loss=RULES_LOSS)
    state = init(config)  # the gradients' state, then the step's (which donates it)
    assert_same(loss_and_grads(config, batch, state), reference)
    # One whole train step (update included) on the 8 devices, against one device.
    (got, got_params), (want, want_params) = one_train_step(config, batch, state), one_device_step
    np.testing.assert_allclose(got["learning/loss"], want["learning/loss"], rtol=1e-5)  # f32
    for g, w in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        # One AdamW step of 3e-4 from equal parameters: equal to f32 rounding of the update.
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("mesh", "model"),
    [
        ({"fsdp": 4, "sequence": 2}, {}),
        ({"data": 2, "tensor": 2, "sequence": 2}, {"context_parallel": "ring"}),
        ({"fsdp": 2, "sequence": 4}, {"context_parallel": "ring", "context_load_balance": False}),
    ],
    ids=["fsdp4-sequence2", "ring-data2-tensor2-sequence2", "ring-in-order-fsdp2-sequence4"],
)  # fmt: skip
def test_load_balanced_sequence_shards_train_like_one_device(batch, one_device_step, mesh, model):
    """The step places each sequence zigzag over the sequence shards (the default with
    mesh.sequence > 1), packed documents, padding, loss weights, two micro-batches and a tiled
    vocabulary included: one whole step equals one device's, keys and values gathered or
    passed around a ring (in order too)."""
    config = make_config(
        mesh=mesh, model=model, train={"gradient_accumulation_steps": 2}, loss=RULES_LOSS
    )
    assert config.model.context_load_balance is model.get("context_load_balance")
    assert config.model.balances_context(mesh["sequence"]) is (
        model.get("context_load_balance") is None
    )
    (got, got_params), (want, want_params) = one_train_step(config, batch), one_device_step
    np.testing.assert_allclose(got["learning/loss"], want["learning/loss"], rtol=1e-5)  # f32
    for g, w in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        # One AdamW step of 3e-4 from equal parameters: equal to f32 rounding of the update.
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_tiled_equals_untiled(batch):
    tied = {"model": {"tie_embeddings": True}, "loss": {"z_loss_multiplier": 1e-3}}
    want = loss_and_grads(make_config(mesh={"fsdp": 1}, **tied), batch)
    tiled = {
        "model": {"tie_embeddings": True},
        "loss": {"z_loss_multiplier": 1e-3, "num_vocab_tiling": 4},
    }
    got = loss_and_grads(make_config(mesh={"data": 2, "fsdp": 2, "tensor": 2}, **tiled), batch)
    assert_same(got, want)


def test_loss_is_a_token_mean_not_a_mean_of_micro_batch_means(batch):
    config = make_config(mesh={"fsdp": 1}, train={"gradient_accumulation_steps": 4})
    loss, _, _ = loss_and_grads(config, batch)
    # Micro-batch means differ a lot (rows hold 1..16 real tokens); their plain mean must not
    # be what is reported. Micro-batch a holds rows a, a+4, a+8, ...
    state = init(config)
    one = make_config(mesh={"fsdp": 1})
    sums = []
    for a in range(4):
        rows = {k: v[a::4] for k, v in batch.items()}
        cfg = config_from_dict(
            {
                **one.model_dump(),
                "train": {**one.train.model_dump(), "global_batch_size": BATCH // 4},
            }
        )
        mb_loss, mb_aux, _ = train.loss_and_grads(cfg, state, rows)
        sums.append(
            (
                float(mb_loss) * float(mb_aux["learning/total_weights"]),
                float(mb_aux["learning/total_weights"]),
            )
        )
    token_mean = sum(s for s, _ in sums) / sum(w for _, w in sums)
    np.testing.assert_allclose(loss, token_mean, rtol=1e-5)  # f32 sums: 1e-5 relative
    mean_of_means = np.mean([s / w for s, w in sums])
    assert abs(mean_of_means - token_mean) > 1e-3


# --- the step: skipping non-finite updates ------------------------------------------------------


@pytest.fixture(scope="module")
def stepper():
    config = make_config(mesh={"fsdp": 8}, train={"gradient_accumulation_steps": 2})
    state = train.init_state(config)
    mesh = jax.tree.leaves(state.params)[0].sharding.mesh
    step = train.make_train_step(config, mesh, train.shardings_of(state))
    return config, mesh, state, step


def test_non_finite_batch_skips_the_update(stepper, batch):
    config, mesh, state, step = stepper
    bad = dict(batch, weights=batch["weights"].copy())
    bad["weights"][3, 2] = np.nan
    before = host((state.params, state.opt_state))
    state, metrics = step(state, place_batch(bad, mesh, config))
    assert float(metrics["learning/step_skipped"]) == 1.0
    assert not np.isfinite(float(metrics["learning/loss"]))
    after = host((state.params, state.opt_state))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)  # bitwise: nothing moved
    assert int(state.step) == 1
    state, metrics = step(state, place_batch(batch, mesh, config))
    assert float(metrics["learning/step_skipped"]) == 0.0
    moved = host(state.params)
    assert any(
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(before[0]), jax.tree.leaves(moved), strict=True)
    )


class NanData:
    """Datasets whose training batches are all non-finite: the run must stop cleanly."""

    def __init__(self, real):
        self.real = real
        self.inputs = real.inputs
        self.notes, self.warnings = real.notes, real.warnings  # what the run prints at start

    def train_iterator(self):
        inner = self.real.train_iterator()

        class It:
            def __next__(self):
                b = dict(next(inner))
                b["weights"] = np.full_like(b["weights"], np.nan)
                return b

            def get_state(self):
                return inner.get_state()

            def set_state(self, s):
                inner.set_state(s)

        return It()

    def eval_batches(self, n):
        return self.real.eval_batches(n)


def test_too_many_skips_stop_the_run(tmp_path, monkeypatch):
    real = runner.make_datasets
    monkeypatch.setattr(runner, "make_datasets", lambda c: NanData(real(c)))
    config = make_config(
        tmp_path,
        train={"steps": 20, "max_consecutive_skips": 3},
        data={"source": "synthetic"},
        model={"vocab_size": 384},  # the byte tokenizer's 259 ids, rounded up
    )
    with pytest.raises(RunStopped, match="3 consecutive steps"):
        pretrain.run(config)
    lines = [
        json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [rec["learning/step_skipped"] for rec in lines] == [1.0, 1.0, 1.0]
    assert not list((config.run_dir / "checkpoints").glob("[0-9]*"))


def test_a_run_whose_every_step_is_skipped_fails(tmp_path, monkeypatch):
    real = runner.make_datasets
    monkeypatch.setattr(runner, "make_datasets", lambda c: NanData(real(c)))
    config = make_config(
        tmp_path,
        train={"steps": 2, "max_consecutive_skips": 10},
        data={"source": "synthetic"},
        model={"vocab_size": 384},
    )
    # Shorter than the consecutive-skip limit, yet nothing was trained: not a success, and the
    # parameters are finite, so the batches are named.
    with pytest.raises(RunStopped, match=r"every step of this run.*likely cause: the batches"):
        pretrain.run(config)
    assert not list((config.run_dir / "checkpoints").glob("[0-9]*"))


# --- end to end, as a user runs it -------------------------------------------------------------

REQUIRED_TAGS = {
    "learning/loss",
    "learning/z_loss",
    "learning/total_weights",
    "learning/grad_norm",
    "learning/raw_grad_norm",
    "learning/param_norm",
    "learning/current_learning_rate",
    "learning/lm_head_norm",
    "learning/final_norm_scale",
    "perf/step_time_seconds",
    "perf/tokens_per_sec",
    "perf/per_device_tflops_per_sec",
    "eval/loss",
    "eval/z_loss",
    "eval/perplexity",
}


@pytest.mark.slow
def test_train_end_to_end_writes_every_tag_and_learns(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # tiny.yaml's multiple-choice task, its first 8 questions: its tags, not its score.
    shipped = Path(task_path(parse_task("choice:kiln:stdlib_next_line.jsonl")))
    questions = tmp_path / "stdlib_next_line.jsonl"
    questions.write_text("".join(shipped.read_text().splitlines(keepends=True)[:8]))
    proc = kiln_main(
        "train", "configs/tiny.yaml",
        f"train.output_dir={tmp_path}", "train.steps=15", "train.log_every_steps=5",
        "train.eval_every_steps=15", "optim.warmup_steps=5", "data.source=synthetic",
        "data.synthetic_kind=markov", "data.paths=[]", "loss.z_loss_multiplier=1e-4",
        "model.num_layers=2", "checkpoint.every_steps=0",
        f"train.eval_tasks=[choice:{questions}]",
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "tiny"
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags >= REQUIRED_TAGS, REQUIRED_TAGS - tags
    assert {"eval/stdlib_next_line/acc", "eval/stdlib_next_line/acc_norm"} <= tags, tags
    assert "perf/mfu" not in tags  # CPU: no known peak, so no MFU (logging.peak_tflops_per_device)
    loss = [e.value for e in events.Scalars("learning/loss")]
    assert len(loss) == 3
    assert loss[-1] < loss[0] - 0.5, loss  # the Markov source is learnable
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "learning/loss" in r] == [5, 10, 15]
    z = [r["learning/z_loss"] for r in records if "learning/z_loss" in r]
    assert all(0 < v < 0.01 for v in z), z  # a per-token mean of 1e-4 * lse^2, not a sum
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "15").is_dir()
