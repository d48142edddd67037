"""Bounds on what a command may be asked for: counts by what the machine holds, numbers by the
range they are used in, paths by what the filesystem allows. Each is refused before any work
with exit code 2 and one line naming the flag, field or path, and nothing is written.

One parametrised test per family; a row runs `kiln` in this process (`kiln_main`) or, for at
least one row of each command, as a subprocess (`kiln`), which also shows no traceback.
"""

from pathlib import Path

import pytest

from conftest import assert_user_error, files, kiln, kiln_main, make_config, write_config

SMALL = {
    "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_seq_len": 32},
    "data": {"source": "synthetic", "seq_len": 16},
    "mesh": {"fsdp": -1},
    "optim": {"warmup_steps": 0},
    "train": {"global_batch_size": 8, "steps": 2},
}  # fmt: skip
HUGE = 1180591620717411303424  # 2**70


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory holding only its config.yaml: `kiln generate` refuses these requests
    before it looks for a checkpoint."""
    run = tmp_path_factory.mktemp("gen") / "run"
    run.mkdir()
    (run / "config.yaml").write_text(make_config(SMALL).to_yaml())
    return run


def refused(tmp_path: Path, run_dir: Path, row) -> None:
    """Run the row's command in `tmp_path` (its config there, output under `tmp_path/runs`):
    exit 2, the one line with every needle, and no file added or changed."""
    runner, args, needles = row
    config = write_config(tmp_path / "c.yaml", SMALL, train={"output_dir": str(tmp_path / "runs")})
    # {long}: a directory whose path is 4,000 bytes, under the usual limit of 4,096 but not
    # with a run directory and the files below it.
    long = "/".join(["d" * 250] * 16)[: 4000 - len(str(tmp_path)) - 1].rstrip("/")
    fill = {"config": config, "run": run_dir, "tmp": tmp_path, "long": long}
    argv = [str(a).format(**fill) for a in args]
    before = files(tmp_path)
    proc = (kiln if runner == "subprocess" else kiln_main)(*argv, cwd=tmp_path)
    assert_user_error(proc, *needles)
    assert files(tmp_path) == before
    assert not (tmp_path / "runs").exists()


# (runner, arguments, needles of the one line); {config}, {run} and {tmp} are filled in.
COUNTS = {
    "generate --num-samples 10^12": (
        "subprocess",
        ["generate", "{run}", "--prompt", "def", "--max-new-tokens", "8",
         "--num-samples", "1000000000000", "--out", "{tmp}/o.jsonl"],
        ["--num-samples: 1 prompt x 1,000,000,000,000 samples x (up to 4 prompt + 8 new tokens)",
         "GB (parameters, KV cache, logits), more than the", "allowed: fewer samples"],
    ),
    "compile --devices 10^8": (
        "subprocess",
        ["compile", "{config}", "--devices", "100000000"],
        ["--devices: 100000000 devices; allowed: 1..4096 (the largest slice kiln compiles for"],
    ),
    "config --summary --devices 10^8": (
        "in-process",
        ["config", "{config}", "--summary", "--devices", "100000000"],
        ["--devices: 100000000 devices; allowed: 1..4096"],
    ),
    "config --summary on a mesh of 8192": (
        "in-process",
        ["config", "{config}", "--summary", "mesh.fsdp=8192", "train.global_batch_size=8192"],
        ["mesh (stage x data x fsdp x expert x tensor x sequence): 8192 devices; allowed: 1..4096"],
    ),
    "train model.d_model=10^8": (
        "in-process",
        ["train", "{config}", "model.d_model=100000000"],
        ["model: the train state of", "(d_model=100000000, num_layers=1, vocab_size=384, "
         "float32) needs", "for parameters, gradients and AdamW moments, more than the"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", list(COUNTS.values()), ids=list(COUNTS))
def test_counts_are_bounded_by_the_machine(tmp_path, run_dir, row):
    refused(tmp_path, run_dir, row)


def _mixture(big: float, small: float) -> str:
    """The override of a two-source mixture (braces doubled for `str.format`)."""
    entry = "{{{{name: {}, source: synthetic, weight: {}}}}}"
    return f"data.sources=[{entry.format('a', big)}, {entry.format('b', small)}]"


OVERFLOW = {
    "generate --seed 2^70": (
        "in-process",
        ["generate", "{run}", "--prompt", "def", "--seed", HUGE, "--out", "{tmp}/o.jsonl"],
        [f"--seed: got {HUGE}; allowed: an integer 0 <= seed < 2^32 (4294967296)"],
    ),
    "generate --seed -1": (
        "subprocess",
        ["generate", "{run}", "--prompt", "def", "--seed=-1", "--out", "{tmp}/o.jsonl"],
        ["--seed: got -1; allowed: an integer 0 <= seed < 2^32"],
    ),
    "train.seed=2^70": (
        "in-process",
        ["train", "{config}", f"train.seed={HUGE}"],
        [f"train.seed: got {HUGE}", "less than 4294967296"],
    ),
    "data.seed=2^32": (
        "in-process",
        ["train", "{config}", "data.seed=4294967296"],
        ["data.seed: got 4294967296", "less than 4294967296"],
    ),
    "mixture weights 1e300 and 1e-300": (
        "in-process",
        ["train", "{config}", _mixture(1e300, 1e-300)],
        ["data.sources.1.weight: 1e-300 is less than 1e-09 of the largest weight, 1e+300; "
         "allowed: 0 (not trained on) or at least 1e+291"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", list(OVERFLOW.values()), ids=list(OVERFLOW))
def test_numbers_out_of_the_range_they_are_used_in(tmp_path, run_dir, row):
    refused(tmp_path, run_dir, row)


# The routed experts' and latent attention's numbers, each refused by the schema when the config
# is loaded: none reaches the step, where it would overflow int32 (a capacity, an expert id) or
# build a table on the host (YaRN's ramp, the rotary frequencies).
MOE = ["model.family=moe"]
DEEPSEEK = ["model.family=deepseek"]
EXPERTS = {
    "train model.moe.capacity_factor=1e30": (
        "in-process",
        ["train", "{config}", *MOE, "model.moe.capacity_factor=1e30"],
        ["model.moe.capacity_factor: got '1e30'; Input should be less than or equal to 1000"],
    ),
    "compile model.moe.capacity_factor=1e10": (
        "subprocess",
        ["compile", "{config}", *MOE, "model.moe.capacity_factor=1e10"],
        ["model.moe.capacity_factor: got '1e10'; Input should be less than or equal to 1000"],
    ),
    "compile model.moe.num_experts=2^31-1": (
        "in-process",
        ["compile", "{config}", *MOE, "model.moe.num_experts=2147483647"],
        ["model.moe.num_experts: got 2147483647; Input should be less than or equal to 65536"],
    ),
    "train model.deepseek.yarn.beta_fast=1e-320": (
        "in-process",
        ["train", "{config}", *DEEPSEEK, "model.deepseek.yarn.beta_fast=1e-320"],
        ["model.deepseek.yarn.beta_fast: got '1e-320'; Input should be greater than or equal "
         "to 0.001"],
    ),
    "train model.deepseek.yarn.mscale_all_dim=1e308": (
        "in-process",
        ["train", "{config}", *DEEPSEEK, "model.deepseek.yarn.mscale_all_dim=1e308"],
        ["model.deepseek.yarn.mscale_all_dim: got '1e308'; Input should be less than or equal "
         "to 1000"],
    ),
    "train model.rope_theta=1 under YaRN": (
        "in-process",
        ["train", "{config}", *DEEPSEEK, "model.deepseek.yarn.factor=4", "model.rope_theta=1"],
        ["model.rope_theta is 1.0 with model.deepseek.yarn; allowed: a base above 1"],
    ),
    "train model.deepseek.qk_rope_head_dim=2^31-2": (
        "in-process",
        ["train", "{config}", *DEEPSEEK, "model.deepseek.qk_rope_head_dim=2147483646"],
        ["model.deepseek.qk_rope_head_dim: got 2147483646; Input should be less than or equal "
         "to 65536"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", list(EXPERTS.values()), ids=list(EXPERTS))
def test_expert_and_latent_attention_numbers_are_refused_when_loaded(tmp_path, run_dir, row):
    refused(tmp_path, run_dir, row)


def test_a_capacity_above_the_tokens_is_the_tokens():
    """An expert takes a token at most once: any factor from num_experts / experts_per_token up
    gives every token room, and the capacity never exceeds the tokens (nor int32)."""
    from kiln.model.moe import capacity

    assert capacity(64, 2, 8, 1.0) == 16
    assert capacity(64, 2, 8, 4.0) == capacity(64, 2, 8, 1000.0) == 64
    assert capacity(2**30, 8, 1, 1000.0) == 2**30


PATHS = {
    "kiln.lock is a directory": (
        "subprocess",
        ["train", "{config}", "train.output_dir={tmp}/out"],
        ["{tmp}/out/run/kiln.lock: a directory, where the run keeps its lock file; allowed: a "
         "regular file or nothing"],
    ),
    "train.run_name of 300 characters": (
        "in-process",
        ["train", "{config}", "train.run_name=" + "r" * 300],
        ["train.run_name: got 'rrrr", "300 bytes long; allowed: at most 255 bytes (UTF-8)"],
    ),
    "a name of 256 bytes in train.output_dir": (
        "in-process",
        ["train", "{config}", "train.output_dir={tmp}/" + "o" * 256],
        ["train.output_dir: the name oooo", "is 256 bytes; allowed: at most 255 bytes per name"],
    ),
    "a run directory past the path limit": (
        "in-process",
        ["train", "{config}", "train.output_dir={tmp}/{long}"],
        ["train.output_dir/train.run_name: ", "plus 256 for the files kiln writes below it; "
         "allowed: at most 4096 bytes in all (the filesystem's path limit)"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", list(PATHS.values()), ids=list(PATHS))
def test_paths_the_filesystem_cannot_hold(tmp_path, run_dir, row):
    runner, args, needles = row
    if "kiln.lock" in needles[0]:
        (tmp_path / "out" / "run" / "kiln.lock").mkdir(parents=True)
    needles = [n.format(tmp=tmp_path) for n in needles]
    refused(tmp_path, run_dir, (runner, args, needles))
