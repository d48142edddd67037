"""`kiln compare`: metrics of several runs side by side, one panel per metric, one line per run.

A run directory is read from its `metrics.jsonl`, or, when it has none, from the TensorBoard
event files in its `tensorboard/` folder (parsed with the protobuf classes tensorboardX ships,
so the `tensorboard` package is not needed). Smoothing is a trailing moving average over the
last K logged points.
"""

from __future__ import annotations

import fnmatch
import io
import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kiln.errors import KilnError, write_error
from kiln.util.atomic import write_whole
from kiln.util.files import check_creatable
from kiln.util.humanize import duration
from kiln.util.tensorboard import tensorboardx

# tag -> (steps, values), steps increasing; a step logged twice (e.g. re-logged after a
# resume) keeps its last value.
Series = dict[str, tuple[np.ndarray, np.ndarray]]

PANEL_INCHES = (5.0, 3.4)
DPI = 100


def _collect(points: dict[str, dict[int, float]]) -> Series:
    """Sort each tag's {step: value} into (steps, values) arrays."""
    series = {}
    for tag, by_step in points.items():
        steps = sorted(by_step)
        series[tag] = (np.asarray(steps, np.int64), np.asarray([by_step[s] for s in steps]))
    return series


def read_jsonl(path: Path) -> Series:
    """Scalars of a metrics.jsonl: one JSON object per logged step, `step` plus tag keys."""
    points: dict[str, dict[int, float]] = {}
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # a run still writing its last line
                break
            raise KilnError(f"{path}:{i + 1}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise KilnError(f"{path}:{i + 1}: expected a JSON object with a 'step' key")
        step = int(row["step"])
        for tag, value in row.items():
            if tag != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                points.setdefault(tag, {})[step] = float(value)
    return _collect(points)


def _tfrecords(path: Path):
    """Payloads of a TFRecord file (length, crc, data, crc); stops at a truncated last record."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        start, end = pos + 12, pos + 12 + length
        if end + 4 > len(data):
            return
        yield data[start:end]
        pos = end + 4


def _scalar(value) -> float | None:
    """The float of a Summary.Value: simple_value, or a scalar tensor (newer writers)."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor"):
        t = value.tensor
        for field in (t.float_val, t.double_val, t.int_val, t.int64_val):
            if len(field) == 1:
                return float(field[0])
        dtypes = {1: np.float32, 2: np.float64, 3: np.int32, 9: np.int64}  # types.proto
        if t.tensor_content and t.dtype in dtypes:
            arr = np.frombuffer(t.tensor_content, dtypes[t.dtype])
            if arr.size == 1:
                return float(arr[0])
    return None


def read_events(folder: Path) -> Series:
    """Scalars of every TensorBoard event file in `folder`, files in name (= time) order."""
    from google.protobuf.message import DecodeError

    Event = tensorboardx().proto.event_pb2.Event

    points: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for record in _tfrecords(path):
            try:
                event = Event.FromString(record)
            except DecodeError:
                raise KilnError(f"{path}: not a TensorBoard event file") from None
            for value in event.summary.value:
                x = _scalar(value)
                if x is not None:
                    points.setdefault(value.tag, {})[int(event.step)] = x
    return _collect(points)


def read_run(run_dir: str | Path) -> Series:
    """Every scalar a run logged: metrics.jsonl if present, else its TensorBoard events."""
    run = Path(run_dir)
    if not run.is_dir():
        parent = run.parent if str(run.parent) else Path(".")
        runs = (
            sorted(p.name for p in parent.iterdir() if p.is_dir() and _has_metrics(p))
            if parent.is_dir()
            else []
        )
        where = f"runs in {parent}/: {', '.join(runs)}" if runs else f"no runs in {parent}/"
        raise KilnError(f"run directory {run} not found ({where})")
    if (run / "metrics.jsonl").is_file():
        return read_jsonl(run / "metrics.jsonl")
    events = run / "tensorboard"
    if events.is_dir() and any(events.glob("events.out.tfevents.*")):
        return read_events(events)
    raise KilnError(f"{run}: no metrics.jsonl and no TensorBoard events in {events}/")


def _has_metrics(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "tensorboard").is_dir()


def run_names(run_dirs: Sequence[str | Path]) -> list[str]:
    """Legend names: the directory name (= train.run_name), or the path where names repeat."""
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(d) for d in run_dirs]


