"""Where metrics go: TensorBoard (tensorboardX), metrics.jsonl, the console, optionally W&B;
and MFU."""

from __future__ import annotations

import json
import os
import re
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import jax

from kiln.config import Config
from kiln.errors import write_error
from kiln.training.console import RunConsole, Summary
from kiln.training.tracking import WandbMirror
from kiln.util.atomic import write_whole
from kiln.util.humanize import plural
from kiln.util.tensorboard import tensorboardx

# Dense bf16 peak TFLOP/s per device, by the start of `jax.Device.device_kind`.
PEAK_TFLOPS = {
    "NVIDIA B200": 2250.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H100": 989.0,
    "NVIDIA A100": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA L4": 121.0,
    "NVIDIA A10G": 70.0,
    "NVIDIA V100": 125.0,
    "TPU v6": 918.0,
    "TPU v5p": 459.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v4": 275.0,
    "TPU v3": 123.0,
}


def peak_tflops(config: Config) -> tuple[float | None, str]:
    """Peak TFLOP/s of one device and where the number came from; None when it is unknown."""
    if config.logging.peak_tflops_per_device is not None:
        return config.logging.peak_tflops_per_device, "logging.peak_tflops_per_device"
    kind = jax.devices()[0].device_kind
    for name, tflops in PEAK_TFLOPS.items():
        if kind.startswith(name):
            return tflops, f"the table entry for {name}"
    return None, (
        f"the peak of device {kind!r} is unknown; set logging.peak_tflops_per_device for perf/mfu"
    )


def perf_metrics(
    seconds_per_step: float, tokens_per_step: int, flops_per_token: float, config: Config
):
    """perf/* figures of one step; perf/mfu against the device's peak, when it is known."""
    tokens_per_sec = tokens_per_step / seconds_per_step
    tflops = flops_per_token * tokens_per_sec / jax.device_count() / 1e12
    out = {
        "perf/step_time_seconds": seconds_per_step,
        "perf/tokens_per_sec": tokens_per_sec,
        "perf/per_device_tflops_per_sec": tflops,
    }
    peak = peak_tflops(config)[0]
    if peak is not None:
        out["perf/mfu"] = tflops / peak
    return out


class MetricsLogger:
    """TensorBoard events, metrics.jsonl (flushed every write) and the console of process 0."""

    def __init__(
        self,
        run_dir: Path,
        config: Config,
        *,
        enabled: bool,
        start_step: int,
        started: float | None = None,
    ):
        self.enabled, self.total, self.run_dir = enabled, config.train.steps, run_dir
        self.tokens_per_sec = None
        self.last: dict[str, float] = {}  # the latest value of every tag, for the summary
        if not enabled:
            return
        self.console = RunConsole(
            self.total, start_step, progress=config.logging.progress, started=started
        )
        # A resumed run repeats the steps after its checkpoint: what the interrupted run logged
        # for them is dropped, so each step is recorded once (TensorBoard: events from
        # purge_step on are hidden when read).
        self.jsonl_path = run_dir / "metrics.jsonl"
        try:
            trimmed = drop_rows_after(self.jsonl_path, start_step)
            self.tb = tensorboardx().SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=start_step + 1
            )
            # Unbuffered: each row is one write of whole bytes, undone if the write fails.
            self.jsonl = open(self.jsonl_path, "ab", buffering=0)  # noqa: SIM115 - see close()
        except OSError as e:
            raise write_error(e, e.filename or run_dir) from None
        self.wandb = None
        if config.logging.wandb is not None:
            self.wandb = WandbMirror(run_dir, config)
        peak, source = peak_tflops(config)
        devices = plural(jax.device_count(), "device")
        mfu = f"perf/mfu against {peak:g} TFLOP/s per device ({source})" if peak else source
        self.info(f"run directory {run_dir}; {plural(self.total, 'step')} on {devices}; {mfu}")
        for note in trimmed.notes(self.jsonl_path):
            self.info(note)

    def progress(self, step: int, values: dict[str, float]) -> None:
        if self.enabled:
            self.tokens_per_sec = values.get("perf/tokens_per_sec", self.tokens_per_sec)
            status = f"loss {values['learning/loss']:.4f}"
            if self.tokens_per_sec:
                status += f"  {self.tokens_per_sec:,.0f} tok/s"
            self.console.advance(step, status)

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.tokens_per_sec = values.get("perf/tokens_per_sec", self.tokens_per_sec)
        self.last.update(values)
        append_line(self.jsonl, json.dumps({"step": step, **values}).encode(), self.jsonl_path)
        try:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()
        except OSError as e:
            raise write_error(e, self.jsonl_path.parent / "tensorboard") from None
        if self.wandb is not None:
            self.wandb.log(step, values)
        self.console.step(step, values)

    def status(self, message: str) -> None:
        if self.enabled:
            self.console.status(message)

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.info(message)

    def warn(self, message: str) -> None:
        if self.enabled:
            self.console.warn(message)

    def summary(self, summary: Summary) -> None:
        if self.enabled:
            self.console.summary(summary)

    def close(self) -> None:
        if not self.enabled:
            return
        self.console.close()
        self.tb.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.close()


