"""What a run prints: one line per logged step on stdout, diagnostics on stderr, a live progress
bar on a terminal, the compile status, and a summary at the end (rich renders all of them)."""

from __future__ import annotations

import datetime
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from kiln.config import Config
from kiln.util.humanize import count, duration, plural

# What a step line shows, in order, with its short name: the loss as trained (in distillation
# the balanced total), then the parts a reader compares, an MoE model's router terms and
# expert balance (the worst layer's most loaded expert over the mean load, the assignments
# dropped), the raw (unclipped) gradient norm, the learning rate and speed. Absent tags are
# left out (perf/mfu without a known peak, the MoE columns of a dense model).
STEP_COLUMNS = (
    ("learning/loss", "loss"),
    ("distill/hard_loss", "hard"),
    ("distill/soft_loss", "soft"),
    ("distill/feature_loss", "feature"),
    ("learning/z_loss", "z_loss"),
    ("learning/router_z_loss", "router_z"),
    ("learning/moe_lb_loss", "lb_loss"),
    ("moe/expert_load_max_over_mean", "load_max/mean"),
    ("moe/dropped_fraction", "dropped"),
    ("learning/raw_grad_norm", "grad_norm"),
    ("learning/current_learning_rate", "lr"),
    ("perf/tokens_per_sec", "tok/s"),
    ("perf/mfu", "mfu"),
)
EVAL_COLUMNS = (("eval/loss", "eval/loss"), ("eval/perplexity", "eval/perplexity"))


def step_line(step: int, total: int, values: Mapping[str, float]) -> str:
    """The scrollback line of a logged step (or of an eval row)."""
    columns = EVAL_COLUMNS if any(k.startswith("eval/") for k in values) else STEP_COLUMNS
    if columns is EVAL_COLUMNS:
        # Each source of a mixture (eval/loss/<name>, shown as <name>), then each task's
        # metrics (eval/<task>/<metric>, shown as <task>/<metric>).
        sources = sorted(k for k in values if k.startswith("eval/loss/"))
        tasks = sorted(k for k in values if k.count("/") == 2 and not k.startswith("eval/loss/"))
        columns = (
            *columns,
            *((k, k.removeprefix("eval/loss/")) for k in sources),
            *((k, k.removeprefix("eval/")) for k in tasks),
        )
    shown = [_cell(tag, name, values[tag]) for tag, name in columns if _shown(tag, values)]
    return f"step {step}/{total}  " + "  ".join(shown)


def clock(seconds: float) -> str:
    """A duration as H:MM:SS, as the progress bar shows it."""
    return str(datetime.timedelta(seconds=round(seconds)))


def _shown(tag: str, values: Mapping[str, float]) -> bool:
    # A feature term switched off (beta = 0) and a z-loss of 0 are not worth a column.
    if tag in ("distill/feature_loss", "learning/z_loss"):
        return values.get(tag, 0.0) != 0.0
    return tag in values


def _cell(tag: str, name: str, value: float) -> str:
    if tag == "perf/tokens_per_sec":
        return f"{count(value)} {name}"
    if tag in ("perf/mfu", "moe/dropped_fraction"):
        return f"{name} {value:.1%}"
    if tag == "moe/expert_load_max_over_mean":
        return f"{name} {value:.2f}"
    if "loss" in tag:
        return f"{name} {value:.4f}"
    if tag == "learning/current_learning_rate":
        return f"{name} {value:.3g}"
    return f"{name} {value:,.4g}" if abs(value) < 1e4 else f"{name} {count(value)}"


@dataclass
class Summary:
    """What a finished run reports: its figures and where its results are."""

    run_dir: Path
    steps: int  # trained by this invocation
    last_step: int
    seconds: float  # wall time from start-up
    tokens_per_sec: float | None  # after the first step (compilation excluded)
    train_loss: float | None  # learning/loss: what the step optimised
    eval_loss: float | None
    checkpoint: Path | None
    next: list[str]  # commands to run next with the run
    # Distillation: the student's cross-entropy on the labels (distill/hard_loss), the train
    # figure eval loss compares with; train_loss is then the balanced objective.
    hard_loss: float | None = None
    goodput: Mapping[str, float] | None = None  # the goodput/* figures of the last row


def goodput_rows(values: Mapping[str, float]) -> list[tuple[str, str]]:
    """The share of a run's wall time (all attempts) that went to training steps, and where the
    rest went; nothing for a run without goodput figures."""
    wall = values.get("goodput/wall_seconds")
    if not wall:
        return []
    attempts = plural(int(values["goodput/attempts"]), "attempt")
    head = (
        f"{values['goodput/goodput']:.0%} of {duration(wall)} ({attempts}) went to training "
        f"steps ({duration(values['goodput/step_seconds'])})"
    )
    names = (
        ("init", "start-up"),
        ("compile", "compilation"),
        ("data", "waiting for data"),
        ("checkpoint", "checkpoints"),
        ("eval", "evaluation"),
        ("other", "other"),
    )
    parts = [f"{name} {duration(values[f'goodput/{key}_seconds'])}" for key, name in names]
    redone = plural(int(values["goodput/lost_steps"]), "step")
    parts.append(f"lost {duration(values['goodput/lost_seconds'])} ({redone} computed again)")
    return [("goodput", head), ("the rest", ", ".join(parts))]