def expand_metrics(run_dirs: Sequence[str | Path], metrics: Sequence[str]) -> list[str]:
    """`metrics` with each pattern holding '*' (e.g. eval/loss/*, every source of a mixture)
    replaced by the tags of any run that match it, sorted; a pattern nothing matches is an error."""
    if not any("*" in m for m in metrics):
        return list(metrics)
    tags = sorted({tag for run_dir in run_dirs for tag in read_run(run_dir)})
    out: list[str] = []
    for pattern in metrics:
        found = fnmatch.filter(tags, pattern) if "*" in pattern else [pattern]
        if not found:
            raise KilnError(
                f"--metrics: no metric of {', '.join(map(str, run_dirs))} matches {pattern!r}; "
                f"available: {', '.join(tags)}"
            )
        out += [t for t in found if t not in out]
    return out


def load_runs(
    run_dirs: Sequence[str | Path], metrics: Sequence[str], notes: list[str] | None = None
) -> dict[str, Series]:
    """{run name: {metric: (steps, values)}} with the metrics each run has; a metric that some
    runs lack is a line in `notes`, one that no run has is a KilnError, as is a missing run."""
    if not run_dirs:
        raise KilnError("compare: give at least one run directory")
    if not metrics:
        raise KilnError("compare: --metrics is empty; give tags such as learning/loss")
    runs, available = {}, {}
    for name, run_dir in zip(run_names(run_dirs), run_dirs, strict=True):
        series = read_run(run_dir)
        runs[name] = {tag: series[tag] for tag in metrics if tag in series}
        available[run_dir] = sorted(series)
    for tag in metrics:
        lacking = [d for d, s in zip(run_dirs, runs.values()) if tag not in s]
        if len(lacking) == len(run_dirs):
            first = run_dirs[0]
            others = "" if len(run_dirs) == 1 else "; no other run has it either"
            raise KilnError(
                f"{first}: no metric {tag!r}; available: {', '.join(available[first])}{others}"
            )
        if notes is not None:
            notes += [f"{d}: no metric {tag!r}; its panel shows the other runs" for d in lacking]
    return runs


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average: point i is the mean of points max(0, i-window+1) .. i."""
    if window <= 1:
        return values
    csum = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    i = np.arange(1, len(values) + 1)
    lo = np.maximum(0, i - window)
    return (csum[i] - csum[lo]) / (i - lo)


def plot(runs: dict[str, Series], metrics: Sequence[str], *, window: int = 1, log_scale=False):
    """A matplotlib Figure (Agg canvas): one panel per metric titled by its tag, one line per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(2, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(PANEL_INCHES[0] * ncols, PANEL_INCHES[1] * nrows), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(metrics) :]:
        fig.delaxes(ax)
    for ax, tag in zip(axes, metrics, strict=False):
        for name, series in runs.items():
            if tag not in series:
                continue
            steps, values = series[tag]
            label = name
            if log_scale and not np.any(values > 0):
                label += " (no values > 0: not on log scale)"
            marker = "." if len(steps) <= 12 else None  # sparse series (eval/*) show points
            ax.plot(steps, smooth(values, window), label=label, linewidth=1.4, marker=marker)
        if log_scale:
            ax.set_yscale("log", nonpositive="mask")
            _readable_log_ticks(ax)
        ax.set_title(tag, fontsize=11)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if window > 1:
        fig.suptitle(f"trailing mean over {window} logged points", fontsize=9)
    fig.tight_layout()
    return fig


