"""Pipeline stages (mesh.stage, the pipeline section): the schedule against running the layers
in order, the whole train step's loss and gradients against one device, the bubble, and the
configs refused."""

import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import kiln_main
from kiln.commands import fit
from kiln.commands.compile import lower_step
from kiln.config import DEFAULT_AXIS_RULES, MESH_AXES, config_from_dict, load_config
from kiln.data import make_datasets
from kiln.errors import KilnError
from kiln.model import abstract_state
from kiln.parallel import pipeline
from kiln.parallel.mesh import make_mesh, use_rules
from kiln.runs.restore import abstract_like, restore
from kiln.training import train
from kiln.training.batches import place_batch
from kiln.training.loop import checkpoint_tree
from kiln.training.profiling import compilation_cache_for

SEQ, BATCH, VOCAB = 16, 16, 128
MODEL = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "num_layers": 8,
    "num_heads": 4,
    "num_kv_heads": 2,
    "d_ff": 64,
    "max_seq_len": SEQ,
}


def auto_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


# ---------------------------------------------------------------------------------------------
# The schedule


def toy_layers(w, x, e, r=None):
    """A few layers scanned in order, with a per-layer aux (the sum of each layer's input); in
    stages, w [layers, repeats, ...] and layer j runs with w[j, r] (`pipeline.stack`)."""

    def body(x, wl):
        wl = wl if r is None else wl[r]
        return jnp.tanh(x @ wl + e[:, None]), jnp.sum(x)

    return jax.lax.scan(body, x, w)


def in_order(w_L, x_MBD, e_MB):
    outs = [toy_layers(w_L, x, e) for x, e in zip(x_MBD, e_MB)]
    return jnp.stack([y for y, _ in outs]), sum(a for _, a in outs)