def append_line(fh, line: bytes, path: Path) -> None:
    """Append `line` and a newline to the unbuffered file `fh`, whole or not at all: a failed
    write (a full disk) is cut back off, so no torn row is left for a resume to glue onto."""
    start = fh.seek(0, os.SEEK_END)
    view = memoryview(line + b"\n")
    try:
        while view:
            view = view[fh.write(view) :]
    except OSError as e:
        with suppress(OSError):  # else the torn tail stays; drop_rows_after removes it later
            os.ftruncate(fh.fileno(), start)
        raise write_error(e, path) from None


# The start of a row as MetricsLogger writes it: the step of a damaged line, when still legible.
_ROW_START = re.compile(rb'\{"step": (\d+)[,}]')
DAMAGED_SUFFIX = ".damaged"


class Damaged(NamedTuple):
    """A line of metrics.jsonl that is not a whole JSON row: its number, its step if still
    legible, and the steps of the intact rows before and after it (None: there is none)."""

    line: int
    step: int | None
    before: int | None
    after: int | None

    def where(self) -> str:
        if self.step is not None:
            return f"step {self.step}"
        if self.before is not None and self.after is not None:
            return f"between steps {self.before} and {self.after}"
        return "before any row" if self.before is None else f"after step {self.before}"

    def fate(self, resumed: int) -> str:
        """Whether the resumed run (after checkpoint `resumed`) logs this line's step again."""
        if self.step is not None:
            again = self.step > resumed
            return f"step {self.step} is{'' if again else ' not'} logged again"
        if self.before is not None and self.before >= resumed:
            return f"its step, after {resumed}, is logged again"
        if self.after is not None and self.after <= resumed:
            return f"its step, before {resumed}, is not logged again"
        return f"the run resumes after step {resumed}"


@dataclass
class Trimmed:
    """What a resume from the checkpoint of step `step` took out of metrics.jsonl."""

    step: int
    later: list[int] = field(default_factory=list)  # steps of rows after `step`: logged again
    torn: list[Damaged] = field(default_factory=list)  # damaged lines among `later`
    damaged: list[Damaged] = field(default_factory=list)  # the other damaged lines: `aside`
    aside: Path | None = None

    def notes(self, path: Path) -> list[str]:
        """One line per kind of change, naming the rows and what becomes of them."""
        out = []
        if self.later:
            first, last = self.later[0], self.later[-1]
            steps = f"step {first}" if first == last else f"steps {first}..{last}"
            torn = "".join(f"; line {d.line} ({d.where()}) was damaged" for d in self.torn)
            out.append(
                f"{path.name}: dropped {plural(len(self.later), 'row')} of {steps}, logged after "
                f"step {self.step} by the interrupted run{torn}; they are logged again"
            )
        for d in self.damaged[:3]:
            out.append(
                f"{path.name}: line {d.line} ({d.where()}) is damaged, not a JSON row: moved to "
                f"{self.aside} ({d.fate(self.step)}); every intact row is kept"
            )
        if len(self.damaged) > 3:
            more = plural(len(self.damaged) - 3, "more damaged line")
            out.append(f"{path.name}: {more} moved to {self.aside}")
        return out


def drop_rows_after(path: Path, step: int) -> Trimmed:
    """Keep the intact rows of a metrics.jsonl up to `step`, replacing the file atomically.

    Rows after `step` are dropped (the resumed run logs them again), and so is a damaged line
    (torn by a kill, or unreadable) whose step is still legible and after `step`; any other
    damaged line is appended to `path` + ".damaged" rather than lost. Returns what was done.
    """
    done = Trimmed(step)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return done
    lines = data.split(b"\n")
    if lines[-1] == b"":  # after the last newline: nothing, or a half-written row
        lines.pop()
    steps = [_step_of(line) for line in lines]
    kept, aside = [], []
    for number, (line, row_step) in enumerate(zip(lines, steps), 1):
        if not line.strip():  # a blank line holds nothing to keep
            continue
        if row_step is not None:
            if row_step <= step:
                kept.append(line)
            else:
                done.later.append(row_step)
            continue
        legible = _ROW_START.match(line)
        damaged = Damaged(
            number,
            None if legible is None else int(legible.group(1)),
            next((s for s in reversed(steps[: number - 1]) if s is not None), None),
            next((s for s in steps[number:] if s is not None), None),
        )
        if damaged.step is not None and damaged.step > step:
            done.later.append(damaged.step)
            done.torn.append(damaged)
        else:
            done.damaged.append(damaged)
            aside.append(line)
    if not data or (len(kept) == len(lines) and data.endswith(b"\n")):
        return done
    if aside:
        done.aside = path.with_name(path.name + DAMAGED_SUFFIX)
        with open(done.aside, "ab") as fh:
            fh.writelines(line + b"\n" for line in aside)
            fh.flush()
            os.fsync(fh.fileno())
    write_whole(path, b"".join(line + b"\n" for line in kept))  # or metrics.jsonl untouched
    return done


def _step_of(line: bytes) -> int | None:
    """The step of a metrics.jsonl row; None for a line that is not a whole row."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
