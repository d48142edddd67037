"""Every command with the `moe` family: the size summary (total and active parameters), the
config's rules on experts, `kiln compile` (its all-to-alls, --fit over the expert split),
distillation from and into an MoE model, online and offline, and `kiln eval` of an MoE run."""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from conftest import REPO, assert_user_error, kiln_main, make_config
from kiln.commands import compile as aot
from kiln.commands import hlo as hlo_text
from kiln.config import check_devices, load_config
from kiln.data.corpus import split_documents
from kiln.distill.online import abstract_distillation
from kiln.errors import KilnError
from kiln.model import create_model, expert_split, state_size, summary
from kiln.parallel.mesh import make_mesh
from kiln.runs.checkpoint import Checkpointer
from kiln.training import train
from kiln.training.loop import checkpoint_tree
from kiln.training.objective import LMObjective
from kiln.training.optim import make_optimizer, state_name
from kiln.training.pretrain import run

MOE_TINY = REPO / "configs/moe_tiny.yaml"
QWEN = REPO / "configs/models/qwen3-30b-a3b.yaml"
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
F32 = 1e-5  # relative: float32 sums of the same per-token losses in another order

# moe_tiny cut to 2 layers of width 32 and one sequence of 16 tokens per device.
SMALL = [
    *("model.num_layers=2", "model.d_model=32", "model.d_ff=64", "model.moe.d_ff_expert=32"),
    *("data.seq_len=16", "model.max_seq_len=16", "train.global_batch_size=8"),
]


# --- kiln config --summary ----------------------------------------------------------------------


def test_summary_counts_total_and_active_parameters_by_hand():
    config = load_config(MOE_TINY, ["mesh.expert=4", "mesh.fsdp=2"])
    d, layers, vocab, f, e, k, seq = 128, 4, 384, 176, 8, 2, 128
    attention = 4 * d * d  # wq, wk, wv, wo: 4 heads of 32, as many key/value heads
    expert = 3 * d * f  # one SwiGLU expert: gate, up, down
    total = 2 * vocab * d + layers * (attention + 2 * d + d * e + e * expert) + d
    active = total - layers * (e - k) * expert
    matmul = layers * (attention + d * e + k * expert) + d * vocab  # + the router, + the head
    flops = 6 * matmul + 6 * layers * seq * 4 * 32  # causal attention: 6 L S N H
    text = summary(config, make_optimizer(config.optim).init, state_name(config.optim), 8)
    assert f"parameters:        {total:,} (" in text
    assert f"active per token:  {active:,} (" in text
    assert f"FLOPs per token:   {flops:.4g} (" in text
    assert f"6 x {matmul:,} active matmul params" in text
    assert "routed experts:    8 per MoE layer; split over mesh.expert=4: 2 per device" in text
    # perf/mfu divides these FLOPs (the active parameters') by the step time.
    assert LMObjective(config=config, mesh=None).flops_per_token() == flops


def test_summary_memory_per_device_is_what_the_expert_split_model_holds():
    config = load_config(MOE_TINY, [*SMALL, "mesh.expert=4", "mesh.fsdp=2"])
    text = summary(config, make_optimizer(config.optim).init, state_name(config.optim), 8)
    # What one device really holds of the model sharded on this mesh, counted from its shards.
    model = create_model(config, make_mesh(config), seed=0)
    on_device0 = sum(
        shard.data.size
        for array in jax.tree.leaves(nnx.state(model, nnx.Param))
        for shard in array.addressable_shards
        if shard.device == jax.devices()[0]
    )
    assert f"memory per device: {on_device0:,} parameters x 4 bytes" in text
    w_gate = model.blocks.mlp.w_gate.get_value()  # [layers, experts, embed, mlp]
    assert w_gate.addressable_shards[0].data.shape == (2, 2, 16, 32)  # 2 of 8 experts, half D


def test_summary_of_a_dense_model_has_no_expert_lines():
    config = load_config(REPO / "configs/tiny.yaml")
    text = summary(config, make_optimizer(config.optim).init, state_name(config.optim), 8)
    assert "active" not in text and "experts" not in text
    assert expert_split(config, config.mesh.sizes(8)) is None