@pytest.mark.parametrize(
    ("stages", "repeats", "micro"),
    [(2, 1, 2), (4, 1, 8), (2, 2, 4), (4, 2, 4)],
)
def test_schedule_runs_every_layer_in_order_on_every_micro_batch(stages, repeats, micro):
    layers = 2 * stages * repeats
    rng = np.random.default_rng(0)
    w_L, x_MBD, e_MB = (
        jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
        for shape, scale in (((layers, 8, 8), 1 / 3), ((micro, 4, 8), 1), ((micro, 4), 1 / 10))
    )
    schedule = pipeline.Schedule(stages, repeats, micro)

    def piped(w_L, x_MBD):
        x_GD = x_MBD.swapaxes(0, 1).reshape(-1, 8)  # stack() cuts rows a, a + M, ...
        e_G = e_MB.swapaxes(0, 1).reshape(-1)
        y_GD, aux_L = pipeline.stack(toy_layers, w_L, x_GD, e_G, schedule)
        return y_GD.reshape(4, micro, 8).swapaxes(0, 1), aux_L

    def with_grads(run):
        """((sum of the outputs squared, (outputs, aux)), its gradients): one program."""

        def loss(w, x):
            y, aux = run(w, x)
            return jnp.sum(y**2), (y, aux)

        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))

    with jax.set_mesh(auto_mesh((stages, 8 // stages), ("stage", "fsdp"))):
        (_, (y, aux)), grads = with_grads(piped)(w_L, x_MBD)
    (_, (want_y, want_aux)), want_grads = with_grads(lambda w, x: in_order(w, x, e_MB))(w_L, x_MBD)
    # The same float32 operations on the same values in the same order: equal up to XLA's
    # fusion of the element-wise tail (1e-6 relative).
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(aux, want_aux, rtol=1e-6)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())


def test_bubble_and_stage_order():
    assert pipeline.Schedule(4, 1, 4).iterations == 7
    assert pipeline.Schedule(4, 2, 8).bubble == pytest.approx(3 / 19)
    # Stage s, repeat r holds the layers of position r·S + s.
    order = pipeline.stage_order(8, 2, 2).reshape(2, 2, 2)
    assert order[0].tolist() == [[0, 1], [4, 5]] and order[1].tolist() == [[2, 3], [6, 7]]
    assert pipeline.stage_order(8, 4, 1).tolist() == list(range(8))
    # The regroup's rounds: each a permutation of the stages, together every move once.
    for stages, repeats in [(4, 2), (2, 3), (8, 4), (3, 5), (16, 2)]:
        rounds = pipeline.regroup_rounds(stages, repeats)
        assert len(rounds) == repeats
        for match in rounds:
            assert sorted(match) == sorted(q for q, _, _ in match.values()) == list(range(stages))
        moves = sorted(
            (q * repeats + c, r * stages + d) for m in rounds for d, (q, c, r) in m.items()
        )
        assert moves == [(p, p) for p in range(stages * repeats)]  # position p to its own place


@pytest.mark.parametrize("stages,repeats", [(4, 2), (2, 3)])
def test_the_circular_regroup_moves_each_stages_weights_once_bit_for_bit(stages, repeats):
    """`to_stage_order` on a stage x fsdp mesh: the weights (a -0.0 among them) and their
    gradients equal numpy's take in `stage_order`, bitwise, and no weight is gathered."""
    fsdp = 8 // stages
    mesh = auto_mesh((stages, fsdp), ("stage", "fsdp"))
    layers = stages * repeats * 2
    a = np.random.default_rng(0).normal(size=(layers, 4, 2 * fsdp)).astype(np.float32)
    a[1, 2, 3] = -0.0
    order = pipeline.stage_order(layers, stages, repeats)
    seen = np.arange(layers, dtype=np.float32)[:, None, None]  # d loss / d regrouped[k] = k
    spec = jax.sharding.PartitionSpec("stage", "fsdp")
    x = jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    def regroup(x):
        return pipeline.to_stage_order(x, stages, repeats)

    with jax.set_mesh(mesh):
        forward = jax.jit(regroup)
        y = forward(x)
        grad = jax.jit(jax.grad(lambda x: jnp.sum(regroup(x) * seen)))(x)
        hlo = forward.lower(x).compile().as_text()
    np.testing.assert_array_equal(np.asarray(y).view(np.int32), a[order].view(np.int32))
    want = np.zeros_like(a)
    want[order] = np.broadcast_to(seen, a.shape)
    np.testing.assert_array_equal(np.asarray(grad), want)
    assert y.sharding.spec == spec
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    # One permute a round of moves (R rounds, every stage sending one chunk in each; a round in
    # which every chunk stays on its stage has none), not one per chunk and slot (R²).
    rounds = pipeline.regroup_rounds(stages, repeats)
    moving = sum(any(q != d for d, (q, _, _) in m.items()) for m in rounds)
    assert len(rounds) == repeats and moving == {(4, 2): 2, (2, 3): 1}[stages, repeats]
    assert len(re.findall(r"= f32\[[\d,]+\]\S* collective-permute\(", hlo)) == moving


@pytest.mark.parametrize("rows", [16, 8], ids=["stage_rows", "whole_microbatches"])
def test_each_microbatch_runs_on_each_stages_rows_where_they_divide(rows):
    """`each_microbatch` with a statistic of the batch it sees (a mean over rows): the outputs
    and the statistic summed over micro-batches equal numpy's, micro-batch m being rows m, m +
    M, .... 16 rows in 2 micro-batches divide over stage 2 x fsdp 4 (each stage computes its
    rows, no rows cross stages); 8 rows do not (every stage computes whole micro-batches)."""
    mesh = auto_mesh((2, 4), ("stage", "fsdp"))
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32)

    def fn(x_BD):
        mean_D = jnp.mean(x_BD, axis=0)
        return x_BD - mean_D, jnp.sum(mean_D)

    rules = {**dict(DEFAULT_AXIS_RULES), "batch": ["stage", "fsdp"]}
    with jax.set_mesh(mesh), use_rules(rules):
        placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(("stage", "fsdp"))))
        run = jax.jit(lambda a: pipeline.each_microbatch(fn, (a,), 2))
        out, stat = run(placed)
        hlo = run.lower(placed).compile().as_text()
    micro = [x[m::2] for m in range(2)]
    want = np.empty_like(x)
    for m, piece in enumerate(micro):
        want[m::2] = piece - piece.mean(axis=0)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)  # float32 means of 4-8 rows
    np.testing.assert_allclose(stat, sum(p.mean(axis=0).sum() for p in micro), rtol=1e-5)
    assert out.sharding.spec[0] == ("stage", "fsdp")
    moved = re.findall(r"= f32\[[\d,]+\]\S* (all-gather|all-to-all)\(", hlo)
    assert (moved == []) == (rows == 16), moved


