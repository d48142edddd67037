"""Where metrics go: TensorBoard (tensorboardX), metrics.jsonl, the console, optionally W&B;
and MFU."""

from __future__ import annotations

import json
import math
import os
from contextlib import suppress
from pathlib import Path

import jax

from kiln.config import Config
from kiln.errors import write_error
from kiln.training.console import RunConsole, Summary
from kiln.training.tracking import WandbMirror
from kiln.util.humanize import plural

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

    def __init__(self, run_dir: Path, config: Config, *, enabled: bool, start_step: int):
        self.enabled, self.total, self.run_dir = enabled, config.train.steps, run_dir
        self.tokens_per_sec = None
        self.last: dict[str, float] = {}  # the latest value of every tag, for the summary
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        self.console = RunConsole(self.total, start_step, progress=config.logging.progress)
        # A resumed run repeats the steps after its checkpoint: what the interrupted run logged
        # for them is dropped, so each step is recorded once (TensorBoard: events from
        # purge_step on are hidden when read).
        self.jsonl_path = run_dir / "metrics.jsonl"
        try:
            dropped = drop_rows_after(self.jsonl_path, start_step)
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)
            # Unbuffered: each row is one write of whole bytes, undone if the write fails.
            self.jsonl = open(self.jsonl_path, "ab", buffering=0)  # noqa: SIM115 - see close()
        except OSError as e:
            raise write_error(e, run_dir) from None
        self.wandb = None
        if config.logging.wandb is not None:
            self.wandb = WandbMirror(run_dir, config)
        peak, source = peak_tflops(config)
        devices = plural(jax.device_count(), "device")
        mfu = f"perf/mfu against {peak:g} TFLOP/s per device ({source})" if peak else source
        self.info(f"run directory {run_dir}; {plural(self.total, 'step')} on {devices}; {mfu}")
        if dropped:
            self.info(
                f"metrics.jsonl: dropped {plural(dropped, 'row')} logged after step "
                f"{start_step} by the interrupted run (or left half-written); they are logged again"
            )

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


def drop_rows_after(path: Path, step: int) -> int:
    """Keep the rows of a metrics.jsonl up to `step`, replacing the file atomically; returns how
    many rows were dropped: later steps, and a torn (unterminated) or unreadable line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    *complete, torn = data.split(b"\n")  # after the last newline: a half-written row, or b""
    kept = [line for line in complete if _step_of(line) <= step]
    dropped = len(complete) - len(kept) + bool(torn)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.writelines(line + b"\n" for line in kept)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)  # metrics.jsonl itself is untouched
            raise
        os.replace(tmp, path)
    return dropped


def _step_of(line: bytes) -> float:
    """The step of a metrics.jsonl row; infinity for a line that is not one (dropped)."""
    try:
        row = json.loads(line)
    except ValueError:
        return math.inf
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else math.inf
