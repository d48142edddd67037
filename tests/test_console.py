"""What a run prints: step lines on stdout, diagnostics on stderr, compile time, the summary;
the raw gradient norm, no MFU without a known peak, distillation's parts."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import config_dict, kiln, kiln_main, make_config, write_config, xla_flags_with
from kiln.distill import online as distill
from kiln.model.moe import MoeTransformer
from kiln.training.console import Summary, next_commands, step_line, summary_rows
from kiln.training.metrics import perf_metrics

MODEL = {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "max_seq_len": 16}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 4-step run in one process with one CPU device, stdout and stderr apart, gradients
    clipped far below their norm (so the clipped norm would read as the clip value)."""
    tmp = tmp_path_factory.mktemp("console")
    config = write_config(
        tmp / "c.yaml",
        model=MODEL,
        data={"source": "synthetic", "seq_len": 16},
        optim={"warmup_steps": 0, "grad_clip": 0.01},
        train={"run_name": "r", "output_dir": str(tmp), "steps": 4, "global_batch_size": 4,
               "log_every_steps": 2, "eval_every_steps": 4, "eval_batches": 1},
        checkpoint={"every_steps": 0, "async_save": False},
    )  # fmt: skip
    proc = kiln("train", config, env={"XLA_FLAGS": xla_flags_with(1)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp / "r" / "metrics.jsonl").read_text().splitlines()]
    return proc, rows, tmp / "r"


@pytest.mark.slow
def test_step_lines_go_to_stdout_and_diagnostics_to_stderr(tiny_run):
    proc, rows, _ = tiny_run
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    train_rows = [r for r in rows if "learning/loss" in r]
    assert [line.split()[1] for line in steps if " loss " in line] == ["2/4", "4/4"]
    for line, row in zip([s for s in steps if " loss " in s], train_rows):
        assert f"loss {row['learning/loss']:.4f}" in line
        assert re.search(r"\d tok/s", line)
    assert not [line for line in proc.stderr.splitlines() if line.startswith("step ")]
    # One row per step: step 4's evaluation is in its row, and printed just before its line.
    assert [r["step"] for r in rows] == [2, 4]
    assert "eval/loss" in rows[-1] and "learning/loss" in rows[-1]
    assert steps[-2].startswith("step 4/4  eval/loss") and " loss " in steps[-1]
    err = proc.stderr.splitlines()
    assert "on 1 device;" in err[0]  # singular
    compiling = err.index("kiln: compiling the train step…")
    assert re.fullmatch(r"kiln: compiled the train step in \d+\.\ds", err[compiling + 1])


@pytest.mark.slow
def test_summary_names_figures_checkpoint_and_next_commands(tiny_run):
    proc, rows, run_dir = tiny_run
    out = proc.stdout[proc.stdout.index("run complete") :]
    last_train = [r for r in rows if "learning/loss" in r][-1]["learning/loss"]
    last_eval = [r for r in rows if "eval/loss" in r][-1]["eval/loss"]
    assert re.search(r"steps\s+4 steps trained, now at step 4", out)
    assert re.search(rf"train loss\s+{last_train:.4f}", out)
    assert re.search(rf"eval loss\s+{last_eval:.4f}", out)
    checkpoint = re.search(r"checkpoint\s+(\S+)", out).group(1)
    assert (
        checkpoint == str(run_dir / "checkpoints" / "4")
        and (run_dir / "checkpoints" / "4").is_dir()
    )
    assert re.search(r"tokens/s\s+[\d,]+$", out, re.MULTILINE)
    assert [line for line in out.splitlines() if line != line.rstrip()] == []  # no padding
    assert out.endswith("next:\n" + "".join(f"  {c}\n" for c in next_commands(config_of(run_dir))))
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in out
    assert f"kiln compare {run_dir} " in out and f"kiln export-hf {run_dir} " in out
    # Synthetic tokens: no text to continue or score.
    assert "kiln generate" not in out and "kiln eval" not in out