def test_qwen3_30b_a3b_has_the_published_size_without_allocating():
    config = load_config(QWEN)
    d, layers, vocab, e, k, f = 2048, 48, 151936, 128, 8, 768
    attention = d * 32 * 128 + 2 * d * 4 * 128 + 32 * 128 * d + 2 * 128  # + q and k norms
    expert = 3 * d * f
    total = 2 * vocab * d + layers * (attention + 2 * d + d * e + e * expert) + d
    assert state_size(config, config.mesh.sizes(32))[0] == total == 30_532_122_624  # "30.5B"
    assert all(a.size < 10**6 for a in jax.live_arrays())  # nothing model-sized was created
    active = total - layers * (e - k) * expert
    assert active == 3_353_032_704  # Qwen's "3.3B activated"
    text = summary(config, make_optimizer(config.optim).init, state_name(config.optim), 32)
    assert f"active per token:  {active:,} (3.353B;" in text
    assert "routed experts:    128 per MoE layer; split over mesh.expert=8: 16 per device" in text


# --- the config's rules -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ["model.moe.first_dense_layers=4"],
            ["model.moe.first_dense_layers: 4", "model.num_layers=4", "0..3"],
        ),
        (
            ["model.moe.num_experts=6", "mesh.expert=4", "mesh.fsdp=2"],
            ["mesh.expert: 4", "model.moe.num_experts=6", "1, 2, 3, 6"],
        ),
        (["mesh.rules.experts=[expert,tensor]"], ["mesh.rules.experts", "at most one mesh axis"]),
        (
            ["model.moe.num_experts=8", "model.moe.n_group=3"],
            ["model.moe", "n_group (3) does not divide num_experts (8)", "a divisor"],
        ),
        (
            ["model.moe.num_experts=8", "model.moe.n_group=4", "model.moe.topk_group=5"],
            ["model.moe", "topk_group (5) exceeds n_group (4)", "1..n_group"],
        ),
        (
            ["model.moe.num_experts=8", "model.moe.experts_per_token=3", "model.moe.n_group=4"],
            ["model.moe", "experts_per_token (3) exceeds the 2 experts of topk_group=1"],
        ),
        (["model.moe.score=softmax2"], ["model.moe.score", "softmax2", "sigmoid"]),
        (
            ["model.moe.buffer_factor=1.5", "mesh.expert=1"],
            ["model.moe.buffer_factor: 1.5", "mesh.expert is 1", "mesh.expert > 1"],
        ),
        (["model.moe.buffer_factor=0"], ["model.moe.buffer_factor", "greater than 0"]),
    ],
    ids=[
        "first_dense_layers",
        "num_experts",
        "two_axes",
        "n_group",
        "topk_group",
        "groups_k",
        "score",
        "buffer_without_experts",
        "buffer_zero",
    ],
)
def test_expert_settings_that_cannot_work_exit_2_with_one_line(overrides, needles):
    proc = kiln_main("config", MOE_TINY, *overrides)
    assert_user_error(proc, *needles)


def test_num_experts_is_checked_against_a_filled_expert_axis():
    config = load_config(MOE_TINY, ["model.moe.num_experts=4", "mesh.expert=-1", "mesh.fsdp=1"])
    assert check_devices(config, 4)["expert"] == 4
    with pytest.raises(KilnError, match=r"mesh.expert: 8 does not divide model.moe.num_experts=4"):
        check_devices(config, 8)


def test_expert_axis_of_a_dense_model_shards_like_fsdp():
    """Allowed (docs/sharding.md): it splits the batch and shards the parameters as fsdp does."""
    optimizer = make_optimizer(load_config(REPO / "configs/tiny.yaml").optim)

    def memory(*overrides):
        config = load_config(REPO / "configs/tiny.yaml", list(overrides))
        return summary(config, optimizer.init, state_name(config.optim), 8).splitlines()[-2]

    assert memory("mesh.expert=4", "mesh.fsdp=2") == memory("mesh.fsdp=8")


# --- kiln compile -------------------------------------------------------------------------------


