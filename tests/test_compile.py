"""`kiln compile`: the AOT-compiled step is the one `kiln train` runs; bad input; --fit; summary."""

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path

import jax
import pytest

from conftest import assert_user_error, kiln_main
from kiln.cli import main
from kiln.commands import buffers
from kiln.commands import compile as aot
from kiln.commands import hlo as hlo_text
from kiln.commands.fit import remat_policies
from kiln.config import load_config
from kiln.training import pretrain, runner
from kiln.training.objective import LMObjective

ROOT = Path(__file__).resolve().parents[1]
LLAMA_1B = ROOT / "configs/models/llama3-1b.yaml"
# The 1B config with 4 layers and small widths and batch, so that `kiln train` can build it.
SMALL_1B = [
    "model.num_layers=4",
    "model.d_model=256",
    "model.d_ff=1024",
    "model.vocab_size=2048",
    "data.seq_len=256",
    "train.global_batch_size=16",
    "train.gradient_accumulation_steps=2",
]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.fixture(scope="module")
def small_1b_report():
    config = load_config(LLAMA_1B, SMALL_1B)
    return config, aot.compile_report(config, aot.use_cpu_devices(8))


def test_compile_reports_the_memory_of_the_step_kiln_train_runs(
    small_1b_report, tmp_path, monkeypatch
):
    config, report = small_1b_report
    captured = {}

    def compile_first_step(loop, state):
        # What `kiln train` is about to run: its step function on its state and first batch.
        batch = loop.place(next(loop.batches))
        captured["stats"] = loop.step_fn.lower(state, batch).compile().memory_analysis()
        return state

    monkeypatch.setattr(runner.Loop, "run", compile_first_step)
    pretrain.run(load_config(LLAMA_1B, [*SMALL_1B, f"train.output_dir={tmp_path}"]))
    memory, _ = aot.memory_figures(captured["stats"], "cpu")
    # Exact: the same program, lowered from abstract rather than real arrays.
    assert report.memory == memory
    assert report.command == "kiln train" and report.devices == 8
    assert report.mesh == {
        "stage": 1,
        "data": 1,
        "fsdp": 8,
        "expert": 1,
        "tensor": 1,
        "sequence": 1,
    }
    assert memory["peak"] == (
        memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"]
    )
    tokens = config.train.global_batch_size * config.data.seq_len
    want = LMObjective(config=config, mesh=None).flops_per_token() * tokens
    assert report.flops["kiln_per_step"] == want
    # fsdp gathers parameters and scatters gradients.
    assert report.collectives["all-gather"]["ops"] > 0


def test_peak_over_the_budget_prints_the_report_and_exits_1(small_1b_report, capsys):
    _, report = small_1b_report
    budget = report.memory["peak"] / 1e9 * 0.99
    args = ["compile", str(LLAMA_1B), *SMALL_1B, "--devices", "8", f"--hbm-gb={budget}", "--json"]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 1
    got = json.loads(out)
    assert (got["memory"], got["collectives"]) == (report.memory, report.collectives)
    assert got["flops"] == report.flops
    err = err.strip().splitlines()
    assert len(err) == 1 and "exceeds --hbm-gb" in err[0] and "--fit" in err[0]
    assert report.fits(report.memory["peak"] / 1e9) and not report.fits(budget)
    text = aot.format_report(report, "c.yaml")
    assert re.search(rf"peak +{report.memory['peak'] / 1e9:.3f} GB", text)
    assert "all-gather" in text and "counts a scan body once" in text
    # XLA:CPU gives every loop's trip count: exact per-step figures, no lower bound in the JSON.
    assert report.collectives_per_step_at_least is None
    assert "collectives_per_step_at_least" not in got and ">=" not in text
    # As the TPU compiler's HLO reads (no trip counts): the bound printed, said to be one.
    unknown = {**report.collectives["all-gather"], "ops_per_step": None, "bytes_per_step": None}
    tpu_like = dataclasses.replace(
        report,
        collectives={"all-gather": unknown},
        collectives_per_step_at_least={"all-gather": dict(ops_per_step=7, bytes_per_step=2e9)},
    )
    line = aot.format_report(tpu_like, "c.yaml").splitlines()[-1]
    assert re.search(r"per step >= +7 ops +2\.000 GB +\(loops of unknown trip count", line), line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--devices", "0"], "--devices"),
        (["--hbm-gb", "0"], "--hbm-gb"),
        (["--hbm-gb", "-3"], "--hbm-gb"),
        (["--topology", "v9z-8"], "v5p-N"),
        (["--topology", "v5p-12"], "v5p-N"),
        (["--fit"], "--hbm-gb"),
        (["--devices", "8", "--topology", "v5p-8"], "not both"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle):
    assert_user_error(kiln_main("compile", "configs/tiny.yaml", *args, cwd=ROOT), needle)


