"""Starting `kiln train` on an existing run directory: finished runs, schedule extensions,
metrics without checkpoints and `--restart`, the history of config.yaml."""

import math
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import write_config
from kiln.cli import main
from kiln.config import OptimConfig
from kiln.runs.checkpoint import latest_complete_step
from kiln.training.resume import lr_jump

LR, FINAL = 1e-3, 0.1
RUN = {
    "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "data": {"source": "synthetic", "seq_len": 32},
    "optim": {"learning_rate": LR, "schedule": "cosine", "warmup_steps": 0, "final_lr_fraction": FINAL},
    "train": {"run_name": "r", "global_batch_size": 8, "log_every_steps": 1, "steps": 2},
    "checkpoint": {"every_steps": 0},
}  # fmt: skip


def cosine_lr(step: int, total: int) -> float:
    """The cosine schedule without warmup in float64: lr(step) for the update after `step`."""
    p = min(step / total, 1.0)
    return LR * (FINAL + (1 - FINAL) * 0.5 * (1 + math.cos(math.pi * p)))


def kiln_main(capsys, *args) -> tuple[int, list[str]]:
    """`kiln ARGS` in this process: exit code and the lines it wrote to stderr."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def snapshot(run_dir: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.rglob("*")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A cosine run of 2 steps, finished (checkpoint at step 2): copied by each test."""
    root = tmp_path_factory.mktemp("finished")
    config = write_config(root / "run.yaml", RUN, train={"output_dir": str(root / "runs")})
    assert main(["train", str(config)]) == 0
    return root


@pytest.fixture
def run(tmp_path, finished) -> tuple[Path, Path]:
    """(config file, run directory) of a private copy of the finished run."""
    shutil.copytree(finished / "runs", tmp_path / "runs")
    config = write_config(tmp_path / "run.yaml", RUN, train={"output_dir": str(tmp_path / "runs")})
    return config, tmp_path / "runs" / "r"


@pytest.mark.slow
def test_a_finished_run_says_so_trains_nothing_and_writes_nothing(run, capsys):
    config, run_dir = run
    before = snapshot(run_dir)
    code, err = kiln_main(capsys, "train", config, "loss.num_vocab_tiling=2")
    assert code == 0, err
    assert len(err) == 1 and err[0].startswith("kiln: run complete at step 2 (train.steps=2)"), err
    assert "use a new train.run_name" in err[0]
    assert snapshot(run_dir) == before  # config.yaml still says num_vocab_tiling 1
    # Below the checkpoint's step: the same.
    code, err = kiln_main(capsys, "train", config, "train.steps=1")
    assert code == 0 and err[0].startswith("kiln: run complete at step 2 (train.steps=1)"), err
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_extending_a_cosine_run_is_refused_naming_both_learning_rates(run, capsys):
    config, run_dir = run
    before = snapshot(run_dir)
    code, err = kiln_main(capsys, "train", config, "train.steps=3")
    assert code == 2 and len(err) == 1, err
    # The update after step 2: the finished schedule's rate, and the stretched one's (higher).
    old, new = cosine_lr(2, 2), cosine_lr(2, 3)
    assert "train.steps: 2 -> 3" in err[0] and f"from {old:.4g} to {new:.4g}" in err[0], err
    assert "checkpoint.load_params_from" in err[0]
    assert snapshot(run_dir) == before


def test_lr_jump_against_float64_schedules():
    cosine = OptimConfig(learning_rate=LR, schedule="cosine", final_lr_fraction=FINAL)
    old, new = lr_jump(cosine, 40, 40, 60)
    assert old == pytest.approx(cosine_lr(40, 40), rel=1e-6)  # float32 schedule vs float64
    assert new == pytest.approx(cosine_lr(40, 60), rel=1e-6)
    assert lr_jump(cosine, 40, 60, 40) is None  # shortening moves the decay forwards: allowed
    # wsd extended while still stable (decay in the last 20%: from step 48 of 60, 64 of 80).
    wsd = OptimConfig(learning_rate=LR, schedule="wsd", decay_fraction=0.2)
    assert lr_jump(wsd, 40, 60, 80) is None
    assert lr_jump(wsd, 50, 60, 80) is not None  # already decaying: a jump back up
    assert lr_jump(OptimConfig(learning_rate=LR, schedule="constant"), 40, 40, 60) is None


@pytest.mark.slow
def test_resuming_with_another_optimizer_is_refused_naming_both(run, capsys):
    config, run_dir = run
    before = snapshot(run_dir)
    more = ("train.steps=3", "optim.schedule=constant")  # no learning-rate jump to refuse
    code, err = kiln_main(capsys, "train", config, *more, "optim.name=muon")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("kiln: error: optim.name: adamw -> muon on resume"), err
    assert "keep optim.name=adamw" in err[0] and "checkpoint.load_params_from" in err[0], err
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_a_changed_config_is_kept_as_history_when_steps_are_trained(run, capsys):
    config, run_dir = run
    old = (run_dir / "config.yaml").read_text()
    code, err = kiln_main(capsys, "train", config, "train.steps=3", "optim.schedule=constant")
    assert code == 0, err
    assert (run_dir / "config.2.yaml").read_text() == old  # the config of steps 1..2
    new = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert new["train"]["steps"] == 3 and new["optim"]["schedule"] == "constant"
    assert latest_complete_step(run_dir / "checkpoints") == 3


@pytest.mark.slow
def test_metrics_without_checkpoints_start_over_with_the_earlier_run_moved_aside(run, capsys):
    config, run_dir = run
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "config.yaml").write_text(
        old_config := "# the earlier run's\n" + (run_dir / "config.yaml").read_text()
    )
    old_metrics = (run_dir / "metrics.jsonl").read_text()
    # Another model is refused, as on resume: the directory holds the earlier model's metrics.
    before = snapshot(run_dir)
    code, err = kiln_main(capsys, "train", config, "model.d_model=64")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("kiln: error: model.d_model: the run in "), err
    assert "even before its first checkpoint" in err[0] and "--restart" in err[0], err
    assert snapshot(run_dir) == before
    # Nothing to resume: the same command starts over, the earlier run moved aside.
    code, err = kiln_main(capsys, "train", config, "optim.learning_rate=2e-3")
    assert code == 0, err
    moved = run_dir / "restart-1"
    assert (
        f"kiln: {run_dir} has 2 rows of metrics but no checkpoint to resume from (the run stopped "
        "before its first save, or its checkpoints were removed): starting over from step 0: the "
        f"earlier run in {run_dir} moves to {moved}"
    ) in err, err
    assert (moved / "metrics.jsonl").read_text() == old_metrics  # nothing lost
    assert (moved / "config.yaml").read_text() == old_config
    assert sorted(p.name for p in moved.iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "tensorboard",
    ]
    assert latest_complete_step(run_dir / "checkpoints") == 2
    steps = [
        yaml.safe_load(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert steps == [1, 2]  # no earlier row stays
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["learning_rate"] == 2e-3
