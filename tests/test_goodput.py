"""Goodput: a run's wall time over every attempt, by phase, and the work lost to attempts that died."""

import contextlib
import json
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import (
    communicate,
    kiln_main,
    start_kiln,
    wait_until,
    write_config,
    xla_flags_with,
)

PHASES = ("init", "compile", "data", "step", "checkpoint", "eval", "other")

CONFIG = {
    "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_seq_len": 16, "dtype": "float32"},
    "data": {"source": "synthetic", "synthetic_kind": "markov", "paths": [], "seq_len": 16},
    "mesh": {"fsdp": -1},
    "optim": {"learning_rate": 3e-3, "schedule": "constant", "warmup_steps": 0},
    "train": {"run_name": "r", "global_batch_size": 16, "log_every_steps": 1, "steps": 60, "eval_every_steps": 25, "eval_batches": 1},
    "checkpoint": {"every_steps": 10, "async_save": False},
}  # fmt: skip


def rows(run_dir: Path) -> list[dict]:
    """The whole rows of metrics.jsonl (a torn last line left by kill -9 is not one)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def last_step(run_dir: Path) -> int:
    try:
        return max((r["step"] for r in rows(run_dir)), default=0)
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_a_run_stopped_twice_accounts_its_wall_time_and_the_steps_it_redid(tmp_path):
    """Each attempt is a `kiln train` process on 1 CPU device: what is measured is its wall time
    by phase, which no assertion ties to the device count, and one device costs least CPU time."""
    config = write_config(tmp_path / "config.yaml", CONFIG)
    run_dir = tmp_path / "runs" / "r"
    walls, outs, redone = [], [], 0
    one_device = {"XLA_FLAGS": xla_flags_with(1)}

    def attempt(until: int | None, how: signal.Signals | None):
        """Start the run; once it has logged step `until`, send it `how`; its output and
        resume step."""
        began = time.monotonic()
        proc = start_kiln("train", config, f"train.output_dir={tmp_path / 'runs'}", env=one_device)
        if until is not None:
            wait_until(lambda: last_step(run_dir) >= until, proc, f"step {until}")
            proc.send_signal(how)
        out, err = communicate(proc)
        outs.append(out)
        walls.append(time.monotonic() - began)
        resumed = re.search(r"resuming from step (\d+)", err)
        return proc.returncode, err, int(resumed[1]) if resumed else 0

    code, err, _ = attempt(13, signal.SIGKILL)
    assert code == -signal.SIGKILL, err[-3000:]
    reached = last_step(run_dir)  # what the killed attempt had computed (and logged)

    code, err, resumed = attempt(40, signal.SIGTERM)
    assert code == 0 and "stopped by signal SIGTERM" in err, err[-3000:]
    assert resumed > 0 and reached > resumed, (reached, resumed)
    redone += reached - resumed

    code, err, resumed = attempt(None, None)
    assert code == 0, err[-3000:]
    assert resumed >= 40

    final = rows(run_dir)[-1]
    assert final["step"] == 60
    figures = {k.removeprefix("goodput/"): v for k, v in final.items() if k.startswith("goodput/")}
    assert figures["attempts"] == 3
    assert figures["lost_steps"] == redone
    parts = sum(figures[f"{p}_seconds"] for p in PHASES) + figures["lost_seconds"]
    assert parts == pytest.approx(figures["wall_seconds"], rel=1e-5)  # float32 sums
    # Within 5% of what was measured from outside: the processes' start-up before Python ran
    # kiln is in init (from /proc), their exits after the last row are not counted.
    assert parts == pytest.approx(sum(walls), rel=0.05), (figures, walls)
    assert figures["lost_seconds"] > 0 and figures["compile_seconds"] > 0
    assert figures["eval_seconds"] > 0 and figures["checkpoint_seconds"] > 0
    assert figures["goodput"] == pytest.approx(figures["step_seconds"] / figures["wall_seconds"])

    # The summary at the end, and `kiln compare`, give them too.
    summary = outs[-1][outs[-1].index("run complete") :]
    share = f"{figures['goodput']:.0%}"
    assert re.search(rf"goodput\s+{share} of .* \(3 attempts\) went to training steps", summary)
    assert f"({redone} steps computed again)" in summary
    proc = kiln_main("compare", run_dir, "--out", tmp_path / "plot.png")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.splitlines()
    heading = next(i for i, line in enumerate(table) if line.startswith("goodput: "))
    cells = table[heading + 2].split()
    assert cells[0] == "r" and cells[-1] == "60" and cells[-2] == "3" and cells[-3] == str(redone)


def test_the_steps_after_the_restored_checkpoint_become_lost_work(tmp_path):
    """`carried` on the rows a dead attempt left: steps 11..14 after checkpoint 10 are lost,
    their step time moves from step_seconds to lost_seconds; a torn last line is skipped."""
    from kiln.training.goodput import carried

    def row(step, seconds, lost=0.0, lost_steps=0):
        figures = {f"goodput/{p}_seconds": 1.0 for p in PHASES}
        figures.update({"goodput/step_seconds": seconds, "goodput/lost_seconds": lost})
        figures.update({"goodput/lost_steps": lost_steps, "goodput/attempts": 2})
        figures["goodput/wall_seconds"] = 6.0 + seconds + lost
        return json.dumps({"step": step, "learning/loss": 1.0, **figures})

    path = tmp_path / "metrics.jsonl"
    lines = [row(5, 5.0, 2.0, 3), row(10, 10.0, 2.0, 3), row(12, 12.5, 2.0, 3)]
    path.write_text("\n".join([*lines, row(14, 14.5, 2.0, 3), '{"step": 15, "lea']))
    got = carried(path, 10)
    assert got["goodput/step_seconds"] == 10.0 and got["goodput/lost_seconds"] == 6.5
    assert got["goodput/lost_steps"] == 3 + 4 and got["goodput/attempts"] == 2
    assert got["goodput/wall_seconds"] == 6.0 + 14.5 + 2.0  # the wall time is all kept
    # Resumed from the last row's step: nothing lost; from the start: every step.
    assert carried(path, 14)["goodput/lost_steps"] == 3
    assert carried(path, 0)["goodput/lost_seconds"] == 2.0 + 14.5
    # No figures (a run from before goodput accounting, or none at all): nothing carried.
    path.write_text('{"step": 1, "learning/loss": 2.0}\n')
    assert carried(path, 0) == {} and carried(tmp_path / "none.jsonl", 0) == {}
