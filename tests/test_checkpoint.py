"""Checkpoints and resume, as a user meets them: `kiln train` run, stopped, killed and run again."""

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import assert_user_error, communicate, kiln_main, start_kiln, wait_until, write_config
from kiln.config import load_config
from kiln.runs import local_tier
from kiln.runs.checkpoint import latest_complete_step
from kiln.runs.restore import restore
from kiln.training import train
from kiln.training.loop import checkpoint_tree

pytestmark = pytest.mark.slow

WORDS = [
    "the",
    "of",
    "kiln",
    "model",
    "token",
    "loss",
    "shard",
    "mesh",
    "step",
    "batch",
    "layer",
    "head",
    "norm",
    "scale",
    "grad",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(40):
        text = " ".join(rng.choice(WORDS, size=rng.integers(20, 120)))
        (root / f"doc{i:02d}.txt").write_text(text + "\n")
    return root


def write_run_config(tmp_path: Path, corpus: Path, **sections) -> Path:
    cfg = {
        "model": {"vocab_size": 384, "d_model": 32, "num_layers": 2, "num_heads": 4, "d_ff": 64, "max_seq_len": 32},
        "data": {"source": "text", "paths": [str(corpus / "*.txt")], "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
        "mesh": {"fsdp": -1},
        "optim": {"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0},
        "train": {"output_dir": str(tmp_path / "runs"), "run_name": "r", "global_batch_size": 8, "log_every_steps": 1, "steps": 12},
        "checkpoint": {"every_steps": 3, "keep": 2},
    }  # fmt: skip
    return write_config(tmp_path / "config.yaml", cfg, **sections)


def kiln_train(config: Path, *overrides, check=True):
    """`kiln train config overrides` in this process; by default, it must succeed. The runs
    that are killed or signalled are `start_kiln` subprocesses."""
    proc = kiln_main("train", config, *overrides)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["learning/loss"] for r in map(json.loads, lines) if "learning/loss" in r}


def final_params(config_path: Path, *overrides):
    config = load_config(config_path, overrides)
    directory = config.run_dir / "checkpoints"
    tree, _ = restore(directory, latest_complete_step(directory), train_abstract(config))
    return jax.tree.map(np.asarray, jax.device_get(tree))


# The restore targets of the configs met so far, by what shapes and shards the train state.
_ABSTRACT: dict[str, object] = {}


def train_abstract(config):
    """What a checkpoint of `config`'s runs restores into: the train state's shapes, dtypes and
    shardings, as `kiln compile` lowers it (nothing initialised or compiled); the straight and
    the resumed run of a test share one."""
    from kiln.parallel.mesh import make_mesh
    from kiln.runs.restore import abstract_like

    key = config.model_dump_json(include={"model", "optim", "mesh"})
    if key not in _ABSTRACT:
        _, state = train.abstract_pretraining(config, make_mesh(config))
        _ABSTRACT[key] = abstract_like(checkpoint_tree(state))
    return _ABSTRACT[key]


def assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """12 uninterrupted steps: what every interrupted run must reproduce."""
    tmp = tmp_path_factory.mktemp("straight")
    config = write_run_config(tmp, corpus, checkpoint={"every_steps": 12})  # the end state only
    kiln_train(config)
    return config, losses(tmp / "runs" / "r"), final_params(config)


def test_resume_is_bitwise_exact(tmp_path, corpus, straight):
    _, want_losses, want_params = straight
    config = write_run_config(tmp_path, corpus)
    kiln_train(config, "train.steps=6")
    proc = kiln_train(config, "train.steps=12")
    assert "resuming from step 6" in proc.stderr
    assert "train.steps: 6 -> 12" in proc.stderr
    assert "another topology" not in proc.stderr
    got = losses(tmp_path / "runs" / "r")
    assert [got[s] for s in range(7, 13)] == [want_losses[s] for s in range(7, 13)]
    assert_bitwise(final_params(config), want_params)
    # retention: keep=2 of the saves at 3, 6, 9, 12
    assert sorted(int(p.name) for p in (tmp_path / "runs/r/checkpoints").glob("[0-9]*")) == [9, 12]


def wait_for_step(run_dir: Path, step: int, proc) -> None:
    """Wait while the run `proc` works until it has logged `step`."""

    def logged() -> bool:
        return (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= step

    wait_until(logged, proc, f"step {step}")


def test_sigterm_saves_and_exits_cleanly_then_cosine_resume_is_exact(tmp_path, corpus):
    # No periodic saves in either run: the stopped run's only checkpoint is the one SIGTERM
    # makes, and the reference's 100 saves would be most of its time.
    overrides = [
        "optim.schedule=cosine",
        "optim.warmup_steps=5",
        # The stopped run saves near step 2 (it is signalled there); its resume runs the cosine
        # decay to its end.
        "train.steps=30",
        "checkpoint.every_steps=0",
    ]
    (tmp_path / "ref").mkdir()
    ref_config = write_run_config(tmp_path / "ref", corpus)
    kiln_train(ref_config, *overrides)
    want = losses(tmp_path / "ref" / "runs" / "r")

    config = write_run_config(tmp_path, corpus)
    proc = start_kiln("train", config, *overrides)
    run_dir = tmp_path / "runs" / "r"
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = communicate(proc)
    assert proc.returncode == 0, err[-3000:]
    stopped = latest_complete_step(run_dir / "checkpoints")
    assert stopped is not None and stopped < 30, err[-2000:]
    assert f"at step {stopped}" in err
    kiln_train(config, *overrides)
    got = losses(run_dir)
    assert [got[s] for s in range(stopped + 1, 31)] == [want[s] for s in range(stopped + 1, 31)]
    assert_bitwise(final_params(config, *overrides), final_params(ref_config, *overrides))


def kill_9_after_step_5(config: Path, run_dir: Path, *overrides: str) -> int:
    """Start `kiln train config` for 400 steps and kill -9 it once it has logged step 5; the
    step of its latest complete checkpoint (the test is skipped if that is past step 12)."""
    proc = start_kiln("train", config, "train.steps=400", *overrides)
    wait_for_step(run_dir, 5, proc)
    os.kill(proc.pid, signal.SIGKILL)
    communicate(proc)
    complete = latest_complete_step(run_dir / "checkpoints")
    assert complete is not None and complete >= 3
    if complete >= 12:
        pytest.skip("the killed run got past step 12 before the kill")
    return complete


def resume_to_step_12(config: Path, run_dir: Path, complete: int, want_losses, want_state):
    """Resume the killed run to step 12: the losses after `complete` and the final state are
    bitwise those of the straight run (saved at step 12 only: saves on the way cost time)."""
    kiln_train(config, "checkpoint.every_steps=12")
    got = losses(run_dir)
    assert [got[s] for s in range(complete + 1, 13)] == [
        want_losses[s] for s in range(complete + 1, 13)
    ]
    assert_bitwise(final_params(config), want_state)


def test_kill_9_during_async_saves_resumes_from_last_complete(tmp_path, corpus, straight):
    _, want_losses, want_params = straight
    config = write_run_config(tmp_path, corpus, checkpoint={"every_steps": 1, "keep": 3})
    run_dir = tmp_path / "runs" / "r"
    complete = kill_9_after_step_5(config, run_dir)
    resume_to_step_12(config, run_dir, complete, want_losses, want_params)
    # Half-written saves of the killed run were cleaned up when the next run opened the directory.
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


def figures(run_dir: Path, steps) -> list[tuple[float, float]]:
    """(loss, grad norm) of each of `steps`, from metrics.jsonl."""
    rows = {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }
    return [(rows[s]["learning/loss"], rows[s]["learning/grad_norm"]) for s in steps]


def test_kill_9_between_a_local_and_a_persistent_save_resumes_from_the_local_tier(
    tmp_path, corpus, straight
):
    """Local saves every step beside persistent ones every 4: a kill -9 leaves a local step newer
    than the newest persistent one, and the resume takes it, data position included, bitwise."""
    config_path, want_losses, want_params = straight
    want = figures(load_config(config_path).run_dir, range(1, 13))
    local = tmp_path / "node-local"
    sections = {"checkpoint": {"every_steps": 4, "local_dir": str(local), "local_every_steps": 1}}
    config = write_run_config(tmp_path, corpus, **sections)
    run_dir = tmp_path / "runs" / "r"
    tier = local / "r" / "process_0"

    def local_step_5_sealed() -> bool:  # sealed: committed by orbax, then the manifest written
        return any(int(p.parent.name) >= 5 for p in tier.glob("[0-9]*/kiln_manifest.json"))

    proc = start_kiln("train", config, "train.steps=400")
    wait_until(local_step_5_sealed, proc, "local step 5")
    os.kill(proc.pid, signal.SIGKILL)
    communicate(proc)
    persistent = latest_complete_step(run_dir / "checkpoints")
    newest_local = latest_complete_step(tier, local=True)
    if newest_local >= 12 or newest_local <= (persistent or 0):
        pytest.skip(f"the kill came at local step {newest_local}, persistent {persistent}")
    proc = kiln_train(config, "checkpoint.every_steps=12")
    resumed = f"resuming from step {newest_local} (local checkpoint tier {local / 'r'}"
    assert resumed in proc.stderr, proc.stderr[-3000:]
    # Bitwise: the same arithmetic on the same state and batches as the uninterrupted run.
    got = figures(run_dir, range(newest_local + 1, 13))
    assert got == want[newest_local:], (got, want)
    assert [losses(run_dir)[s] for s in range(1, 13)] == [want_losses[s] for s in range(1, 13)]
    assert_bitwise(final_params(config), want_params)
    # The tier keeps the newest local saves (checkpoint.local_keep: 2); step 12, the last, is
    # saved persistently only.
    assert sorted(int(p.name) for p in tier.glob("[0-9]*")) == [10, 11]
    # They belong to this run directory while it exists: one deleted by hand starts over.
    assert local_tier.own_steps(load_config(config)) == [11, 10]
    shutil.rmtree(run_dir)
    assert local_tier.own_steps(load_config(config)) == []


ROUTED = {"num_experts": 4, "experts_per_token": 2, "d_ff_expert": 16, "balance": "aux_free"}
# One routed layer: what is saved and restored is the same for each layer of a stack.
MOE = {
    "family": "moe",
    "num_layers": 1,
    "moe": {**ROUTED, "router_z_loss": 1e-3, "load_balance_loss": 1e-2},
}
# DeepSeek-V3's routing, latent attention and a multi-token prediction module.
DEEPSEEK = {
    "family": "deepseek",
    "num_layers": 1,
    "moe": {**ROUTED, "score": "sigmoid", "n_group": 2, "topk_group": 1, "router_z_loss": 1e-3},
    "deepseek": {
        **{"kv_lora_rank": 16, "qk_nope_head_dim": 8},
        **{"qk_rope_head_dim": 4, "v_head_dim": 8, "mtp_num_layers": 1},
    },
}


@pytest.mark.parametrize(
    ("optim", "model"),
    [
        ({"name": "muon"}, MOE),
        ({"name": "adafactor", "adafactor": {"min_dim_size_to_factor": 32}}, DEEPSEEK),
    ],
    ids=["muon-moe", "adafactor-deepseek"],
)
def test_kill_9_resumes_bitwise_with_each_optimizers_and_familys_state(
    tmp_path, corpus, optim, model
):
    """Muon's momentum and Adafactor's factored statistics (replicated, see
    `kiln.parallel.mesh.state_specs`) are saved and restored exactly as AdamW's moments, each
    on a routed family with balance: aux_free, whose routing biases, moved outside the
    gradient after every step, are saved with the parameters and restored exactly (deepseek:
    its latent attention, and its prediction module's biases too). Every optimizer and every
    family is killed and resumed once (llama with AdamW above)."""
    (tmp_path / "straight").mkdir()
    end_only = {"every_steps": 12}
    straight = write_run_config(
        tmp_path / "straight", corpus, optim=optim, model=model, checkpoint=end_only
    )
    kiln_train(straight)
    want_losses, want_state = losses(tmp_path / "straight" / "runs" / "r"), final_params(straight)
    assert np.abs(want_state["params"]["blocks"]["mlp"]["bias"]).max() > 0
    if model["family"] == "deepseek":
        assert np.abs(want_state["params"]["mtp"]["block"]["mlp"]["bias"]).max() > 0
    sections = {"optim": optim, "model": model, "checkpoint": {"every_steps": 1}}
    config = write_run_config(tmp_path, corpus, **sections)
    run_dir = tmp_path / "runs" / "r"
    complete = kill_9_after_step_5(config, run_dir)
    resume_to_step_12(config, run_dir, complete, want_losses, want_state)  # params and optimizer


def test_restore_onto_a_different_mesh(tmp_path, corpus, straight):
    _, want_losses, _ = straight
    config = write_run_config(tmp_path, corpus)
    kiln_train(config, "train.steps=6")  # saved on fsdp=8
    proc = kiln_train(config, "train.steps=7", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    moved = [line for line in proc.stderr.splitlines() if "another topology" in line]
    assert moved == [
        "kiln: resuming on another topology: 1 process x 8 cpu devices (fsdp 8) -> "
        "1 process x 8 cpu devices (data 2, fsdp 2, tensor 2)"
    ], proc.stderr[-3000:]
    got = losses(tmp_path / "runs" / "r")
    # Another mesh sums in another order: 1e-5 relative (f32).
    np.testing.assert_allclose(got[7], want_losses[7], rtol=1e-5)


def test_incompatible_resume_is_refused_and_changes_nothing(tmp_path, corpus):
    config = write_run_config(tmp_path, corpus)
    kiln_train(config, "train.steps=3")
    run_dir = tmp_path / "runs" / "r"
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    proc = kiln_train(config, "train.steps=6", "model.d_model=64", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "model.d_model" in proc.stderr and "Traceback" not in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_damaged_latest_checkpoint_falls_back_and_resumes_exactly(tmp_path, corpus, straight):
    _, want_losses, want_params = straight
    config = write_run_config(tmp_path, corpus)
    kiln_train(config, "train.steps=6")  # checkpoints 3 and 6
    run_dir = tmp_path / "runs" / "r"
    step_6 = run_dir / "checkpoints" / "6"
    array_file = max((p for p in step_6.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(array_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: orbax alone loads this without a word
    array_file.write_bytes(bytes(data))
    proc = kiln_train(config)
    assert "resuming from step 3" in proc.stderr, proc.stderr[-3000:]
    skipped = [line for line in proc.stderr.splitlines() if "skipped" in line]
    assert len(skipped) == 1, proc.stderr[-3000:]
    assert "checkpoint step 6 skipped, it is damaged: state/" in skipped[0]
    assert "does not match its checksum" in skipped[0]
    assert (run_dir / "damaged-checkpoints" / "6").is_dir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))  # one row per step, in order
    got = losses(run_dir)
    assert [got[s] for s in range(1, 13)] == [want_losses[s] for s in range(1, 13)]
    assert_bitwise(final_params(config), want_params)


def test_resume_on_other_inputs_is_refused(tmp_path, corpus):
    own = tmp_path / "corpus"
    shutil.copytree(corpus, own)
    config = write_run_config(tmp_path, own)
    kiln_train(config, "train.steps=3")
    run_dir = tmp_path / "runs" / "r"
    assert json.loads((run_dir / "inputs.json").read_text())["split"]["eval_fraction"] == 0.01
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    proc = kiln_train(config, "train.steps=6", "data.eval_fraction=0.2", check=False)
    assert_user_error(proc, "data.eval_fraction: the run in", "0.01", "0.2")
    for path in sorted(own.glob("*.txt"))[::2]:  # half of the input files, cut in half
        path.write_text(path.read_text()[: path.stat().st_size // 2])
    proc = kiln_train(config, "train.steps=6", check=False)
    assert_user_error(proc, "data.paths: the corpus of this run changed since it started (")
    assert "tokens " in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_load_params_from_starts_a_fresh_optimizer(tmp_path, corpus, straight):
    source_config, _, source_params = straight
    source_run = load_config(source_config).run_dir
    config = write_run_config(tmp_path, corpus, checkpoint={"load_params_from": str(source_run)})
    kiln_train(config, "train.steps=1", "optim.learning_rate=1e-9")
    params = final_params(config, "train.steps=1")
    assert int(params["step"]) == 1
    # After one step at a negligible learning rate the weights are the source's (to 1e-6).
    for x, y in zip(
        jax.tree.leaves(params["params"]), jax.tree.leaves(source_params["params"]), strict=True
    ):
        np.testing.assert_allclose(x, y, atol=1e-6)
    adam_counts = [c for c in jax.tree.leaves(params["opt_state"]) if np.ndim(c) == 0]
    assert adam_counts and all(int(c) == 1 for c in adam_counts)  # a fresh optimizer, one step old


def test_orbax_routine_warnings_are_dropped_and_other_absl_records_kept(
    tmp_path, caplog, monkeypatch
):
    from absl import logging as absl_logging

    absl = logging.getLogger("absl")
    assert absl.level < logging.ERROR  # importing kiln.runs.checkpoint silenced nothing
    caplog.set_level(logging.INFO)
    (tmp_path / "checkpoints").mkdir()

    def records() -> list[logging.LogRecord]:
        caplog.clear()
        assert latest_complete_step(tmp_path / "checkpoints") is None  # orbax warns: read-only
        absl_logging.warning("a warning of another absl user")
        return [r for r in caplog.records if r.name == "absl"]

    kept = records()
    assert [r.getMessage() for r in kept] == ["a warning of another absl user"]
    quiet = [f for f in absl.filters if type(f).__name__ == "_QuietOrbax"]
    assert len(quiet) == 1  # installed once, however many managers were opened
    # What the filter drops: orbax's own warnings, from orbax's files.
    monkeypatch.setattr(type(quiet[0]), "filter", lambda self, record: True)
    unfiltered = records()
    orbax = [r for r in unfiltered if f"{os.sep}orbax{os.sep}" in r.pathname]
    assert any(r.levelno == logging.WARNING for r in orbax), [r.getMessage() for r in unfiltered]