def _readable_log_ticks(ax) -> None:
    """Log-scale ticks labelled as plain numbers (2, 3, 5 rather than 2x10^0), denser when
    the data span less than a decade, so a loss axis from 1.7 to 6 still has labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = ax.get_ylim()
    decades = math.log10(hi / lo) if lo > 0 and hi > lo else 1.0
    subs = tuple(range(1, 10)) if decades < 1 else (1.0, 2.0, 5.0) if decades < 4 else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def final_values(runs: dict[str, Series], metrics: Sequence[str], window: int = 1) -> str:
    """A text table of each run's last value (and its step) for every metric, smoothed as the
    plot is (the trailing mean over `window` logged points); '-' where a run lacks the metric."""
    name_w = max(len("run"), *(len(n) for n in runs))
    cols = [max(len(t), 18) for t in metrics]
    what = (
        "last logged value"
        if window <= 1
        else f"last value, trailing mean over {window} logged points as plotted"
    )
    lines = [
        f"{what} @ step",
        "  ".join([f"{'run':<{name_w}}", *(f"{t:>{w}}" for t, w in zip(metrics, cols))]),
    ]
    for name, series in runs.items():
        cells = []
        for tag, w in zip(metrics, cols):
            if tag not in series:
                cells.append(f"{'-':>{w}}")
                continue
            steps, values = series[tag]
            last = smooth(values, window)[-1]
            cells.append(f"{f'{last:.5g} @{steps[-1]}':>{w}}")
        lines.append("  ".join([f"{name:<{name_w}}", *cells]))
    return "\n".join(lines)


# The goodput table's columns: (tag, heading), seconds unless the heading says otherwise.
GOODPUT_COLUMNS = (
    ("goodput/wall_seconds", "wall"),
    ("goodput/goodput", "goodput"),
    ("goodput/step_seconds", "steps"),
    ("goodput/init_seconds", "start-up"),
    ("goodput/compile_seconds", "compile"),
    ("goodput/data_seconds", "data"),
    ("goodput/checkpoint_seconds", "checkpoints"),
    ("goodput/eval_seconds", "eval"),
    ("goodput/other_seconds", "other"),
    ("goodput/lost_seconds", "lost"),
    ("goodput/lost_steps", "lost steps"),
    ("goodput/attempts", "attempts"),
)


def goodput_table(run_dirs: Sequence[str | Path]) -> str | None:
    """Where each run's wall time went, over all its attempts (the goodput/* figures of its last
    row); None when no run has them (runs of kiln before goodput accounting)."""
    found = {}
    for name, run_dir in zip(run_names(run_dirs), run_dirs, strict=True):
        series = read_run(run_dir)
        found[name] = {
            tag: (int(series[tag][0][-1]), float(series[tag][1][-1]))
            for tag, _ in GOODPUT_COLUMNS
            if tag in series
        }
    if not any(found.values()):
        return None

    def cell(tag: str, value: float) -> str:
        if tag == "goodput/goodput":
            return f"{value:.1%}"
        if tag in ("goodput/lost_steps", "goodput/attempts"):
            return f"{value:.0f}"
        return duration(value)

    table = [["run", *(heading for _, heading in GOODPUT_COLUMNS), "@ step"]]
    for name, figures in found.items():
        cells = [cell(t, figures[t][1]) if t in figures else "-" for t, _ in GOODPUT_COLUMNS]
        step = max((s for s, _ in figures.values()), default=None)
        table.append([name, *cells, "-" if step is None else str(step)])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["goodput: wall time over every attempt of each run, the slowest process's"]
    for row in table:
        first = f"{row[0]:<{widths[0]}}"
        lines.append("  ".join([first, *(f"{c:>{w}}" for c, w in zip(row[1:], widths[1:]))]))
    return "\n".join(lines)


def check_out(out: str | Path) -> None:
    """KilnError unless `out` names an image file, of a format matplotlib writes, in a directory
    kiln can create or write; checked before any run is read."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out = Path(out)
    formats = FigureCanvasAgg.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        raise KilnError(f"--out {out}: unknown image suffix; allowed: {', '.join(sorted(formats))}")
    if out.is_dir():
        raise KilnError(f"--out: {out} is a directory; allowed: the path of an image file")
    check_creatable(out.absolute().parent, "--out")


def compare(
    run_dirs: Sequence[str | Path],
    metrics: Sequence[str],
    out: str | Path,
    *,
    window: int = 1,
    log_scale: bool = False,
    notes: list[str] | None = None,
):
    """Plot `metrics` of `run_dirs` into `out` (format from its suffix) and return the Figure;
    `notes` receives a line for each metric a run lacks."""
    if window < 1:
        raise KilnError(f"--smooth: got {window}; must be >= 1 (1 = no smoothing)")
    check_out(out)
    out = Path(out)
    metrics = expand_metrics(run_dirs, metrics)
    runs = load_runs(run_dirs, metrics, notes)
    fig = plot(runs, metrics, window=window, log_scale=log_scale)
    image = io.BytesIO()
    fig.savefig(image, format=out.suffix.lstrip(".").lower())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_whole(out, image.getvalue())  # a failed write or a signal: no partial image
    except OSError as e:
        raise write_error(e, out, then="plot the runs") from None
    return fig
