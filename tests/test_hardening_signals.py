"""Signals as a user sends them: every command stopped mid-work (`kiln generate`, `eval`,
`config --summary`, `compile --peak-buffers`, `import-hf`, `export-hf`) says so in one line and
leaves no partial output, nor XLA's dump; Ctrl-C twice in a run says what the same command does
next, releases the run's lock, and the same command then does it."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import (
    REPO,
    USER_XLA_FLAGS,
    communicate,
    cpu_seconds,
    kiln_main,
    start_kiln,
    wait_until,
    write_config,
)
from kiln.runs.checkpoint import latest_complete_step

RUN = {
    "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "max_seq_len": 64},
    "data": {"source": "synthetic", "seq_len": 32},
    "optim": {"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0},
    "train": {"run_name": "r", "global_batch_size": 8, "log_every_steps": 1, "steps": 2},
    "checkpoint": {"every_steps": 0},
}  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step run with its checkpoint, trained in this process."""
    root = tmp_path_factory.mktemp("trained")
    config = write_config(root / "run.yaml", RUN, train={"output_dir": str(root / "runs")})
    proc = kiln_main("train", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "runs" / "r"


def wait_for(stream, start: str) -> list[str]:
    """Lines of `stream` up to and including the first one starting with `start`."""
    seen = []
    for line in stream:
        seen.append(line)
        if line.startswith(start):
            return seen
    raise AssertionError(f"no line starting with {start!r}:\n" + "".join(seen[-30:]))


# Enough work that the command is still at it when the signal arrives after its progress line:
# compiling and decoding 512 rows of 60 tokens; scoring a 400 kB text file in 32-token windows.
COMMANDS = {
    "generate": (
        ["--prompt", "x", "--num-samples", "512", "--max-new-tokens", "60", "--temperature", "1"],
        "kiln: generating 512 completions",
    ),
    "eval": (["perplexity:{text}"], "kiln: scoring 1 task"),
}
SIGNALS = {"SIGTERM": (signal.SIGTERM, 143, "kiln: stopped by SIGTERM"),
           "SIGINT": (signal.SIGINT, 130, "kiln: interrupted")}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", SIGNALS)
@pytest.mark.parametrize("command", COMMANDS)
def test_generate_and_eval_stopped_by_a_signal_say_so_and_write_nothing(
    trained, tmp_path, command, name
):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 9000)
    args, progress = COMMANDS[command]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / ("o.jsonl" if command == "generate" else "e.json")
    args = [a.format(text=text) for a in args]
    proc = start_kiln(command, trained, *args, "--out", out)
    try:
        wait_for(proc.stderr, progress)
        signum, code, line = SIGNALS[name]
        proc.send_signal(signum)
        stdout, rest = communicate(proc)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == code, rest[-3000:]
    assert rest.splitlines() == [line], rest[-3000:]  # one line, no traceback
    assert stdout == ""
    assert list(out_dir.iterdir()) == []  # no --out, no temporary file beside it


@pytest.fixture(scope="module")
def hf_model(trained, tmp_path_factory) -> Path:
    """The trained run exported as a Hugging Face model directory, in this process."""
    out = tmp_path_factory.mktemp("hf") / "llama"
    proc = kiln_main("export-hf", trained, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def stop_at_work(proc: subprocess.Popen, working, signum: int) -> tuple[str, str]:
    """Send `signum` once `working()` holds; (stdout, stderr) to the end of both, which comes
    after the process and anything that removes its files on its way out have ended."""
    try:
        wait_until(working, proc, "the command at work")
        proc.send_signal(signum)
        return communicate(proc)
    finally:
        proc.kill()
        proc.wait()


def used_cpu(proc: subprocess.Popen, seconds: float):
    """Whether `proc` has used more than `seconds` of CPU time."""
    return lambda: cpu_seconds(proc.pid) > seconds


def listing(root: Path) -> list[str]:
    """Every file and directory under `root`, as paths relative to it (links not followed)."""
    return sorted(
        str(Path(top, name).relative_to(root))
        for top, dirs, files in os.walk(root)
        for name in dirs + files
    )


def staging_of(out: Path):
    """Whether the staging directory of `out` exists (beside a new `out`, inside an existing
    one): the command is writing `out`."""
    return lambda: any(out.parent.glob(f".{out.name}.partial-*")) or any(out.glob(".partial-*"))


TINY = REPO / "configs" / "tiny.yaml"
WEIGHTS = ["config.json", "model.safetensors"]  # what export-hf writes for a byte-level run
# XLA's own flags, so that compiling takes a user's time (several CPU seconds) and the signal
# comes while it runs; no persistent cache, which would skip the compile.
COMPILING = {"XLA_FLAGS": USER_XLA_FLAGS, "JAX_COMPILATION_CACHE_DIR": None}


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, name",
    [
        ("config --summary", "SIGTERM"),
        ("import-hf", "SIGTERM"),
        ("import-hf", "SIGINT"),
        ("export-hf", "SIGTERM"),
    ],
)
def test_every_command_stopped_by_a_signal_says_so_and_leaves_nothing(
    trained, hf_model, tmp_path, command, name
):
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    if command == "config --summary":
        args, out = ("config", TINY, "--summary"), None
        env |= COMPILING
    elif command == "import-hf":
        out = work / "new" / "out"  # its parent is made by the command, and removed again
        args = ("import-hf", hf_model, "--out", out)
    else:  # an existing empty --out, here a link to one (or a mount point): written inside
        (work / "empty").mkdir()
        out = work / "link"
        out.symlink_to(work / "empty")
        args = ("export-hf", trained, "--out", out)
    before = listing(work)
    proc = start_kiln(*args, cwd=work, env=env)
    # Writing its output, or past start-up and importing JAX: lowering or compiling the step.
    working = used_cpu(proc, 2.0) if out is None else staging_of(out)
    signum, code, line = SIGNALS[name]
    stdout, stderr = stop_at_work(proc, working, signum)
    assert proc.returncode == code, stderr[-3000:]
    assert stderr.splitlines() == [line], stderr[-3000:]  # one line, no traceback
    assert stdout == ""
    # No output, no staging directory, no parent made; nothing in the temporary directory.
    assert listing(work) == before
    assert listing(tmp) == []
    if command == "export-hf":  # the same command then writes into the directory linked to
        assert kiln_main(*args).returncode == 0
        assert listing(work) == sorted([*before, *(f"empty/{name}" for name in WEIGHTS)])