def test_compile_reports_the_all_to_alls_of_expert_parallelism_with_their_bytes():
    devices = aot.use_cpu_devices(8)
    config = load_config(MOE_TINY, [*SMALL, "mesh.expert=4", "mesh.fsdp=2"])
    got = aot.compile_report(config, devices).collectives["all-to-all"]
    # XLA:CPU has no ragged all-to-all: each exchange pads every chunk to the most that can
    # move (min(operand, buffer) rows). Per layer, to 4 expert shards: each device's 16 tokens
    # x 2 experts = 32 rows of 32 float32 per chunk, out and back, and both again in the
    # backward pass; each with the [4, 1] int32 offsets where the chunks land.
    rows = 4 * 32 * 32 * 4
    # Outside the layers, the embedding lookup's result (each device's embed slice of all
    # 8 x 16 tokens) moves to the batch split, and its gradient back: 2 x 8 x 16 x 32 / 8 float32.
    lookup = 2 * 16 * 32 * 4
    assert got["ops"] == 8 + 2 and got["bytes"] == 4 * rows + 4 * 4 * 4 + lookup
    assert got["ops_per_step"] == 2 * 8 + 2  # 2 layers
    assert got["bytes_per_step"] == 2 * (4 * rows + 4 * 4 * 4) + lookup
    alone = load_config(MOE_TINY, [*SMALL, "mesh.expert=1", "mesh.fsdp=8"])
    assert aot.compile_report(alone, devices).collectives["all-to-all"] == {
        "ops": 2,
        "bytes": lookup,
        "ops_per_step": 2,
        "bytes_per_step": lookup,
    }


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu (the kiln[tpu] extra) is not installed")
def test_on_tpu_experts_exchange_only_real_rows_by_ragged_all_to_all():
    """The MoE layer's forward and backward passes compiled for a TPU slice (4 chips, expert
    4): the tokens go out and come back by ragged all-to-alls that move at most each device's
    T·K rows, not a dense exchange with room for all of them at every destination (P·T·K
    rows each way); buffer_factor 1 bounds the receive buffer to T·K rows, which lowers the
    compiled temporaries."""
    from kiln.model.moe import MoeMlp
    from kiln.parallel.mesh import use_mesh

    mesh_devices = aot.topology_devices("v5p-8")
    b, s, d = 8, 128, 128
    reports = []
    for factor in (None, 1.0):
        config = load_config(
            MOE_TINY,
            [*SMALL, f"model.d_model={d}", "mesh.expert=4", "mesh.fsdp=1"]
            + ([f"model.moe.buffer_factor={factor}"] if factor else []),
        )
        mesh = make_mesh(config, mesh_devices)
        graphdef, state = nnx.split(
            nnx.eval_shape(lambda c=config: MoeMlp(c.model, rngs=nnx.Rngs(0)))
        )
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        state = jax.tree.map(
            lambda a, r=rep: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=r), state
        )
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
        x = jax.ShapeDtypeStruct((b, s, d), jnp.float32, sharding=split)
        segments = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=split)

        def loss(state, x, segments, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, state)(x, segments)[0])

        with use_mesh(mesh, config.mesh.rules):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x, segments).compile()
        reports.append((hlo_text.collectives(compiled.as_text()), compiled.memory_analysis()))
    # T·K = 8 x 128 / 4 tokens x 2 experts = 512 rows of 128 float32 per device.
    assignments = 512 * d * 4
    for found, _ in reports:
        ragged = found["ragged-all-to-all"]
        assert ragged["ops"] == 4 and ragged["bytes"] == 4 * assignments  # out, back; backward
        assert found["all-to-all"]["ops"] == 0
    dropless, bounded = (m.temp_size_in_bytes for _, m in reports)
    assert bounded < dropless