def test_a_distillation_summary_names_its_objective_and_its_cross_entropy_apart():
    """The balanced objective is not a cross-entropy: the summary labels it, and gives the
    student's train cross-entropy (distill/hard_loss) to compare with the eval loss."""
    figures = dict(steps=6, last_step=6, seconds=93.0, tokens_per_sec=2509.0, train_loss=4.1079)
    figures.update(eval_loss=3.0146, checkpoint=None, next=[])
    rows = dict(summary_rows(Summary(Path("runs/d"), **figures, hard_loss=2.71)))
    assert rows["train objective"].startswith("4.1079 ")
    assert rows["train hard loss"].startswith("2.7100 ") and rows["eval loss"] == "3.0146"
    assert "train loss" not in rows
    # Pre-training's loss is a cross-entropy (with its z-term), as the eval loss is.
    rows = dict(summary_rows(Summary(Path("runs/t"), **figures)))
    assert rows["train loss"] == "4.1079" and "train objective" not in rows


def config_of(run_dir):
    from kiln.config import read_run_config

    return read_run_config(run_dir, "test")


NEXT = {
    "stdlib_python": (
        {"data": {"source": "text", "paths": ["stdlib:**/*.py"]},
         "train": {"eval_tasks": ["choice:kiln:stdlib_next_line.jsonl"]}},
        ["kiln generate runs/r --prompt 'def main(' --max-new-tokens 100",
         "kiln eval runs/r choice:kiln:stdlib_next_line.jsonl"],
    ),
    "own_text_held_out": (
        {"data": {"source": "jsonl", "paths": ["corpus/train.jsonl"],
                  "eval_paths": ["corpus/held out.jsonl"]}},
        ['kiln generate runs/r --prompt "" --max-new-tokens 100',
         "kiln eval runs/r 'perplexity:corpus/held out.jsonl'"],
    ),
    "chat": (
        {"data": {"source": "jsonl", "format": "chat", "paths": ["kiln:stdlib_chat.jsonl"]}},
        ['kiln generate runs/r --prompt "" --max-new-tokens 100'],
    ),
    "synthetic": ({"data": {"source": "synthetic"}}, []),
}  # fmt: skip


@pytest.mark.parametrize("data", NEXT)
def test_next_commands_fit_the_runs_data(data):
    """The summary's `next:` block suggests commands for the run's own data: no Python prompt
    or stdlib task for other data, no generation or scoring of synthetic tokens."""
    sections, want = NEXT[data]
    train = {"run_name": "r", "output_dir": "runs", "eval_every_steps": 100}
    config = make_config(config_dict(sections, train=train))
    assert next_commands(config) == [
        "tensorboard --logdir runs/r/tensorboard",
        "kiln compare runs/r --metrics learning/loss,eval/loss --out runs/r/loss.png",
        *want,
        "kiln export-hf runs/r --out exported/r",
    ]


@pytest.mark.slow
def test_console_shows_the_raw_gradient_norm_and_no_mfu_without_a_peak(tiny_run):
    proc, rows, _ = tiny_run
    row = [r for r in rows if "learning/loss" in r][-1]
    assert row["learning/grad_norm"] == pytest.approx(0.01)  # clipped
    assert row["learning/raw_grad_norm"] > 0.1
    line = next(s for s in proc.stdout.splitlines() if s.startswith("step 4/4  loss"))
    shown = float(re.search(r"grad_norm (\S+)", line).group(1))
    assert shown == pytest.approx(row["learning/raw_grad_norm"], rel=1e-3)  # printed with 4 digits
    # CPU has no known peak: no perf/mfu anywhere, and the start-up line says why.
    assert "perf/mfu" not in row and "mfu" not in line
    assert "the peak of device 'cpu' is unknown" in proc.stderr