@pytest.mark.slow
@pytest.mark.parametrize("name", SIGNALS)
def test_compile_peak_buffers_stopped_by_a_signal_removes_the_xla_dump(tmp_path, name):
    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def dumping() -> bool:  # XLA's compile threads are writing the dump
        with contextlib.suppress(FileNotFoundError):  # removed as the command ended
            return any(len(list(d.iterdir())) >= 50 for d in tmp.glob("kiln-xla-dump-*"))
        return False

    args = ("compile", TINY, "--devices", "8", "--peak-buffers", "3")
    proc = start_kiln(*args, cwd=tmp_path, env={"TMPDIR": str(tmp), **COMPILING})
    signum, code, line = SIGNALS[name]
    stdout, stderr = stop_at_work(proc, dumping, signum)
    assert proc.returncode == code, stderr[-3000:]
    assert stderr.splitlines() == [line], stderr[-3000:]
    assert stdout == ""
    assert list(tmp.iterdir()) == []  # the dump, written to while the signal came, is gone


def first_steps(proc: subprocess.Popen) -> None:
    """Ctrl-C at step 3, and again as soon as the run has said it will stop with a checkpoint."""
    wait_for(proc.stdout, "step 3/")
    proc.send_signal(signal.SIGINT)
    wait_for(proc.stdout, "kiln: SIGINT: stopping after this step with a checkpoint")
    proc.send_signal(signal.SIGINT)  # at once: the step and its save are still going


@pytest.mark.slow
@pytest.mark.parametrize("resumed", [False, True], ids=["before_any_checkpoint", "resumed_run"])
def test_ctrl_c_twice_says_what_the_same_command_does_next_and_releases_the_lock(
    trained, tmp_path, resumed
):
    runs = tmp_path / "runs"
    if resumed:  # the run holds the checkpoint of step 2, and goes on from it
        shutil.copytree(trained, runs / "r")
    config = write_config(tmp_path / "run.yaml", RUN, train={"output_dir": str(runs)})
    run_dir = runs / "r"
    proc = start_kiln("train", config, "train.steps=100000", merged=True)
    try:
        first_steps(proc)
        rest = communicate(proc)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    if resumed:
        way = "run the same command again to resume from step 2"
    else:
        way = "no checkpoint was saved yet: run the same command again to start over"
    assert last == f"kiln: interrupted again: exiting now without a checkpoint; {way}", rest
    assert "Traceback" not in rest
    assert latest_complete_step(run_dir / "checkpoints") == (2 if resumed else None)
    assert not (run_dir / "kiln.lock").exists()
    logged = (run_dir / "metrics.jsonl").read_text()
    assert logged  # the steps before the interrupt were logged

    # The same command (a shorter run here) does what the line said.
    again = kiln_main("train", config, "train.steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if resumed:
        assert f"kiln: resuming from step 2 ({run_dir / 'checkpoints' / '2'})" in again.stderr
        assert steps == [1, 2, 3, 4]
    else:
        assert "starting over from step 0" in again.stderr, again.stderr
        assert (run_dir / "restart-1" / "metrics.jsonl").read_text() == logged  # nothing lost
        assert steps == [1, 2, 3, 4]  # no row of the interrupted run stays
    assert not (run_dir / "kiln.lock").exists()