def test_the_stages_pass_activations_by_collective_permute():
    schedule = pipeline.Schedule(4, 1, 4)
    w_L = jnp.zeros((8, 8, 8))
    mesh = auto_mesh((4, 2), ("stage", "fsdp"))
    w_L = jax.device_put(w_L, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("stage")))

    def loss(w_L, x_GD):
        return jnp.sum(pipeline.stack(toy_layers, w_L, x_GD, jnp.zeros(16), schedule)[0])

    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(w_L, jnp.ones((16, 8))).compile().as_text()
    # The weights stay on their stages (no all-gather of the stack); activations move.
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo


# ---------------------------------------------------------------------------------------------
# The train step


def make_config(**sections):
    raw = {
        "model": dict(MODEL),
        "data": {"seq_len": SEQ},
        "train": {"global_batch_size": BATCH, "steps": 4, "log_every_steps": 1},
        "optim": {"warmup_steps": 0},
        "loss": {"z_loss_multiplier": 1e-2},
        "mesh": {"fsdp": -1},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return config_from_dict(raw)


def random_batch(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    real = rng.integers(SEQ // 2, SEQ + 1, BATCH)
    weights = (np.arange(SEQ)[None, :] < real[:, None]).astype(np.float32)
    return {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
        "segment_ids": (weights > 0).astype(np.int32),
        "weights": weights,
    }


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def mesh_on(sizes):
    """A mesh of these axis sizes (the others 1) on the first devices."""
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=jax.devices()[: np.prod(shape)])


def holding(config, params, mesh=None):
    """`config`'s train state on `mesh` (its own by default) holding `params`, copied into its
    shardings, and no optimizer state: what `loss_and_grads` reads, nothing initialised."""
    _, state = train.abstract_pretraining(config, make_mesh(config) if mesh is None else mesh)
    params = jax.device_put(params, train.shardings_of(state.params))
    return state.replace(step=jnp.zeros((), jnp.int32), params=params, opt_state=())


def drawn_params(config):
    """Parameters of `config`'s model drawn by numpy, no init program compiled: norm scales
    about 1, the other arrays normal (biases and sinks too, which the model's init zeroes)."""
    rng = np.random.default_rng(0)

    def draw(p):
        x = rng.standard_normal(p.shape)
        role = p.get_metadata().get("role")
        x = 1 + x / 10 if role == "norm" else x / np.sqrt(config.model.d_model)
        return p.replace(x.astype(p.dtype))

    shapes = abstract_state(config.model)
    return jax.tree.map(draw, shapes, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.fixture(scope="module")
def one_device_run():
    """Three optimizer steps on one device: each step's params, batch, loss and gradients."""
    config = make_config(mesh={"fsdp": 1})
    mesh = mesh_on({})
    state = train.init_state(config, mesh)
    step = train.make_train_step(config, mesh, train.shardings_of(state))
    steps = []
    for i in range(3):
        batch = random_batch(i)
        loss, _, grads = train.loss_and_grads(config, state, batch)
        steps.append((host(state.params), batch, float(loss), host(grads)))
        state, _ = step(state, place_batch(batch, mesh, config))
    return steps


@pytest.mark.parametrize(
    ("mesh", "accum", "pipe"),
    [
        ({"stage": 4, "tensor": 2}, 2, {"microbatches": 4}),  # accumulation of pipelines
        ({"stage": 2, "fsdp": 4}, 1, {"microbatches": 4, "repeats": 2}),  # circular, 2 x S
        # Circular, micro-batches = stages, from the accumulation.
        ({"stage": 4, "fsdp": 2}, 4, {"repeats": 2}),
    ],
)
def test_pipelined_step_equals_one_device(one_device_run, mesh, accum, pipe):
    config = make_config(
        mesh={"fsdp": 1, **mesh}, train={"gradient_accumulation_steps": accum}, pipeline=pipe
    )
    for params, batch, want_loss, want_grads in one_device_run:
        loss, _, grads = train.loss_and_grads(config, holding(config, params), batch)
        # float32; the same sums over the batch's tokens in another order: 1e-5 relative.
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
        for g, w in zip(jax.tree.leaves(host(grads)), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


MOE = {
    "num_experts": 4,
    "experts_per_token": 2,
    "d_ff_expert": 32,
    "router_z_loss": 1e-3,
    "load_balance_loss": 1e-2,
}
DEEPSEEK = {
    "family": "deepseek",
    "num_layers": 6,
    "num_kv_heads": None,
    "moe": {
        **MOE,
        "first_dense_layers": 2,
        "num_shared_experts": 1,
        "score": "sigmoid",
        "n_group": 2,
        "routed_scaling_factor": 2.5,
        "balance": "aux_free",
    },
    "deepseek": {
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "mtp_num_layers": 1,
        "mtp_loss_weight": 0.3,
    },
}


@pytest.mark.parametrize(
    ("model", "mesh", "accum", "pipe", "unstaged"),
    [
        # GPT-OSS: sliding and full layers alternating (each stage scans its layers' kinds),
        # sinks, router and expert biases, in circular stages; experts split over `expert`
        # with a capacity, ring attention over `sequence`, accumulation around the pipeline.
        # The capacity's drops are per device: the reference has the same devices per
        # micro-batch (expert 2 x sequence 2, all-gathered attention).
        (
            {
                "family": "gpt_oss",
                "moe": {**MOE, "capacity_factor": 1.0},
                "attention_sinks": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"],
                "context_parallel": "ring",
            },
            {"stage": 2, "expert": 2, "sequence": 2},
            2,
            {"microbatches": 2, "repeats": 2},
            {"mesh": {"expert": 2, "sequence": 2}, "model": {"context_parallel": "all_gather"}},
        ),
        # DeepSeek: dense blocks before the circular MoE stack, group routing, a shared expert,
        # a prediction module, which runs on each stage's rows of each micro-batch (8 rows over
        # stage x expert x fsdp); the accumulation's micro-batches are the pipeline's (no
        # accumulation loop).
        (DEEPSEEK, {"stage": 2, "expert": 2, "fsdp": 2}, 2, {"repeats": 2}, {}),
    ],
    ids=["gpt_oss", "deepseek"],
)
def test_moe_in_stages_equals_the_run_without(model, mesh, accum, pipe, unstaged):
    """Loss, routing statistics and gradients of an MoE model in stages against the same model
    without stages (`unstaged`: its mesh, one device by default, and model changes), its
    accumulation running the pipeline's micro-batches (the router's balance loss and an
    expert's capacity depend on the tokens of one call)."""
    model = {**MODEL, "num_layers": 4, **model}
    pieces = accum * pipe.get("microbatches", 1)
    ref = make_config(
        model={**model, **unstaged.get("model", {})},
        mesh={"fsdp": 1, **unstaged.get("mesh", {})},
        train={"gradient_accumulation_steps": pieces},
    )
    params = drawn_params(ref)
    batch = random_batch(0)
    state = holding(ref, params, mesh_on(unstaged.get("mesh", {})))
    want_loss, want_aux, want_grads = host(train.loss_and_grads(ref, state, batch))
    config = make_config(
        model=model,
        mesh={"fsdp": 1, **mesh},
        train={"gradient_accumulation_steps": accum},
        pipeline=pipe,
    )
    loss, aux, grads = host(train.loss_and_grads(config, holding(config, params), batch))
    assert sorted(aux) == sorted(want_aux) and "moe/expert_tokens" in aux
    if "capacity_factor" in model["moe"]:
        assert want_aux["moe/dropped_tokens"].sum() > 0
    # float32; the same sums over the batch's tokens in another order: 1e-5 relative.
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for k, w in want_aux.items():
        np.testing.assert_allclose(aux[k], w, rtol=1e-5, err_msg=k)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


# ---------------------------------------------------------------------------------------------
# Refused


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            ["mesh.stage=2", "mesh.fsdp=4", "model.num_layers=3", "pipeline.microbatches=2"],
            "model.num_layers: 3",
        ),
        (
            [
                *("mesh.stage=2", "mesh.fsdp=4", "pipeline.repeats=2", "model.num_layers=6"),
                "pipeline.microbatches=2",
            ],
            "model.num_layers: 6",
        ),
        (["mesh.stage=4", "mesh.fsdp=2"], "train.gradient_accumulation_steps: 1"),
        (["mesh.stage=4", "mesh.fsdp=2", "pipeline.microbatches=2"], "pipeline.microbatches: 2"),
        (["pipeline.repeats=2"], "pipeline.repeats: 2"),
        (["pipeline.microbatches=4"], "pipeline.microbatches: 4"),
        (
            [
                *("mesh.stage=2", "mesh.fsdp=4", "pipeline.microbatches=2"),
                *("model.family=moe", "model.moe.first_dense_layers=1"),
            ],
            "model.moe.first_dense_layers: 1",
        ),
        # The batch outside the stages is split over stage x fsdp = 8 shards: 12 rows are not,
        # though each of the 3 pipeline micro-batches (4 rows) divides over a stage's 4.
        (
            [
                *("mesh.stage=2", "mesh.fsdp=4"),
                *("train.global_batch_size=12", "train.gradient_accumulation_steps=3"),
            ],
            "train.global_batch_size: micro-batch of 12 sequences",
        ),
        (
            [
                *("mesh.stage=2", "mesh.fsdp=4"),
                *("train.global_batch_size=16", "train.gradient_accumulation_steps=8"),
            ],
            "train.global_batch_size: pipeline micro-batch of 2 sequences",
        ),
    ],
)
def test_refused_in_one_line(tmp_path, overrides, field):
    r = kiln_main("train", "configs/tiny.yaml", f"train.output_dir={tmp_path}", *overrides)
    err = r.stderr
    assert r.returncode == 2 and r.stdout == ""
    assert err.startswith(f"kiln: error: {field}") and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_no_stage_axis_no_pipeline():
    config = make_config(mesh={"fsdp": 8})
    assert pipeline.current_schedule() is None
    with pytest.raises(KilnError, match=r"model\.num_layers"):
        make_config(mesh={"stage": 2, "fsdp": 4}, model={**MODEL, "num_layers": 5})
    assert config.pipeline.repeats == 1


# ---------------------------------------------------------------------------------------------
# Checkpoints between stage counts


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["learning/loss"] for r in rows if "learning/loss" in r}


