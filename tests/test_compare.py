"""`kiln compare`: panels and lines of the figure, smoothing, both input formats, errors."""

import json
import shutil
import struct

import numpy as np
import pytest

from conftest import REPO, kiln, kiln_main
from kiln.commands.compare import compare, read_run, smooth
from kiln.errors import KilnError

METRICS = [
    "learning/loss",
    "learning/z_loss",
    "learning/lm_head_norm",
    "learning/final_norm_scale",
]
STEPS = list(range(10, 110, 10))


def fake_values(seed: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    return {tag: list(rng.uniform(0.5, 5.0, len(STEPS))) for tag in METRICS}


def write_run(run_dir, values, extra_lines=()):
    """A metrics.jsonl as the trainer writes it: one object per step, eval on its own lines."""
    run_dir.mkdir(parents=True)
    lines = [{"step": s, **{t: v[i] for t, v in values.items()}} for i, s in enumerate(STEPS)]
    lines.insert(5, {"step": 50, "eval/loss": 9.0})
    lines += list(extra_lines)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def png_size(path):
    """(width, height) from the IHDR chunk of a PNG file."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def moving_average(values, k):
    """Reference: mean of values[max(0, i-k+1) : i+1], written as a loop."""
    return [float(np.mean(values[max(0, i - k + 1) : i + 1])) for i in range(len(values))]


@pytest.fixture
def two_runs(tmp_path):
    a, b = fake_values(0), fake_values(1)
    write_run(tmp_path / "run_a", a)
    write_run(tmp_path / "run_b", b)
    return tmp_path, a, b


def test_figure_has_one_panel_per_metric_and_one_line_per_run(two_runs):
    root, a, b = two_runs
    out = root / "plots" / "cmp.png"
    fig = compare([root / "run_a", root / "run_b"], METRICS, out)
    assert [ax.get_title() for ax in fig.axes] == METRICS
    for ax, tag in zip(fig.axes, METRICS, strict=True):
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == ["run_a", "run_b"]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["run_a", "run_b"]
        for line, values in zip(lines, (a, b), strict=True):
            np.testing.assert_array_equal(line.get_xdata(), STEPS)
            np.testing.assert_allclose(line.get_ydata(), values[tag], rtol=1e-12)
        assert ax.get_yscale() == "linear"
    # 2 x 2 panels of 5.0 x 3.4 inches at 100 dpi
    assert png_size(out) == (1000, 680)


def test_smoothing_is_a_trailing_moving_average_and_log_scale_applies(two_runs):
    root, a, _ = two_runs
    out = root / "cmp.png"
    fig = compare([root / "run_a", root / "run_b"], METRICS[:3], out, window=3, log_scale=True)
    assert len(fig.axes) == 3  # the fourth cell of the 2 x 2 grid is removed
    assert png_size(out) == (1000, 680)
    for ax, tag in zip(fig.axes, METRICS, strict=False):
        assert ax.get_yscale() == "log"
        np.testing.assert_allclose(
            ax.get_lines()[0].get_ydata(), moving_average(a[tag], 3), rtol=1e-12
        )
    x = np.array([1.0, 2.0, 6.0, 3.0])
    np.testing.assert_allclose(smooth(x, 2), [1.0, 1.5, 4.0, 4.5])
    np.testing.assert_array_equal(smooth(x, 1), x)


def test_single_metric_is_one_panel(two_runs):
    root, _, _ = two_runs
    fig = compare([root / "run_a"], ["learning/loss"], root / "one.png")
    assert [ax.get_title() for ax in fig.axes] == ["learning/loss"]
    assert png_size(root / "one.png") == (500, 340)


def test_relogged_step_keeps_last_value_and_eval_lines_are_separate(tmp_path):
    values = fake_values(2)
    # A resume from step 80 logs steps 90 and 100 again, and a last line cut off mid-write.
    write_run(
        tmp_path / "r",
        values,
        extra_lines=[{"step": 90, "learning/loss": 0.25}, {"step": 100, "learning/loss": 0.125}],
    )
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write('{"step": 110, "learning/lo')
    series = read_run(tmp_path / "r")
    steps, loss = series["learning/loss"]
    assert list(steps) == STEPS
    assert list(loss) == [*values["learning/loss"][:8], 0.25, 0.125]
    assert list(series["eval/loss"][0]) == [50]
    assert list(series["eval/loss"][1]) == [9.0]


def test_tensorboard_events_when_there_is_no_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboardX import SummaryWriter

    values = fake_values(3)
    run = tmp_path / "tb_run"
    # Two event files, as a resumed run leaves them; the second re-logs step 100.
    for part, steps in enumerate((STEPS, [100])):
        writer = SummaryWriter(str(run / "tensorboard"), filename_suffix=f".{part}")
        for s in steps:
            for tag in METRICS:
                v = values[tag][STEPS.index(s)] + (1.0 if part else 0.0)
                writer.add_scalar(tag, v, s)
        writer.close()
    series = read_run(run)
    assert set(series) == set(METRICS)
    # TensorBoard's own reader is the reference (float32 on disk).
    reference = EventAccumulator(str(run / "tensorboard"))
    reference.Reload()
    for tag in METRICS:
        steps, got = series[tag]
        assert list(steps) == STEPS
        expected = {e.step: e.value for e in reference.Scalars(tag)}
        assert len(expected) == len(STEPS)
        np.testing.assert_allclose(got, [expected[s] for s in STEPS], rtol=1e-7)
        np.testing.assert_allclose(got[:-1], values[tag][:-1], rtol=1e-6)  # float32
        np.testing.assert_allclose(got[-1], values[tag][-1] + 1.0, rtol=1e-6)  # last file wins


def test_library_errors_name_what_is_missing(two_runs):
    root, _, _ = two_runs
    with pytest.raises(KilnError, match=r"no metric 'learning/nope'; available: .*learning/loss"):
        compare([root / "run_a"], ["learning/loss", "learning/nope"], root / "x.png")
    with pytest.raises(KilnError, match=r"--smooth: got 0"):
        compare([root / "run_a"], ["learning/loss"], root / "x.png", window=0)
    with pytest.raises(KilnError, match=r"unknown image suffix"):
        compare([root / "run_a"], ["learning/loss"], root / "x.txt")
    (root / "empty").mkdir()
    with pytest.raises(KilnError, match=r"no metrics.jsonl and no TensorBoard events"):
        compare([root / "empty"], ["learning/loss"], root / "x.png")
    assert not (root / "x.png").exists()


def test_cli_missing_run_dir_or_tag_exits_2_with_one_line(two_runs):
    root, _, _ = two_runs
    proc = kiln("compare", "run_a", "run_c", "--out", "x.png", cwd=root)
    assert proc.returncode == 2
    assert proc.stderr == "kiln: error: run directory run_c not found (runs in ./: run_a, run_b)\n"
    proc = kiln(
        "compare", "run_a", "run_b", "--metrics", "learning/loss,learning/nope", "--out", "x.png",
        cwd=root,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("kiln: error: run_a: no metric 'learning/nope'; available: ")
    assert "learning/final_norm_scale" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not (root / "x.png").exists()


@pytest.mark.slow
def test_end_to_end_on_a_real_run_and_its_tensorboard_copy(tmp_path):
    proc = kiln_main(
        "train", "configs/tiny.yaml", f"train.output_dir={tmp_path}", "train.run_name=real",
        "train.steps=6", "train.log_every_steps=2", "train.eval_every_steps=0",
        "optim.warmup_steps=2", "data.source=synthetic", "data.paths=[]", "data.seq_len=32",
        "model.num_layers=1", "checkpoint.every_steps=0",
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The same run seen only through its TensorBoard events.
    shutil.copytree(tmp_path / "real" / "tensorboard", tmp_path / "events_only" / "tensorboard")
    out = tmp_path / "cmp.png"
    proc = kiln(
        "compare", str(tmp_path / "real"), str(tmp_path / "events_only"),
        "--metrics", ",".join(METRICS), "--out", str(out), "--smooth", "2",
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert png_size(out) == (1000, 680)
    caption, *table = proc.stdout.splitlines()
    assert "trailing mean over 2 logged points as plotted" in caption
    assert table[0].split() == ["run", *METRICS]
    real, events = table[1].split(), table[2].split()
    assert real[0] == "real" and events[0] == "events_only"
    assert real[1:] == events[1:]  # metrics.jsonl and the events hold the same figures
    lines = (tmp_path / "real" / "metrics.jsonl").read_text().splitlines()
    before, last = json.loads(lines[-2]), json.loads(lines[-1])
    assert (before["step"], last["step"]) == (4, 6)
    # The table shows what the plot ends on: the mean of the last 2 logged points.
    mean = {tag: (before[tag] + last[tag]) / 2 for tag in METRICS}
    assert real[1:] == [x for tag in METRICS for x in (f"{mean[tag]:.5g}", "@6")]


def test_a_metric_one_run_lacks_is_a_note_and_the_table_is_smoothed_as_plotted(tmp_path):
    a, b = fake_values(0), fake_values(1)
    del b["learning/lm_head_norm"]
    write_run(tmp_path / "run_a", a)
    write_run(tmp_path / "run_b", b)
    proc = kiln(
        "compare", "run_a", "run_b", "--metrics", "learning/loss,learning/lm_head_norm",
        "--smooth", "3", "--out", "x.png", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stderr
        == "kiln: run_b: no metric 'learning/lm_head_norm'; its panel shows the other runs\n"
    )
    fig = compare(
        [tmp_path / "run_a", tmp_path / "run_b"],
        ["learning/loss", "learning/lm_head_norm"],
        tmp_path / "y.png",
    )
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 1]
    # The table's last values are the plotted (trailing mean over 3) ones, and say so.
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:4]}
    assert "trailing mean over 3" in proc.stdout.splitlines()[0]
    assert float(rows["run_a"][1]) == pytest.approx(
        moving_average(a["learning/loss"], 3)[-1], rel=1e-4
    )  # %.5g
    assert float(rows["run_b"][1]) == pytest.approx(
        moving_average(b["learning/loss"], 3)[-1], rel=1e-4
    )
    assert rows["run_b"][3] == "-"


def test_log_scale_ticks_are_plain_numbers_within_the_data(tmp_path):
    values = {"learning/loss": list(np.linspace(6.0, 1.7, len(STEPS)))}
    write_run(tmp_path / "run_a", values)
    fig = compare([tmp_path / "run_a"], ["learning/loss"], tmp_path / "x.png", log_scale=True)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    label = ax.yaxis.get_major_formatter()
    labels = [(loc, label(loc)) for loc in ax.get_yticks() if lo <= loc <= hi]
    shown = [float(text) for _, text in labels if text]  # plain numbers, not 2x10^0
    assert len(shown) >= 3, labels  # a 1.7..6 axis is labelled 2, 3, 4, 5, 6
    assert all(lo <= v <= hi for v in shown)


def test_version():
    proc = kiln("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("kiln 0.1.0 (jax ")