@pytest.mark.slow
def test_fit_mesh_searches_the_expert_split_over_divisors_of_num_experts():
    # data=8 replicates the state: 18.5 MB at remat none (measured); data=4 x expert=2 splits
    # the 4 experts (wide ones: d_ff_expert 256) and shards the rest over expert: 15.2 MB.
    # expert=8 does not divide 4 experts: skipped without a compile. seq_len 99: tiling 1 only,
    # so each split is one compile (the tiling search is tests/test_compile.py's).
    wide = ["model.moe.d_ff_expert=256", "data.seq_len=99", "model.max_seq_len=99"]
    base = [str(MOE_TINY), *SMALL, *wide, "model.moe.num_experts=4", "mesh.data=8", "mesh.fsdp=1"]
    args = ["--devices", "8", "--fit", "--hbm-gb", "0.0165", "--fit-mesh", "data,expert"]
    proc = kiln_main("compile", *base, *args, "--json", cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    trials, best = found["trials"], found["best"]
    own = {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "tensor": 1, "sequence": 1}
    assert trials[0]["mesh"] == own and trials[0]["remat"] == "none" and not trials[0]["fits"]
    assert best["remat"] == "none" and best["mesh"] == {**own, "data": 4, "expert": 2}
    (skipped,) = found["skipped_splits"]
    assert skipped["mesh"]["expert"] == 8 and "model.moe.num_experts=4" in skipped["reason"]
    assert {t["mesh"]["expert"] for t in trials} == {1, 2}  # found before expert=4 was needed


# --- distillation and eval ----------------------------------------------------------------------

DOCS = 4
MODEL = {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64,
         "max_seq_len": 16}  # fmt: skip
MOE = {"family": "moe", "moe": {"num_experts": 4, "experts_per_token": 2, "d_ff_expert": 32,
                                "router_z_loss": 1e-3, "load_balance_loss": 1e-2}}  # fmt: skip


def raw_config(tmp, name, model, **sections):
    """Byte-level text of DOCS documents, one held out; 2 steps of 8 x 16 tokens on 8 devices."""
    raw = {
        "model": model,
        "data": {"source": "text", "paths": [str(tmp / "docs" / "*.txt")], "seq_len": 16,
                 "eval_fraction": 1 / DOCS, "cache_dir": str(tmp / "cache")},
        "mesh": {"fsdp": -1, "expert": 2},
        "optim": {"learning_rate": 3e-3, "schedule": "constant"},
        "checkpoint": {"async_save": False},
        "train": {"output_dir": str(tmp / "runs"), "run_name": name, "steps": 2,
                  "global_batch_size": 8, "log_every_steps": 1, "eval_every_steps": 2,
                  "eval_batches": 1, "compilation_cache_dir": str(tmp / "jax_cache")},
    }  # fmt: skip
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return raw


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """(tmp, MoE run trained 2 steps with mesh.expert=2, dense run of one saved checkpoint);
    one layer each: what the commands do with a family is the same for every layer."""
    tmp = tmp_path_factory.mktemp("moe-commands")
    (tmp / "docs").mkdir()
    rng = np.random.default_rng(0)
    words = ["kiln", "fires", "clay", "at", "high", "heat", "glaze", "pot"]
    for i in range(DOCS):  # 120 bytes: 8 windows of 16 targets, one eval batch
        text = " ".join(rng.choice(words, 40))[:119] + "\n"
        (tmp / "docs" / f"doc{i}.txt").write_text(text)
    run(make_config(raw_config(tmp, "moe", {**MODEL, **MOE})))
    dense = make_config(raw_config(tmp, "dense", MODEL))
    state = train.init_state(dense)
    checkpoints = Checkpointer(dense.run_dir, dense.checkpoint)
    checkpoints.save(2, checkpoint_tree(state), {})
    checkpoints.close()
    (dense.run_dir / "config.yaml").write_text(dense.to_yaml())
    return tmp, tmp / "runs" / "moe", dense.run_dir


def metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def student(tmp, name, model, **distillation):
    """A student config file: alpha 0.5, balance none, no feature pairs."""
    dist = {"alpha": 0.5, "temperature": 2.0, "balance": "none", **distillation}
    raw = raw_config(tmp, name, model, distillation=dist, train={"eval_every_steps": 0})
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_kiln_eval_of_a_moe_run_is_its_held_out_loss(teachers, tmp_path):
    tmp, moe_run, _ = teachers
    logged = next(r for r in metrics(moe_run) if "eval/loss" in r)
    held_out = tmp / "docs" / f"doc{split_documents(DOCS, 1 / DOCS)[1][0]}.txt"
    out = tmp_path / "eval.json"
    proc = kiln_main("eval", moe_run, f"perplexity:{held_out}", "--out", out)
    assert proc.returncode == 0, proc.stderr
    task = json.loads(out.read_text())["tasks"][held_out.stem]
    assert task["perplexity"] == pytest.approx(logged["eval/perplexity"], rel=F32)
    # The router's terms are part of the training loss, not of the held-out cross-entropy.
    cross_entropy = logged["eval/loss"] - logged["eval/z_loss"]
    assert task["loss"] == pytest.approx(cross_entropy, rel=F32)


def test_online_distillation_from_a_moe_teacher_into_a_dense_student(teachers):
    tmp, moe_run, _ = teachers
    path = student(tmp, "moe-to-dense", {**MODEL, "d_model": 16}, teacher_run_dir=str(moe_run))
    proc = kiln_main("distill", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = [r for r in metrics(tmp / "runs" / "moe-to-dense") if "learning/loss" in r][-1]
    assert last["step"] == 2 and last["distill/teacher_loss"] > 0
    assert not any(k.startswith(("moe/", "learning/router")) for k in last)  # the teacher's
    hard, soft = last["distill/hard_loss"], last["distill/soft_loss"]
    # float32 arithmetic on both sides: 1e-6 relative.
    assert last["learning/loss"] == pytest.approx(0.5 * hard + 0.5 * soft, rel=1e-6)
    # The summary names the objective and the train cross-entropy apart.
    out = proc.stdout[proc.stdout.index("run complete") :]
    assert f"train objective  {last['learning/loss']:.4f} " in out
    assert f"train hard loss  {hard:.4f} " in out and "train loss" not in out


def assert_router_losses_join_the_total(record):
    """balance none: total = (1 - alpha) hard + alpha soft + the student's router terms."""
    router = record["learning/router_z_loss"] + record["learning/moe_lb_loss"]
    assert record["learning/router_z_loss"] > 0 and record["learning/moe_lb_loss"] > 0
    want = 0.5 * record["distill/hard_loss"] + 0.5 * record["distill/soft_loss"] + router
    # float32 arithmetic on both sides: 1e-6 relative.
    assert record["learning/loss"] == pytest.approx(want, rel=1e-6)
    assert record["distill/total_loss"] == record["learning/loss"]
    assert record["moe/expert_load_max_over_mean"] >= 1


@pytest.mark.slow
def test_online_distillation_from_a_dense_teacher_into_a_moe_student(teachers):
    tmp, _, dense_run = teachers
    path = student(tmp, "dense-to-moe", {**MODEL, **MOE}, teacher_run_dir=str(dense_run))
    proc = kiln_main("distill", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [r for r in metrics(tmp / "runs" / "dense-to-moe") if "learning/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert_router_losses_join_the_total(record)
    # Each step line shows the router terms and the expert balance the step logged.
    lines = [s for s in proc.stdout.splitlines() if s.startswith("step ") and " loss " in s]
    assert len(lines) == len(records)
    for line, record in zip(lines, records):
        assert f"router_z {record['learning/router_z_loss']:.4f}" in line, line
        assert f"lb_loss {record['learning/moe_lb_loss']:.4f}" in line, line
        assert f"load_max/mean {record['moe/expert_load_max_over_mean']:.2f}" in line, line


@pytest.mark.slow
def test_offline_distillation_from_a_moe_teachers_logits_into_both_families(teachers):
    tmp, moe_run, _ = teachers
    store = tmp / "moe-top8"
    config = student(tmp, "offline-dense", {**MODEL, "d_model": 16}, teacher_run_dir=str(moe_run))
    proc = kiln_main("teacher-logits", config, "--out", store, "--top-k", 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"teacher {moe_run} step 2" in proc.stdout
    for name, model in (
        ("offline-dense", {**MODEL, "d_model": 16}),
        ("offline-moe", {**MODEL, **MOE}),
    ):
        path = student(tmp, name, model, teacher_logits_dir=str(store))
        proc = kiln_main("distill", path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [r for r in metrics(tmp / "runs" / name) if "learning/loss" in r]
        assert [r["step"] for r in records] == [1, 2]
        assert 0 < records[-1]["distill/teacher_top_k_hit"] <= 1
    assert_router_losses_join_the_total(records[-1])


def test_distillation_from_a_moe_teacher_counts_its_active_flops(teachers):
    """perf/mfu of `kiln distill` (and `kiln compile`'s FLOPs): the student's training FLOPs
    plus the teacher's forward pass, a third of its training FLOPs, from active parameters."""
    tmp, moe_run, _ = teachers
    config = load_config(student(tmp, "flops", MODEL, teacher_run_dir=str(moe_run)))
    objective, _ = abstract_distillation(config, make_mesh(config))
    d, layers, vocab, seq, e, k, f = 32, 1, 384, 16, 4, 2, 32
    attention = 6 * layers * seq * 4 * 8  # 6 L S N H, heads of 8
    dense = layers * (4 * d * d + 3 * d * 64) + d * vocab
    moe = layers * (4 * d * d + d * e + k * 3 * d * f) + d * vocab
    want = (6 * dense + attention) + (6 * moe + attention) / 3
    assert objective.flops_per_token() == pytest.approx(want, rel=1e-12)  # integers, reordered


def test_a_section_of_a_family_the_config_does_not_use_is_refused():
    """`model.moe` on a llama model would be silently ignored: it is refused in one line."""
    proc = kiln_main("config", "configs/tiny.yaml", "model.moe.num_experts=4", cwd=REPO)
    assert_user_error(proc, "model.moe is set but model.family is llama", "model.family: moe")