def test_a_run_saved_on_4_stages_resumes_on_2_bitwise(tmp_path):
    """The step after a resume from 4 stages onto 2 is bitwise the step the stage-2 program takes
    from the same state in memory (no checkpoint between): the restore moves every array into
    the new stages exactly, with the data iterator's position.

    The same checkpoint continued on 4 stages is no reference for bits: there the batch rows and
    the gradient sums are split over fsdp 2, not 4, another float32 order (its next loss was 4e-7
    apart, the parameters after the update up to 6e-8; docs/pipeline.md)."""
    common = [
        "configs/tiny.yaml",
        f"train.output_dir={tmp_path}",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "train.log_every_steps=1",
        "train.eval_every_steps=0",
        "checkpoint.every_steps=1",
        "train.gradient_accumulation_steps=4",
        *("data.seq_len=16", "model.d_model=32", "model.d_ff=64"),
    ]
    four, two = ["mesh.stage=4", "mesh.fsdp=2"], ["mesh.stage=2", "mesh.fsdp=4"]
    r = kiln_main("train", *common, "train.steps=1", *four)
    assert r.returncode == 0, r.stderr
    r = kiln_main("train", *common, "train.steps=2", *two)
    assert r.returncode == 0, r.stderr
    assert "resuming from step 1" in r.stderr
    assert "changed on resume: mesh.stage: 4 -> 2" in r.stderr
    run_dir = tmp_path / "tiny"

    # The reference: step 1's state as the stage-4 run holds it (its own layout), moved in
    # memory to the shardings of `mesh`; the iterator at its saved position; the step of that
    # mesh (the program a run there compiled, read from the runs' compilation cache).
    config4 = load_config(common[0], [*common[1:], "train.steps=1", *four])
    _, abstract4 = train.abstract_pretraining(config4, make_mesh(config4))
    saved, data_state = restore(
        run_dir / "checkpoints", 1, abstract_like(checkpoint_tree(abstract4))
    )
    batches = make_datasets(config4).train_iterator()
    batches.set_state(data_state)
    batch = next(batches)  # the batch of step 2, for either mesh

    def next_step(mesh_overrides):
        config = load_config(common[0], [*common[1:], "train.steps=2", *mesh_overrides])
        mesh = make_mesh(config)
        objective, state = train.abstract_pretraining(config, mesh)  # shapes and shardings
        assert jax.tree.leaves(state.rest) == []  # every array comes from the checkpoint
        moved = jax.device_put(saved, train.shardings_of(checkpoint_tree(state)), may_alias=False)
        state = state.replace(**moved)  # a copy: the step donates it
        with compilation_cache_for(config), jax.default_matmul_precision(None):
            step = train.make_step(objective, train.shardings_of(state))
            state, metrics = step(state, place_batch(batch, mesh, config))
        return float(metrics["learning/loss"]), checkpoint_tree(state)

    loss2, on_two = next_step(two)
    assert loss2 == losses(run_dir)[2]
    resumed, _ = restore(run_dir / "checkpoints", 2, abstract_like(on_two))
    want = host(on_two)
    for got, w in zip(jax.tree.leaves(host(resumed)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, w)  # bitwise: the same program on the same bits
    # On 4 stages (fsdp 2): float32 sums over the batch in another order, 1e-5 relative.
    loss4, on_four = next_step(four)
    np.testing.assert_allclose(loss4, loss2, rtol=1e-5)
    for got, w in zip(jax.tree.leaves(host(on_four)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
    # The run decodes as any other: its model on its rules (stage and all), one prompt.
    r = kiln_main("generate", run_dir, "--prompt", "def", "--max-new-tokens", "2")
    assert r.returncode == 0 and r.stdout.startswith("def"), r.stderr


# tiny.yaml (32 sequences, vocabulary 384) on 4 stages x fsdp 2, 8 micro-batches of 16 tokens.
STAGED = [
    *("mesh.stage=4", "mesh.fsdp=2", "train.gradient_accumulation_steps=8"),
    *("data.seq_len=16", "model.d_model=32", "model.d_ff=64"),
]


def test_compile_reports_the_bubble_and_the_permutes():
    r = kiln_main("compile", "configs/tiny.yaml", "--devices", "8", "--json", *STAGED)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["pipeline"] == {
        "stages": 4,
        "repeats": 1,
        "microbatches": 8,
        "iterations": 11,
        "bubble": round(3 / 11, 6),
    }
    permutes = report["collectives"]["collective-permute"]
    # Forward and backward: the activations move once per iteration each way.
    assert permutes["ops_per_step"] >= 2 * 11 and permutes["bytes_per_step"] > 0
    # Inside the loop over the iterations: a step moves more than the static count says, and
    # XLA:CPU gives every trip count, so no lower bound is reported.
    assert permutes["bytes_per_step"] > permutes["bytes"]
    assert "collectives_per_step_at_least" not in report


def test_the_lm_head_and_the_loss_run_on_each_stages_rows():
    """Outside the stages the batch's rows are split over `stage` too (the default batch rule
    gets it in front), so each device computes the logits of 32 / (4 stages x 2 fsdp) = 4
    sequences, not those of the 16 its stage would hold whole."""
    config = load_config("configs/tiny.yaml", STAGED)
    assert config.mesh.rules["batch"] == ["stage", "data", "fsdp", "expert"]
    assert config.mesh.rules["layers"] == ["stage"]
    own = load_config("configs/tiny.yaml", [*STAGED, "mesh.rules.batch=[data,fsdp]"])
    assert own.mesh.rules["batch"] == ["data", "fsdp"]  # a rule of the config's own is kept
    lowered, *_ = lower_step(config, jax.devices())
    # The program test_compile_reports_the_bubble_and_the_permutes compiles (the run's cache).
    hlo = lowered.compile().as_text()
    logits = set(re.findall(r"f32\[(\d+),16,384\]", hlo))  # [rows, length, vocab] per device
    assert logits == {"4"}, logits


def test_fit_searches_the_repeats_most_first_on_each_stage_split(monkeypatch):
    """`--fit --fit-mesh stage,fsdp` probes each split with every valid pipeline.repeats, most
    first; the compile is replaced by a peak that fits only on 2 stages without repeats, so
    the order of the trials is the search's, not a compiler's."""
    config = load_config(
        "configs/tiny.yaml",
        [
            "model.num_layers=6",
            "mesh.stage=2",
            "mesh.fsdp=4",
            "train.gradient_accumulation_steps=2",
        ],
    )

    def compile_report(c, devices):
        fits = c.mesh.stage == 2 and c.pipeline.repeats == 1
        return types.SimpleNamespace(memory={"peak": 0 if fits else 2 * fit.GB})

    monkeypatch.setattr(fit, "compile_report", compile_report)
    found = fit.fit(config, jax.devices(), 1.0, ("stage", "fsdp"))
    tried = [(s.mesh[0], s.repeats) for s, _ in found.trials]
    # 6 layers on 2 stages: 3 repeats first (the smallest bubble), then 1 (2 does not divide).
    assert tried[:2] == [(("stage", 2), 3), (("stage", 2), 1)]
    assert found.best.repeats == 1 and dict(found.best.mesh)["stage"] == 2
    assert found.best.overrides().endswith(" pipeline.repeats=1")
    # 4 and 8 stages do not divide 6 layers at any repeats: skipped, each with the refusal.
    assert [(m["stage"], r) for m, r, _ in found.skipped] == [(8, 1), (4, 1)]
    assert all("not divisible by mesh.stage x pipeline.repeats" in why for *_, why in found.skipped)
    report = json.loads(json.dumps(found.to_json()))
    assert [t["repeats"] for t in report["trials"][:2]] == [3, 1]
    assert report["skipped_splits"][0]["repeats"] == 1
    text = fit.format_fit(found)
    assert "pipeline.repeats=3" in text and "skipped mesh stage=8" in text


def test_repeats_ladder_divides_the_staged_stack_up_to_the_cap():
    tiny = load_config("configs/tiny.yaml", ["model.num_layers=64"])
    assert fit.repeats_ladder(tiny, 2) == [8, 4, 2, 1]  # 32 layers a stage, capped at 8
    assert fit.repeats_ladder(tiny, 1) == [1]
    assert fit.repeats_ladder(tiny, 128) == [tiny.pipeline.repeats]  # none: its refusal says why
    # DeepSeek stages only the MoE layers after the first dense one: 8 of 9.
    deepseek = load_config("configs/deepseek_tiny.yaml", ["model.num_layers=9"])
    assert fit.repeats_ladder(deepseek, 2) == [4, 2, 1]