def test_more_devices_than_the_started_backend_is_refused(capsys):
    assert len(jax.devices()) == 8  # the backend started (whichever test ran first here)
    assert main(["compile", "configs/tiny.yaml", "--devices", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already started with 8" in err[0]


def test_topology_without_libtpu_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
    )
    assert main(["compile", "configs/tiny.yaml", "--topology", "v5p-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kiln[tpu]" in err[0]


def test_tpu_slices_resolve_like_their_published_shapes():
    # Slice shapes as Cloud TPU documents them (v5p/v4: TensorCores, 2 per chip).
    cases = {
        "v5p-8": ("v5:2x2x1", "megacore", (False, False, False)),
        "v5p-16": ("v5:2x2x2", "megacore", (False, False, False)),
        "v5p-64": ("v5:2x4x4", "megacore", (False, False, False)),
        "v5p-128": ("v5:4x4x4", "megacore", (True, True, True)),
        "v4-32": ("v4:2x2x4", "megacore", (False, False, False)),
        "v5e-16": ("v5e:4x4", "default", (False, False, False)),
        "v6e-8": ("v6e:2x4", "default", (False, False, False)),
        "v6e-128": ("v6e:8x16", "default", (False, True, False)),
    }
    for name, (topology, chip, wrap) in cases.items():
        got = aot.tpu_topology(name)
        assert (got["topology_name"], got["chip_config_name"], got["wrap"]) == (
            topology,
            chip,
            wrap,
        )


def test_collectives_are_counted_by_kind_with_result_bytes():
    hlo = """
  %all-gather.1 = bf16[512,512]{1,0:T(8,128)(2,1)} all-gather(%param), channel_id=2, dimensions={0}
  %all-reduce.3 = (f32[4,8]{1,0}, bf16[16]{0}) all-reduce(%a, %b), to_apply=%add
  %all-gather-start = (bf16[8]{0}, bf16[64]{0}) all-gather-start(%x), dimensions={0}
  %all-gather-done = bf16[64]{0} all-gather-done(%all-gather-start)
  ROOT %reduce-scatter.2 = f32[128]{0} reduce-scatter(%y), dimensions={0}
  %collective-permute-done = s32[2,2]{1,0} collective-permute-done(%cp)
  %fusion = f32[2]{0} fusion(%all-reduce.3), calls=%fused, metadata={op_name="jit(f)/all-gather"}
"""
    got = hlo_text.collectives(hlo)

    def static(ops, nbytes):
        """No loop in this module: each op runs once per step."""
        return dict(ops=ops, bytes=nbytes, ops_per_step=ops, bytes_per_step=nbytes)

    assert got["all-gather"] == static(2, 512 * 512 * 2 + 64 * 2)
    assert got["all-reduce"] == static(1, 4 * 8 * 4 + 16 * 2)
    assert got["reduce-scatter"] == static(1, 128 * 4)
    assert got["collective-permute"] == static(1, 2 * 2 * 4)
    assert got["all-to-all"] == static(0, 0)


def test_collectives_over_groups_of_one_device_are_not_counted():
    """A reduction over a mesh axis of size 1 stays in XLA:CPU's program and exchanges nothing.

    In the 8B step's HLO (fsdp=8, tensor=1) the tiled loss's pmax/psum over `tensor`, inside
    the accumulation, chunk and key loops, were 262,144 of its 264,323 all-reduces per step.
    """
    hlo = """
  %all-reduce.1 = f32[2]{0} all-reduce(%a), replica_groups={{0},{1},{2},{3}}, to_apply=%max
  %all-reduce.2 = f32[8]{0} all-reduce(%b), replica_groups={{0,1},{2,3}}, to_apply=%add
  %all-reduce.3 = f32[4]{0} all-reduce(%c), replica_groups=[4,1]<=[4], to_apply=%add
  %all-reduce.4 = f32[16]{0} all-reduce(%d), replica_groups=[1,4]<=[4], to_apply=%add
  %all-gather.5 = f32[64]{0} all-gather(%e), replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_1'}, dimensions={0}
  %all-gather.6 = f32[32]{0} all-gather(%f), replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={0}
  %all-reduce.7 = f32[1]{0} all-reduce(%g), replica_groups={}, to_apply=%add
  %all-gather-start = (f32[8]{0}, f32[128]{0}) all-gather-start(%h), replica_groups={{0},{1},{2},{3}}, dimensions={0}
  %all-gather-done = f32[128]{0} all-gather-done(%all-gather-start)
  %all-gather-start.1 = (f32[8]{0}, f32[256]{0}) all-gather-start(%i), replica_groups=[1,4]<=[4], dimensions={0}
  %all-gather-done.1 = f32[256]{0} all-gather-done(%all-gather-start.1)
"""
    assert [hlo_text.group_size(line) for line in hlo.strip().splitlines()] == [
        *(1, 2, 1, 4, 1, 4, None, 1, None, 4, None)
    ]
    got = hlo_text.collectives(hlo)
    # all-reduce.2, .4 and .7 (all devices); all-gather.6 and the second async gather.
    assert (got["all-reduce"]["ops"], got["all-reduce"]["bytes"]) == (3, 8 * 4 + 16 * 4 + 4)
    assert (got["all-gather"]["ops"], got["all-gather"]["bytes"]) == (2, 32 * 4 + 256 * 4)


LOOPS = """
%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %all-reduce.1 = f32[8]{0} all-reduce(%x), to_apply=%add
}

%outer_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %all-gather.2 = f32[16]{0} all-gather(%x), dimensions={0}
  %while.1 = (s32[], f32[8]) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %while.2 = (s32[], f32[8]) while(%t), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %all-reduce.3 = f32[2]{0} all-reduce(%y), to_apply=%add
}
"""
# A loop whose trip count the HLO does not give (the TPU compiler's), around inner_body too.
UNKNOWN_LOOP = "  %while.3 = (s32[], f32[8]) while(%t), condition=%c, body=%inner_body\n}"


def test_collectives_per_step_multiply_the_trip_counts_of_the_loops_around_them():
    # inner_body runs 4 times per run of outer_body, which runs 3 times.
    assert hlo_text.collective_ops(LOOPS) == [
        ("all-reduce", "f32[8]{0}", 12),
        ("all-gather", "f32[16]{0}", 3),
        ("all-reduce", "f32[2]{0}", 1),
    ]
    got = hlo_text.collectives(LOOPS)
    assert got["all-reduce"] == dict(ops=2, bytes=40, ops_per_step=13, bytes_per_step=12 * 32 + 8)
    assert got["all-gather"] == dict(ops=1, bytes=64, ops_per_step=3, bytes_per_step=3 * 64)
    # inner_body also called by a loop of unknown length: its runs per step are unknown.
    unknown = LOOPS.rstrip().removesuffix("}") + UNKNOWN_LOOP
    got = hlo_text.collectives(unknown)
    assert (got["all-reduce"]["ops_per_step"], got["all-gather"]["ops_per_step"]) == (None, 3)
    # The lower bound counts that loop once: inner_body 12 + 1 times, all-reduce.3 once.
    at_least = hlo_text.collective_summary(unknown)[1]
    assert at_least["all-reduce"] == dict(ops_per_step=14, bytes_per_step=13 * 32 + 8)
    assert at_least["all-gather"] == dict(ops_per_step=3, bytes_per_step=3 * 64)
    assert hlo_text.collective_summary(LOOPS)[1] is None  # every count known: no bound needed


# The TPU compiler's loop, without known_trip_count, as it prints it (layouts, a copy around
# the counter; the operand tuple's `/*index=N*/` comments): i from 1 while i < 7, i += 2.
COUNTED_LOOP = """
%cond (wide.param.1: (s32[], f32[8])) -> pred[] {
  %constant.1 = s32[]{:T(128)} constant(7)
  %wide.param.1 = (s32[]{:T(128)}, f32[8]{0:T(256)}) parameter(0)
  %get-tuple-element.1 = s32[]{:T(128)} get-tuple-element(%wide.param.1), index=0
  ROOT %lt.1 = pred[]{:T(512)} compare(%get-tuple-element.1, %constant.1), direction=LT, metadata={op_name="jit(step)/while/cond/lt"}
}

%body (wide.param.0: (s32[], f32[8])) -> (s32[], f32[8]) {
  %wide.param.0 = (s32[]{:T(128)}, f32[8]{0:T(256)}) parameter(0)
  %get-tuple-element.2 = s32[]{:T(128)} get-tuple-element(%wide.param.0), index=0
  %copy.1 = s32[]{:T(128)S(6)} copy(%get-tuple-element.2)
  %constant.2 = s32[]{:T(128)} constant(2)
  %add.1 = s32[]{:T(128)} add(%copy.1, %constant.2), metadata={op_name="jit(step)/while/body/add"}
  %get-tuple-element.3 = f32[8]{0:T(256)} get-tuple-element(%wide.param.0), index=1
  %all-reduce.1 = f32[8]{0:T(256)} all-reduce(%get-tuple-element.3), to_apply=%add
  ROOT %tuple.1 = (s32[]{:T(128)}, f32[8]{0:T(256)}) tuple(%add.1, %all-reduce.1)
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0:T(256)} parameter(0)
  %constant.3 = s32[]{:T(128)} constant(1)
  %copy.2 = s32[]{:T(128)} copy(%constant.3)
  %tuple.2 = (s32[]{:T(128)}, f32[8]{0:T(256)}) tuple(%copy.2, /*index=1*/%p)
  %while.1 = (s32[]{:T(128)}, f32[8]{0:T(256)}) while(%tuple.2), condition=%cond, body=%body
}
"""


def test_trip_counts_the_hlo_states_without_known_trip_count_are_derived():
    # i = 1, 3, 5: 3 runs of the body.
    assert hlo_text.derived_trip_counts(COUNTED_LOOP) == {("main", "while.1"): 3}
    got = hlo_text.collectives(COUNTED_LOOP)["all-reduce"]
    assert got == dict(ops=1, bytes=32, ops_per_step=3, bytes_per_step=3 * 32)
    assert hlo_text.collective_summary(COUNTED_LOOP)[1] is None
    # Any other form stays unknown: a limit that is not a constant, a step from another
    # element, an init not constant, a condition that is not a compare of the counter.
    for old, new in [
        ("compare(%get-tuple-element.1, %constant.1)", "compare(%get-tuple-element.1, %p)"),
        ("add(%copy.1, %constant.2)", "add(%get-tuple-element.3, %constant.2)"),
        ("tuple(%copy.2, /*index=1*/%p)", "tuple(%p, /*index=1*/%p)"),
        ("direction=LT", "direction=EQ"),
        ("ROOT %lt.1 = pred[]{:T(512)} compare", "ROOT %lt.1 = pred[]{:T(512)} fusion"),
    ]:
        other = COUNTED_LOOP.replace(old, new)
        assert other != COUNTED_LOOP and hlo_text.derived_trip_counts(other) == {}, old
        assert hlo_text.collectives(other)["all-reduce"]["ops_per_step"] is None
    # The count of `for (i = start; i <direction> limit; i += step)`, None where it never ends.
    cases = [
        ((1, 7, 2, "LT"), 3),
        ((0, 7, 2, "LE"), 4),
        ((0, 6, 2, "LE"), 4),
        ((7, 0, 1, "LT"), 0),
        ((5, 0, -1, "GT"), 5),
        ((5, 0, -2, "GE"), 3),
        ((0, 6, 3, "NE"), 2),
        ((0, 0, 1, "NE"), 0),
        ((0, 5, 3, "NE"), None),
        ((0, 2, 0, "LT"), None),
        ((0, 2, -1, "LT"), None),
        ((2, 0, 1, "GT"), None),
        ((0, 2, 1, "EQ"), None),
    ]
    assert [hlo_text.loop_trips(*args) for args, _ in cases] == [want for _, want in cases]


def test_tpu_all_reduce_scatter_fusions_count_as_reduce_scatters():
    hlo = """
%all-reduce-scatter.1 (input.5: f32[2,64,128]) -> f32[2,32,128] {
  %all-reduce.9 = f32[2,64,128]{2,1,0:T(8,128)} all-reduce(%input.5), to_apply=%add
  ROOT %dynamic-slice.2 = f32[2,32,128]{2,1,0} dynamic-slice(%all-reduce.9, %c, %o, %c)
}

ENTRY %main.1 (p: f32[2,64,128]) -> f32[2,64,128] {
  %all-reduce.3 = f32[2,64,128]{2,1,0} all-reduce(%p), to_apply=%add
  %fusion.1 = f32[2,32,128]{2,1,0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter.1
}
"""
    got = hlo_text.collectives(hlo)
    assert got["reduce-scatter"] == dict(
        ops=1, bytes=2 * 32 * 128 * 4, ops_per_step=1, bytes_per_step=2 * 32 * 128 * 4
    )
    assert got["all-reduce"] == dict(
        ops=1, bytes=2 * 64 * 128 * 4, ops_per_step=1, bytes_per_step=2 * 64 * 128 * 4
    )


# A model whose [micro-batch rows per fsdp shard, seq, d_model] activation is [2, 64, 128].
TENSOR_PARALLEL = [
    *("model.num_layers=2", "model.d_model=128", "model.d_ff=256", "model.vocab_size=512"),
    *("model.num_heads=4", "model.num_kv_heads=2", "model.attention=xla", "data.seq_len=64"),
    *("train.global_batch_size=8", "mesh.fsdp=4", "mesh.tensor=2"),
]


def full_activation_all_reduces(hlo: str, dims: str) -> int:
    """All-reduced arrays of shape `dims` that are not the inside of a reduce-scatter fusion."""
    return sum(
        d == dims
        for scope, kind, result in hlo_text.collective_instructions(hlo)
        if kind == "all-reduce" and not (scope or "").startswith("all-reduce-scatter")
        for _, d in hlo_text.arrays(result)
    )


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu (the kiln[tpu] extra) is not installed")
def test_tensor_parallel_residual_stream_is_reduce_scattered_not_all_reduced():
    """Sequence parallelism: the sub-layers' partial sums over tensor are reduce-scattered.

    XLA:CPU has no pass that turns the partitioner's all-reduce + dynamic-slice into a
    reduce-scatter (TPU and GPU do), so this compiles for a TPU slice of 8 chips.
    """
    devices = aot.topology_devices("v5e-8")
    config = load_config(ROOT / "configs/tiny.yaml", TENSOR_PARALLEL)
    hlo = aot.lower_step(config, devices)[0].compile().as_text()
    assert full_activation_all_reduces(hlo, "2,64,128") == 0
    assert hlo_text.collectives(hlo)["reduce-scatter"]["ops"] > 0
    # The layer scan's 2 trips forward and back, read from the loops' HLO (XLA:CPU's counts).
    assert sorted(hlo_text.derived_trip_counts(hlo).values()) == [2, 2]
    # The rule before sequence parallelism: the residual replicated over tensor, so every
    # projection back to d_model all-reduces the full activation.
    old = load_config(
        ROOT / "configs/tiny.yaml", [*TENSOR_PARALLEL, "mesh.rules.act_length=[sequence]"]
    )
    hlo = aot.lower_step(old, devices)[0].compile().as_text()
    assert full_activation_all_reduces(hlo, "2,64,128") >= 4


# 2 layers, K=2 key/value heads of 16, one sequence per (fsdp, sequence) device pair.
SEQUENCE_PARALLEL = [
    *("model.num_layers=2", "model.d_model=64", "model.d_ff=128", "model.vocab_size=256"),
    *("model.num_heads=4", "model.num_kv_heads=2", "model.attention=xla"),
    *("train.global_batch_size=4", "mesh.fsdp=4", "mesh.sequence=2"),
]


def test_sequence_parallel_attention_sums_key_value_gradients_once_per_layer():
    """mesh.sequence=2: dK/dV summed over the shards once per layer, not per query block.

    Seq 1024 and 2048 run 2 and 4 query blocks of 512 rows (8 and 16 key tiles of 128 per
    device); every collective runs as often per step at both lengths.
    """
    devices = aot.use_cpu_devices(8)
    per_step = {}
    for s in (1024, 2048):
        overrides = [*SEQUENCE_PARALLEL, f"data.seq_len={s}", f"model.max_seq_len={s}"]
        config = load_config(ROOT / "configs/tiny.yaml", overrides)
        hlo = aot.lower_step(config, devices)[0].compile().as_text()
        ops = hlo_text.collective_ops(hlo)
        # The whole dK or dV of one device: [1 row, S/128 tiles, 128, K=2, H=16].
        key_tiles = f"1,{s // 128},128,2,16"
        summed = [
            runs * sum(dims == key_tiles for _, dims in hlo_text.arrays(result))
            for kind, result, runs in ops
            if kind in ("all-reduce", "reduce-scatter")
        ]
        assert sum(summed) == 2 * 2  # dK and dV, once in each of the 2 layers
        per_step[s] = {k: c["ops_per_step"] for k, c in hlo_text.collectives(hlo).items()}
    assert per_step[1024] == per_step[2048]


def test_config_summary_reports_the_compiled_activations(small_1b_report, capsys):
    _, report = small_1b_report
    budget = report.memory["peak"] / 1e9 * 1.5
    args = ["config", str(LLAMA_1B), *SMALL_1B, "--summary", "--devices", "8"]
    assert main([*args, "--hbm-gb", str(budget)]) == 0
    out = capsys.readouterr().out
    assert "fsdp=8" in out and "(state, before activations)" in out
    temps = report.memory["temporaries"] / 1e9
    assert f"activations and temporaries {temps:.2f} GB" in out
    assert f"fits:              yes, peak {report.memory['peak'] / 1e9:.2f} GB" in out
    assert "fits:              NO" in aot.summary_lines(report, budget / 2)
    assert_user_error(
        kiln_main("config", "configs/tiny.yaml", "--hbm-gb", "8", cwd=ROOT), "--summary"
    )


def test_distillation_configs_compile_the_distill_step_with_the_teacher_abstract(tmp_path):
    import math

    import jax

    from kiln.distill.teacher import abstract_teacher
    from kiln.parallel.mesh import make_mesh

    teacher_dir = tmp_path / "teacher"
    teacher_dir.mkdir()  # its config.yaml only: compiling reads no checkpoint
    (teacher_dir / "config.yaml").write_text(load_config(ROOT / "configs/tiny.yaml").to_yaml())
    student = ["distillation.layer_map=[]", "train.global_batch_size=16"]
    devices = aot.use_cpu_devices(8)
    distill = load_config(
        ROOT / "configs/distill_tiny.yaml",
        [*student, f"distillation.teacher_run_dir={teacher_dir}"],
    )
    plain = load_config(
        ROOT / "configs/distill_tiny.yaml", [*student, "distillation.teacher_run_dir=null"]
    )
    got, alone = aot.compile_report(distill, devices), aot.compile_report(plain, devices)
    assert (got.command, alone.command) == ("kiln distill", "kiln train")
    # The teacher's parameters are arguments of the step: its shards on one device, exactly.
    teacher_cfg = load_config(ROOT / "configs/tiny.yaml")
    teacher = abstract_teacher(distill, make_mesh(distill, devices), teacher_cfg, teacher_dir, -1)
    per_device = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(teacher.params)
    )
    assert got.memory["arguments"] - alone.memory["arguments"] == per_device


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu (the kiln[tpu] extra) is not installed")
def test_topology_compiles_with_the_tpu_compiler():
    # The tiny model with 2 layers and bf16 compute, 2 sequences per chip.
    settings = ["model.num_layers=2", "model.dtype=bfloat16", "train.global_batch_size=8"]
    config = load_config(ROOT / "configs/tiny.yaml", settings)
    cpu = aot.compile_report(config, aot.use_cpu_devices(8))
    # `model.attention: auto` is the splash kernel on TPU; Mosaic refuses its bf16 matmuls
    # under the suite's process-wide "highest" matmul precision (conftest), which no run sets.
    with jax.default_matmul_precision("default"):
        report = aot.compile_report(config, aot.topology_devices("v5p-8"))
    assert report.platform == "tpu" and report.devices == 4  # 4 chips, one device per chip
    assert report.peak_source == "the compiler's peak_memory_in_bytes"
    assert report.memory["peak"] > report.memory["arguments"] > 0
    assert report.memory != cpu.memory


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu (the kiln[tpu] extra) is not installed")
def test_a_step_the_tpu_compiler_refuses_for_memory_is_one_line_and_does_not_fit():
    # d_ff 262144: 19.5 GB of temporaries per chip (the compiler's count) for 15.75 GB of HBM.
    big = [
        *("configs/tiny.yaml", "model.num_layers=2", "model.d_model=4096", "model.num_heads=32"),
        *("model.d_ff=262144", "model.attention=xla", "data.seq_len=64"),
        *("train.global_batch_size=8", "--topology", "v5e-8"),
    ]
    proc = kiln_main("compile", *big, cwd=ROOT)
    assert_user_error(proc, "RESOURCE_EXHAUSTED", "exceeds available HBM", "--fit", code=1)
    proc = kiln_main("compile", *big, "--fit", "--hbm-gb", "16", "--json", cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    trials = json.loads(proc.stdout)["trials"]
    assert [t["remat"] for t in trials] == remat_policies()  # each refused, the search went on
    assert all(t["peak_bytes"] is None and not t["fits"] for t in trials)


@pytest.mark.slow
def test_fit_finds_settings_that_compile_under_the_budget():
    # 20 MB: the step without remat needs 29 MB at accumulation 1 (measured), 16 MB at 2. An
    # odd seq_len leaves few tilings (powers of two dividing a shard's tokens) to search: 4
    # compiles in all.
    base = [
        *("configs/tiny.yaml", "train.global_batch_size=32", "data.seq_len=127"),
        "model.num_layers=2",
    ]
    budget = 0.02
    proc = kiln_main(
        "compile", *base, "--devices", "8", "--fit", "--hbm-gb", budget, "--json", cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    overrides = found["overrides"].split()
    assert re.fullmatch(r"model\.remat=\w+", overrides[0]), overrides
    trials, best = found["trials"], found["best"]
    assert f"model.remat={best['remat']} " in found["overrides"]
    # Least recompute: every setting with less accumulation at that remat was compiled too big.
    smaller = [
        t
        for t in trials
        if t["remat"] == best["remat"]
        and t["gradient_accumulation_steps"] < best["gradient_accumulation_steps"]
    ]
    assert smaller and not any(t["fits"] for t in smaller)
    # ... and every policy with less recompute did not fit at all.
    less = remat_policies()[: remat_policies().index(best["remat"])]
    assert all(not t["fits"] for t in trials if t["remat"] in less)
    # The printed overrides, applied, compile under the budget.
    proc = kiln_main("compile", *base, *overrides, "--devices", "8", "--hbm-gb", budget, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--fit", "--hbm-gb", "1", "--fit-mesh", "fsdp,model"], "'model'"),
        (["--fit", "--hbm-gb", "1", "--fit-mesh", "fsdp,fsdp"], "twice"),
        (["--hbm-gb", "1", "--fit-mesh", "fsdp"], "only applies with --fit"),
    ],
)
def test_bad_fit_mesh_exits_2_with_one_line(args, needle, capsys):
    assert main(["compile", "configs/tiny.yaml", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kiln: error:") and needle in err[0], err


@pytest.mark.slow
def test_fit_mesh_finds_a_split_that_fits_where_the_configs_own_does_not():
    # data=8 replicates the state: 14 MB at remat none (measured); fsdp=8 shards it: 7 MB.
    # seq_len 100 leaves sequence=8 invalid (skipped without a compile), and sequence=4 too
    # under the default load balance (2 chunks per shard: a multiple of 8); tilings 1, 2, 4.
    base = [
        "configs/tiny.yaml",
        "train.global_batch_size=8",
        "model.num_layers=2",
        "data.seq_len=100",
        "mesh.data=8",
        "mesh.fsdp=1",
    ]
    budget = 0.01
    args = ["--devices", "8", "--fit", "--hbm-gb", budget, "--fit-mesh", "fsdp,data,sequence"]
    proc = kiln_main("compile", *base, *args, "--json", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    trials, best = found["trials"], found["best"]
    own = {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "tensor": 1, "sequence": 1}
    # The config's own split is probed first (least recompute, max accumulation) and misses.
    assert trials[0]["mesh"] == own and trials[0]["remat"] == "none" and not trials[0]["fits"]
    assert best["remat"] == "none" and best["mesh"] != own
    assert math.prod(best["mesh"].values()) == 8 and best["mesh"]["tensor"] == 1
    skipped = found["skipped_splits"]
    assert sorted({s["mesh"]["sequence"] for s in skipped}) == [4, 8]
    assert all("data.seq_len" in s["reason"] for s in skipped)
    overrides = found["overrides"].split()
    assert [o for o in overrides if o.startswith("mesh.")] == [
        f"mesh.{axis}={size}" for axis, size in best["mesh"].items()
    ]
    # The printed overrides, applied, compile under the budget.
    proc = kiln_main("compile", *base, *overrides, "--devices", "8", "--hbm-gb", budget, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


SHIPPED = sorted((ROOT / "configs/models").glob("*.yaml"))
TARGET = re.compile(
    r"^# Target: .*\n# .*kiln compile (\S+) --(devices|topology) (\S+) --hbm-gb ([\d.]+)", re.M
)


@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_model_configs_fit_the_hardware_they_name(path):
    """memory(L) = a + b L from 2 and 4 layers, extrapolated to the config's layer count.

    Not from 1 layer: XLA compiles a one-step scan without its loop, differently. A TPU
    target (`--topology`) is too slow to compile here: its full compile recorded in
    docs/figures.json (kept current by its canary, test_docs.py) must fit.
    """
    target = TARGET.search(path.read_text())
    assert target, f"{path.name}: no '# Target: ...' comment with its `kiln compile` check"
    assert ROOT / target.group(1) == path
    budget = float(target.group(4))
    if target.group(2) == "topology":
        command = f"kiln compile {target.group(1)} --topology {target.group(3)} --json"
        records = json.loads((ROOT / "docs/figures.json").read_text()).values()
        (record,) = [r for r in records if r["command"] == command]
        assert record["output"]["memory"]["peak"] <= budget * 1e9
        return
    devices = aot.use_cpu_devices(int(target.group(3)))
    model = load_config(path).model
    layers = model.num_layers

    def probe(n: int) -> list[str]:
        # A layer pattern longer than n is cut to its last n entries: Gemma 3's five
        # sliding_attention layers then one full_attention layer keep both kinds.
        types = model.layer_types or ()
        cut = [f"model.layer_types=[{','.join(types[-n:])}]"] if len(types) > n else []
        return [f"model.num_layers={n}", *cut]

    peak = {
        n: aot.compile_report(load_config(path, probe(n)), devices).memory["peak"] for n in (2, 4)
    }
    per_layer = (peak[4] - peak[2]) / 2
    assert per_layer > 0
    extrapolated = peak[2] + per_layer * (layers - 2)
    assert extrapolated <= budget * 1e9, (path.name, extrapolated / 1e9, budget)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu (the kiln[tpu] extra) is not installed")
def test_layer_weights_are_cast_to_the_compute_dtype_one_layer_at_a_time():
    """bf16 compute over float32 weights: no bf16 copy of a whole stack of weights.

    XLA moves a cast of each layer's weights out of the layer loop if it can, as one cast of
    the stack [L, ...] held through the step (3.5 GB per device on the 8B for v5p-8); only
    the saved residual stream [L, B, S, D] may be a bf16 array with the layers' axis.
    """
    devices = aot.topology_devices("v5p-8")
    settings = ["model.num_layers=6", "model.dtype=bfloat16", "model.remat=full"]
    settings += ["model.attention=xla", "mesh.fsdp=4", "train.global_batch_size=8"]
    config = load_config(ROOT / "configs/tiny.yaml", settings)
    hlo = aot.lower_step(config, devices)[0].compile().as_text()
    # 6 layers, 2 sequences of 128 per device, d_model 128.
    assert set(re.findall(r"bf16\[6,[\d,]+\]", hlo)) == {"bf16[6,2,128,128]"}


def reductions(hlo: str) -> list[tuple[str, str]]:
    """(dtype, dims) of every array summed across devices (all-reduce, reduce-scatter)."""
    return [
        array
        for _, kind, result in hlo_text.collective_instructions(hlo)
        if kind in ("all-reduce", "reduce-scatter")
        for array in hlo_text.arrays(result)
    ]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu (the kiln[tpu] extra) is not installed")
def test_grad_reduce_dtype_is_the_dtype_of_the_weight_gradient_reductions():
    """bf16 compute, fsdp=8: the blocks' weight gradients are summed in the chosen dtype.

    On TPU (XLA:CPU computes bf16 matmuls in float32, so its HLO shows f32 either way).
    """
    devices = aot.topology_devices("v5e-8")
    model = [o for o in TENSOR_PARALLEL if not o.startswith("mesh.")]
    model += ["mesh.fsdp=8", "model.dtype=bfloat16"]
    # wq, wk/wv, wo, w_gate/w_up, w_down of one layer (the scan body); the LM head.
    weights = {"128,4,32", "128,2,32", "4,32,128", "128,256", "256,128", "128,512"}
    for setting, dtype in (("compute", "bf16"), ("float32", "f32")):
        config = load_config(
            ROOT / "configs/tiny.yaml", [*model, f"train.grad_reduce_dtype={setting}"]
        )
        hlo = aot.lower_step(config, devices)[0].compile().as_text()
        summed = [(t, dims) for t, dims in reductions(hlo) if dims in weights]
        assert {dims for _, dims in summed} == weights
        assert {t for t, _ in summed} == {dtype}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu (the kiln[tpu] extra) is not installed")
def test_in_pipeline_stages_the_query_weight_is_gathered_once_for_both_backward_products():
    """2 stages x fsdp 4, whole layers recomputed, on the TPU compiler: each layer-iteration
    gathers the query weight twice, for its forward pass and for the backward pass's recompute,
    whose gathered weight the input gradient's product reuses. Left to XLA (before
    `Attention._weight`), the backward pass gathered it again for that product: 42 gathers
    a step here instead of 24."""
    model = [o for o in TENSOR_PARALLEL if not o.startswith(("mesh.", "model.num_layers"))]
    model += ["model.num_layers=4", "mesh.stage=2", "mesh.fsdp=4", "train.global_batch_size=16"]
    model += ["train.gradient_accumulation_steps=2", "model.dtype=bfloat16", "model.remat=full"]
    config = load_config(ROOT / "configs/tiny.yaml", model)
    with jax.default_matmul_precision(None):  # as `kiln compile` compiles it
        hlo = aot.lower_step(config, aot.topology_devices("v5e-8"))[0].compile().as_text()
    gathers = sum(
        runs
        for kind, result, runs in hlo_text.collective_ops(hlo)
        if kind == "all-gather" and re.match(r"bf16\[1,1,1,128,4,32\]", result)  # [D, N, H]
    )
    # 2 accumulation micro-batches x (2 micro-batches + 2 stages - 1) iterations x 2 layers
    assert gathers == 2 * (2 * 3 * 2)


def test_the_tiled_losss_head_gradient_is_summed_in_the_grad_reduce_dtype():
    """bf16 compute, fsdp=8, vocabulary tiling 2: the loss engine sums the LM head's gradient
    over the devices (a reduce-scatter to its fsdp shards) in the chosen dtype, as the step is
    lowered. The compiled TPU step can fold the rounding to bf16 into the reduction, so
    `reductions` of a compiled HLO shows bf16 for both."""
    model = [o for o in TENSOR_PARALLEL if not o.startswith("mesh.")]
    model += ["mesh.fsdp=8", "model.dtype=bfloat16", "loss.num_vocab_tiling=2"]
    for setting, dtype in (("compute", "bf16"), ("float32", "f32")):
        config = load_config(
            ROOT / "configs/tiny.yaml", [*model, f"train.grad_reduce_dtype={setting}"]
        )
        text = aot.lower_step(config, aot.use_cpu_devices(8))[0].as_text()
        scattered = re.findall(r"stablehlo\.reduce_scatter.*\n(?:.*\n)*?.*\}\) : (.*)", text)
        # [K=1, D, V] summed and scattered to [1, D, V / 8]
        assert scattered == [f"(tensor<1x128x512x{dtype}>) -> tensor<1x16x512x{dtype}>"]


@pytest.fixture(scope="module")
def tiny_peak_buffers():
    """configs/tiny.yaml on 8 CPU devices, with its 5 largest buffers at the peak."""
    config = load_config(ROOT / "configs/tiny.yaml")
    return config, aot.compile_report(config, aot.use_cpu_devices(8), peak_buffers=5)


def test_peak_buffers_are_the_largest_live_at_the_peak_with_their_jax_ops(tiny_peak_buffers):
    config, report = tiny_peak_buffers
    # The dump changes nothing the compiler does: the figures of a compile without it.
    plain = aot.compile_report(config, aot.use_cpu_devices(8))
    assert (report.memory, report.collectives) == (plain.memory, plain.collectives)
    assert plain.peak_buffers is None and "peak_buffers" not in plain.to_json()
    found = report.peak_buffers
    assert len(found) == 5
    sizes = [b.bytes for b in found]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] > 0
    m = report.memory
    assert sum(sizes) <= m["temporaries"] + m["arguments"] + m["outputs"]
    for b in found:
        [(dtype, dims)] = hlo_text.arrays(b.shape)
        assert b.shape == f"{dtype}[{dims}]"
        # float32 (configs/tiny.yaml's dtype): 4 bytes per element of the shape shown.
        assert dtype == "f32" and b.bytes == 4 * math.prod(int(d) for d in dims.split(","))
        assert b.op_name.startswith("jit(step)/") and b.instruction
        assert re.search(r"kiln/.+\.py:\d+$", b.source), b.source
    text = aot.format_report(report, "configs/tiny.yaml")
    assert "the 5 largest buffers live at the peak" in text
    assert found[0].op_name in text and found[0].shape in text


def test_peak_buffers_json_carries_them(tiny_peak_buffers, capsys):
    _, report = tiny_peak_buffers
    args = ["compile", "configs/tiny.yaml", "--devices", "8", "--peak-buffers", "3", "--json"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)["peak_buffers"]
    assert [b["bytes"] for b in got] == [b.bytes for b in report.peak_buffers[:3]]
    assert set(got[0]) == {"bytes", "shape", "instruction", "op_name", "source", "phi", "shared"}


def test_the_embedding_lookup_never_holds_the_whole_table():
    """The lookup and its gradient stay split along embed over fsdp: no [V, D] table or table
    gradient is among the largest buffers at the peak (before, the gradient's scatter-add into
    the whole table was, 4 MB at this size, the sixth largest)."""
    config = load_config(ROOT / "configs/tiny.yaml", ["model.vocab_size=8192"])
    report = aot.compile_report(config, aot.use_cpu_devices(8), peak_buffers=12)
    shapes = [b.shape for b in report.peak_buffers]
    # The separate LM head [D, V], gathered for the (untiled) loss, is there; 4 MB as well.
    assert "f32[128,8192]" in shapes
    assert "f32[8192,128]" not in shapes, shapes


def test_peak_buffers_count_one_slice_of_memory_once():
    """Values at the peak in one allocation slice (a bitcast over its operand) are one buffer."""
    values = [("a", 64), ("b{1}", 64), ("c", 32), ("d", 16)]
    slices = {
        "a": (3, 0, "f32[16]", False),
        "b{1}": (3, 0, "f32[4,4]", True),
        "c": (3, 64, "bf16[16]", False),
    }
    instructions = {"a": ("f32[16]", "jit(f)/mul", "f.py:3"), "d": ("s32[4]", "", "")}
    got = buffers.largest(values, slices, instructions, 3)
    assert [(b.instruction, b.bytes, b.shared, b.phi) for b in got] == [
        ("a", 64, 1, False),
        ("c", 32, 0, False),
        ("d", 16, 0, False),
    ]
    assert (got[0].op_name, got[0].source, got[2].shape) == ("jit(f)/mul", "f.py:3", "s32[4]")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--peak-buffers", "-1"], "--peak-buffers: got '-1'; allowed: an integer >= 0"),
        (["--peak-buffers", "x"], "--peak-buffers: got 'x'; allowed: an integer >= 0"),
        (["--peak-buffers", "3", "--fit", "--hbm-gb", "1"], "--peak-buffers 3: applies to one"),
    ],
)
def test_bad_peak_buffers_exit_2_with_one_line(args, needle):
    assert_user_error(kiln_main("compile", "configs/tiny.yaml", *args, cwd=ROOT), needle)


def test_kernel_bodies_are_fingerprinted_without_their_source_locations():
    """A Pallas kernel's serialized body names the file it came from (where JAX is installed):
    the fingerprint digests it without locations, so two checkouts of one commit agree, and a
    kernel that computes something else still changes it."""
    import base64
    import io

    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    def kernel(path: str, op: str = "arith.addf") -> str:
        asm = (
            "func.func @k(%a: f32) -> f32 {\n"
            f'  %b = {op} %a, %a : f32 loc("{path}":7:1)\n'
            f'  return %b : f32 loc("{path}":8:1)\n'
            "}"
        )
        with mlir.make_ir_context():
            buffer = io.BytesIO()
            ir.Module.parse(asm).operation.write_bytecode(buffer)
        body = base64.b64encode(buffer.getvalue()).decode()
        return f'custom_call @tpu_custom_call() {{backend_config = "{{\\22body\\22: \\22{body}\\22}}"}}'

    here = kernel("/work/.venv/lib/site-packages/jax/kernel.py")
    there = kernel("/tmp/clone/.venv/lib/site-packages/jax/kernel.py")
    assert here != there
    assert aot.without_paths(here) == aot.without_paths(there)
    assert aot.without_paths(kernel("/x.py", "arith.mulf")) != aot.without_paths(here)
