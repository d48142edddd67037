"""`kiln eval RUN_DIR [--step N] TASK...`: score a run's checkpoint on tasks; a table, eval.json."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from kiln.config import read_run_config
from kiln.data import load_tokenizer
from kiln.data.eval_tasks import parse_tasks
from kiln.errors import KilnError
from kiln.runs.runmodel import load_run_model
from kiln.training.scoring import LOGGED, Evaluator, load_tasks, tags
from kiln.util.atomic import write_whole
from kiln.util.files import check_creatable
from kiln.util.humanize import plural
from kiln.util.tensorboard import tensorboardx


def run_eval(
    run_dir: str | Path,
    tasks: Sequence[str],
    *,
    step: int | None = None,
    out: str | Path | None = None,
    tensorboard: bool = False,
) -> dict[str, Any]:
    """`kiln eval`: every task scored at one checkpoint; eval.json written; the report returned."""
    run_dir = Path(run_dir).expanduser()
    if not tasks:
        raise KilnError("kiln eval: give at least one TASK (perplexity:PATH or choice:FILE.jsonl)")
    specs = parse_tasks(tasks, "kiln eval")
    config = read_run_config(run_dir, "kiln eval")
    path = Path(out).expanduser() if out else run_dir / "eval.json"
    check_creatable(path.parent, "--out")  # before any task is read or scored
    tokenizer = load_tokenizer(config.data.tokenizer)
    data = load_tasks(specs, config, tokenizer)
    run = load_run_model(run_dir, step, context="kiln eval", config=config)
    if jax.process_index() == 0:
        print(
            f"kiln: scoring {plural(len(specs), 'task')} with {run_dir} step {run.step}…",
            file=sys.stderr,
            flush=True,
        )
    results = Evaluator(config, run.mesh, data).run(run.state)
    report = {
        "run_dir": str(run_dir),
        "step": run.step,
        "tokenizer": config.data.tokenizer,
        "tasks": {s.name: {"task": s.text, **results[s.name]} for s in specs},
    }
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(report, indent=1) + "\n")
        report["written"] = str(path)
        if tensorboard:
            writer = tensorboardx().SummaryWriter(str(run_dir / "tensorboard"))
            for tag, value in tags(results).items():
                writer.add_scalar(tag, value, run.step)
            writer.close()
    return report


def print_table(report: dict[str, Any]) -> None:
    """The report as a rich table on stdout: one row per task and metric."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['run_dir']} at step {report['step']}")
    for column in ("task", "metric", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for name, values in report["tasks"].items():
        shown = [m for m in values if m != "task"]
        for i, metric in enumerate(sorted(shown, key=lambda m: (m not in LOGGED, m))):
            value = values[metric]
            text = f"{value:,.0f}" if metric not in LOGGED else f"{value:.4f}"
            table.add_row(name if i == 0 else "", metric, text)
    console = Console(soft_wrap=True)
    console.print(table)
    if "written" in report:
        console.print(f"wrote {report['written']}", highlight=False)