def summary_rows(s: Summary) -> list[tuple[str, str]]:
    """The end-of-run figures, (name, value) in order."""
    loss = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    if s.hard_loss is None:
        train = [("train loss", loss(s.train_loss))]
    else:
        train = [
            ("train objective", f"{loss(s.train_loss)} (what the step optimised)"),
            ("train hard loss", f"{loss(s.hard_loss)} (cross-entropy on the labels, as eval loss)"),
        ]
    return [
        ("steps", f"{plural(s.steps, 'step')} trained, now at step {s.last_step}"),
        ("wall time", f"{duration(s.seconds)} (start-up and compilation included)"),
        ("tokens/s", "n/a" if s.tokens_per_sec is None else count(s.tokens_per_sec)),
        *train,
        ("eval loss", "not evaluated" if s.eval_loss is None else f"{s.eval_loss:.4f}"),
        ("checkpoint", str(s.checkpoint) if s.checkpoint else "none"),
        *goodput_rows(s.goodput or {}),
    ]


def summary_text(s: Summary) -> Text:
    """'run complete' and one line per figure, names in bold and aligned (no trailing spaces)."""
    rows = summary_rows(s)
    width = max(len(name) for name, _ in rows)
    text = Text("run complete")
    for name, value in rows:
        text.append("\n ")
        text.append(name, style="bold")
        text.append(" " * (width - len(name) + 2) + value)
    return text


def next_commands(config: Config) -> list[str]:
    """What a user runs next with a finished run, for the run's own data: a sample of it with
    `kiln generate` (a Python prompt for Python sources, else from the document start; none for
    synthetic tokens), and `kiln eval` on the run's eval tasks or held-out text files."""
    run, q = config.run_dir, shlex.quote
    metrics = "learning/loss,eval/loss" if config.train.eval_every_steps else "learning/loss"
    out = [
        f"tensorboard --logdir {q(str(run / 'tensorboard'))}",
        f"kiln compare {q(str(run))} --metrics {metrics} --out {q(str(run / 'loss.png'))}",
    ]
    sources = [s for _, s in config.data.mixture()]
    if any(s.source != "synthetic" for s in sources):
        python = all(s.paths and all(p.endswith(".py") for p in s.paths) for s in sources)
        prompt = q("def main(") if python else '""'
        out.append(f"kiln generate {q(str(run))} --prompt {prompt} --max-new-tokens 100")
    tasks = list(config.train.eval_tasks) or [
        f"perplexity:{p}"
        for s in sources
        if s.source in ("text", "jsonl", "parquet") and s.format == "text" and s.field == "text"
        for p in s.eval_paths
    ]
    if tasks:
        out.append(f"kiln eval {q(str(run))} {' '.join(q(t) for t in tasks)}")
    # Outside train.output_dir, whose directories are runs (kiln compare lists them).
    out.append(f"kiln export-hf {q(str(run))} --out {q('exported/' + config.train.run_name)}")
    return out


def _width(stream) -> int | None:
    """None (the terminal's width) on a terminal, else wide enough for any path."""
    return None if stream.isatty() else 1000


class RunConsole:
    """Process 0's console: step lines on stdout, everything else on stderr, a bar on a terminal."""

    def __init__(
        self, total: int, start_step: int, *, progress: bool, started: float | None = None
    ):
        self.total = total
        # Elapsed from `started` (time.perf_counter() at start-up); the ETA from the steps done
        # since the first one arrived (compilation left out).
        self.started = time.perf_counter() if started is None else started
        self.first: tuple[int, float] | None = None  # (step, perf_counter()) of the first
        # stdout (looked up at each print, so a live bar can route it); a file or pipe gets
        # the summary at its natural width rather than wrapped or cropped at 80 columns.
        self.out = Console(soft_wrap=True, highlight=False, markup=False, width=_width(sys.stdout))
        self.err = Console(
            stderr=True, soft_wrap=True, highlight=False, markup=False, width=_width(sys.stderr)
        )
        self.bar = None
        if progress and sys.stderr.isatty():
            self.bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.err,
                # Step lines printed to a terminal stdout go above the bar; stdout redirected
                # to a file keeps them (the bar stays on the terminal).
                redirect_stdout=sys.stdout.isatty(),
                redirect_stderr=True,
            )
            self.task = self.bar.add_task("train", total=total, completed=start_step, status="")
            self.bar.start()

    def status(self, text: str) -> None:
        """Say what is happening now: the bar's status field, or a line on stderr."""
        if self.bar is not None:
            self.bar.update(self.task, status=text)
        elif text:
            self.info(text)

    def advance(self, step: int, status: str) -> None:
        if self.first is None:
            self.first = (step, time.perf_counter())
        if self.bar is not None:
            self.bar.update(self.task, completed=step, status=status)

    def step(self, step: int, values: Mapping[str, float]) -> None:
        evals = {k: v for k, v in values.items() if k.startswith("eval/")}
        rest = {k: v for k, v in values.items() if not k.startswith("eval/")}
        if evals:  # a step's evaluation on a line of its own, first
            self.out.print(step_line(step, self.total, evals))
        if rest:
            # Elapsed time and ETA, unless a progress bar beside the line shows them.
            timing = "" if self.bar is not None and sys.stdout.isatty() else self.timing(step)
            self.out.print(step_line(step, self.total, rest) + timing)

    def timing(self, step: int) -> str:
        """'  elapsed H:MM:SS  ETA H:MM:SS' after `step` (no ETA before a second step arrived)."""
        now = time.perf_counter()
        text = f"  elapsed {clock(now - self.started)}"
        if self.first is not None and step > self.first[0]:
            per_step = (now - self.first[1]) / (step - self.first[0])
            text += f"  ETA {clock(per_step * (self.total - step))}"
        return text

    def info(self, message: str) -> None:
        self.err.print(f"kiln: {message}")

    def warn(self, message: str) -> None:
        self.err.print(f"kiln: warning: {message}")

    def summary(self, s: Summary) -> None:
        self.close()  # the table goes below the finished bar
        self.out.print(summary_text(s))
        self.out.print("next:")
        for command in s.next:
            self.out.print(f"  {command}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