@pytest.mark.slow
def test_without_a_terminal_step_lines_carry_elapsed_and_eta_and_task_scores_are_printed(tmp_path):
    """`kiln train ... > log` (here in this process, stdout and stderr not terminals)."""
    task = tmp_path / "t.jsonl"
    questions = [
        {"context": f"ab{i}", "choices": ["cd", "ef", "gh"], "gold": i % 3} for i in range(6)
    ]
    task.write_text("".join(json.dumps(q) + "\n" for q in questions))
    config = write_config(
        tmp_path / "c.yaml",
        model=MODEL,
        data={"source": "synthetic", "seq_len": 16},
        optim={"warmup_steps": 0},
        train={"run_name": "r", "output_dir": str(tmp_path), "steps": 4, "global_batch_size": 8,
               "log_every_steps": 2, "eval_every_steps": 2, "eval_batches": 1,
               "eval_tasks": [f"choice:{task}"]},
        checkpoint={"every_steps": 0, "async_save": False},
    )  # fmt: skip
    proc = kiln_main("train", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    timing = r"  elapsed \d+:\d\d:\d\d  ETA \d+:\d\d:\d\d"
    for row, (evals, train) in zip(rows, zip(lines[::2], lines[1::2])):
        step = row["step"]
        assert re.fullmatch(rf"step {step}/4  loss .* tok/s{timing}", train), train
        assert evals.startswith(f"step {step}/4  eval/loss {row['eval/loss']:.4f}"), evals
        # Every logged task metric reaches the console, with its task's name.
        for metric in ("acc", "acc_norm"):
            assert f"t/{metric} {row[f'eval/t/{metric}']:,.4g}" in evals, evals
    assert lines[-1].endswith("ETA 0:00:00")


def test_mfu_only_against_a_known_peak():
    unknown = make_config(model=MODEL, data={"seq_len": 16})
    assert "perf/mfu" not in perf_metrics(0.5, 1000, 6e6, unknown)
    known = make_config(model=MODEL, data={"seq_len": 16}, logging={"peak_tflops_per_device": 2.0})
    import jax

    tflops = 6e6 * 1000 / 0.5 / jax.device_count() / 1e12
    assert perf_metrics(0.5, 1000, 6e6, known)["perf/mfu"] == pytest.approx(tflops / 2.0, rel=1e-12)


def test_distillation_lines_show_hard_and_soft_losses():
    values = {f"distill/{m}": 0.0 for m in distill.METRICS}  # the tags a distill step reports
    values.update({"learning/loss": 3.0, "distill/hard_loss": 2.0, "distill/soft_loss": 0.5})
    line = step_line(7, 10, values)
    assert "loss 3.0000" in line and "hard 2.0000" in line and "soft 0.5000" in line
    assert "feature" not in line  # beta = 0: the feature term is off
    values["distill/feature_loss"] = 0.25
    assert "feature 0.2500" in step_line(7, 10, values)


def test_moe_lines_show_the_router_terms_and_the_expert_balance():
    """The MoE columns come from the tags an MoE step logs: its router terms and the worst
    layer's load over the mean (`MoeTransformer.aux_metrics`), not each layer's."""
    moe = {"num_experts": 4, "experts_per_token": 1, "d_ff_expert": 16, "capacity_factor": 1.0}
    config = make_config(model={**MODEL, "family": "moe", "moe": moe}, data={"seq_len": 16})
    # Two MoE layers' assignments per expert (means 2 and 2) and the assignments each dropped.
    sums = {"moe/expert_tokens": np.array([[6.0, 2, 0, 0], [3, 2, 2, 1]]),
            "moe/dropped_tokens": np.array([2.0, 0.0])}  # fmt: skip
    values = {k: float(v) for k, v in MoeTransformer.aux_metrics(config.model, sums).items()}
    values.update({"learning/loss": 3.0, "learning/router_z_loss": 0.0034})
    values.update({"learning/moe_lb_loss": 0.0401, "learning/raw_grad_norm": 0.5})
    line = step_line(7, 10, values)
    assert "loss 3.0000  router_z 0.0034  lb_loss 0.0401  load_max/mean 3.00  dropped 12.5%" in line
    assert "layer_" not in line and line.endswith("grad_norm 0.5")
    # A dense model's line has none of them.
    assert step_line(7, 10, {"learning/loss": 3.0}) == "step 7/10  loss 3.0000"


def test_a_skipped_step_prints_its_non_finite_figures():
    nan, inf = float("nan"), float("inf")
    values = {"learning/loss": nan, "learning/raw_grad_norm": inf, "perf/tokens_per_sec": nan}
    assert step_line(3, 10, values) == "step 3/10  loss nan  grad_norm inf  nan tok/s"
