"""A run directory survives its faults: one writer, full and read-only disks, Ctrl-C at
start-up, paths that cannot be created, and the CLI's own mistakes are one line each."""

import argparse
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import (
    USER_XLA_FLAGS,
    assert_user_error,
    communicate,
    cpu_seconds,
    kiln,
    kiln_env,
    kiln_main,
    start_kiln,
    wait_until,
    write_config,
)
from kiln.config import config_from_dict
from kiln.data import make_datasets
from kiln.errors import KilnError, RunStopped
from kiln.runs.checkpoint import latest_complete_step
from kiln.runs.lock import RunLock
from kiln.runs.paths import check_output_paths
from kiln.training.metrics import append_line


def small_run(tmp_path: Path, name: str = "r", steps: int = 12, **train) -> dict:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        rng = np.random.default_rng(0)
        corpus.write_text(" ".join(rng.choice(["kiln", "loss", "step", "mesh"], size=3000)))
    return {
        "model": {"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_seq_len": 16},
        "data": {"source": "text", "paths": [str(corpus)], "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
        "mesh": {"fsdp": -1},
        "optim": {"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0},
        "train": {"output_dir": str(tmp_path / "runs"), "run_name": name, "global_batch_size": 8, "log_every_steps": 1, "steps": steps, **train},
        "checkpoint": {"every_steps": 4, "keep": 3, "async_save": True},
        "logging": {"progress": False},
    }  # fmt: skip


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"", "a torn last line"
    table = [json.loads(line) for line in lines[:-1]]
    assert all(isinstance(r, dict) for r in table)
    steps = [r["step"] for r in table]
    assert steps == sorted(set(steps)), steps  # strictly increasing
    return table


def without_timing(table: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "goodput/"))} for r in table]


# ---------------------------------------------------------------------------------------------
# 1. One writer per run directory


HOLDER = """
import sys, time
from pathlib import Path
from kiln.runs.lock import RunLock
lock = RunLock(Path(sys.argv[1]), "kiln train")
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_process_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=kiln_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(KilnError) as refused:
            RunLock(tmp_path, "kiln train").acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert "\n" not in message
    finally:
        holder.kill()  # kill -9: the lock file stays behind, the kernel drops the lock
        holder.wait()
    assert (tmp_path / "kiln.lock").is_file()
    lock = RunLock(tmp_path, "kiln train")
    note = lock.acquire()
    assert f"stale lock of pid {holder.pid}" in note
    lock.release()
    assert not (tmp_path / "kiln.lock").exists()


def test_kiln_train_on_a_locked_run_directory_exits_2_naming_the_holder(tmp_path):
    config = write_config(tmp_path / "c.yaml", small_run(tmp_path))
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    lock = RunLock(run_dir, "kiln train")
    lock.acquire()
    try:
        proc = kiln("train", config)
    finally:
        lock.release()
    assert_user_error(proc, f"in use by pid {os.getpid()} on host {socket.gethostname()}")
    assert sorted(p.name for p in run_dir.iterdir()) == []  # the second wrote nothing


# ---------------------------------------------------------------------------------------------
# 2. A full disk: a metrics row is written whole or not at all


class FullAfter:
    """A file whose disk fills up after `room` more bytes: a short write, then ENOSPC."""

    def __init__(self, fh, room: int):
        self.fh, self.room = fh, room

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self.fh.write(bytes(data[: self.room]))
        self.room -= n
        return n


def test_a_row_that_does_not_fit_is_cut_back_off(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open(path, "ab", buffering=0) as raw:
        append_line(raw, b'{"step": 1}', path)
        with pytest.raises(RunStopped, match=r"^no space left on device writing .*metrics\.jsonl"):
            append_line(FullAfter(raw, room=5), b'{"step": 2, "learning/loss": 1.5}', path)
    assert path.read_bytes() == b'{"step": 1}\n'


# ---------------------------------------------------------------------------------------------
# 8. Ctrl-C at any moment of start-up


@pytest.mark.slow
@pytest.mark.parametrize("after", [1.0, 2.5, 4.0])
def test_ctrl_c_during_start_up_exits_130_in_one_line(tmp_path, after):
    # A start-up as long as a user's: its own cache and XLA's own flags.
    raw = small_run(tmp_path, compilation_cache_dir=".jax_cache")
    config = write_config(tmp_path / "c.yaml", raw)
    proc = start_kiln("train", config, env={"XLA_FLAGS": USER_XLA_FLAGS})
    # `after` CPU seconds into the process: the same moment of start-up however loaded the
    # machine (the interpreter and kiln's command line take well under 0.5 s of it; a Ctrl-C
    # before kiln's first line runs is Python's own).
    wait_until(lambda: cpu_seconds(proc.pid) >= after or proc.poll() is not None, what="start-up")
    proc.send_signal(signal.SIGINT)
    _, err = communicate(proc)
    if "first step after" in err:
        pytest.skip("start-up was over before the signal: the loop's own handling applies")
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "kiln: interrupted", err[-3000:]
    assert "Traceback" not in err and "Fatal" not in err, err[-3000:]
    assert not (tmp_path / "runs" / "r" / "kiln.lock").exists()


# ---------------------------------------------------------------------------------------------
# 9. Paths that cannot be created, inputs that are not files


@pytest.mark.parametrize(
    ("section", "field", "value", "needle"),
    [
        ("train", "output_dir", "afile", "train.output_dir: "),
        ("train", "output_dir", "/proc/kiln-runs", "train.output_dir: /proc/kiln-runs cannot be"),
        ("data", "cache_dir", "afile", "data.cache_dir: "),
    ],
)
def test_paths_that_cannot_be_created_are_refused_before_any_work(
    tmp_path, section, field, value, needle
):
    (tmp_path / "afile").write_text("x")
    raw = small_run(tmp_path)
    raw[section][field] = str(tmp_path / value) if value == "afile" else value
    with pytest.raises(KilnError, match=needle):
        check_output_paths(config_from_dict(raw))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "corpus.txt"]


def test_a_fifo_among_the_inputs_is_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    raw = small_run(tmp_path)
    raw["data"]["paths"] = [str(tmp_path / "corpus.txt"), str(tmp_path / "pipe")]
    with pytest.raises(KilnError, match=r"data\.paths: .*pipe.* is not a regular file"):
        make_datasets(config_from_dict(raw))
    assert not (tmp_path / "cache").exists()


def test_an_output_dir_that_is_a_file_exits_2_and_an_empty_input_names_data_paths(tmp_path):
    (tmp_path / "afile").write_text("x")
    config = write_config(tmp_path / "c.yaml", small_run(tmp_path))
    assert_user_error(kiln_main("train", config, f"train.output_dir={tmp_path / 'afile'}"), "afile")
    (tmp_path / "empty.txt").write_text("")
    proc = kiln_main("train", config, f"data.paths=[{tmp_path / 'empty.txt'}]")
    assert_user_error(proc, "data.paths: ", "empty")
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# 10. orbax's noise


def test_orbax_closed_event_loop_tracebacks_are_dropped_and_other_unraisables_kept(
    tmp_path, monkeypatch
):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    (tmp_path / "checkpoints").mkdir()
    assert latest_complete_step(tmp_path / "checkpoints") is None  # opens an orbax manager

    def unraisable(error):
        return SimpleNamespace(
            exc_type=type(error), exc_value=error, exc_traceback=None, err_msg=None, object=None
        )

    sys.unraisablehook(unraisable(RuntimeError("Event loop is closed")))
    assert seen == []
    other = unraisable(RuntimeError("something else"))
    sys.unraisablehook(other)
    assert seen == [other]


# ---------------------------------------------------------------------------------------------
# 11. The CLI's own errors


def test_kiln_train_without_arguments_asks_for_the_config_only():
    proc = kiln("train")
    assert_user_error(proc, "required: config", "kiln train --help")
    assert "overrides" not in proc.stderr


def test_help_names_the_default_of_every_option_that_has_one():
    from kiln.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    checked = 0
    for name, sub in commands.items():
        proc = kiln_main(name, "--help")
        assert proc.returncode == 0, proc.stderr
        # Each option's block: from its line to the next option's.
        blocks = re.split(r"\n(?=  -)", proc.stdout.split("\noptions:\n", 1)[1])
        for action in sub._actions:
            unset = any(action.default is v for v in (None, False, argparse.SUPPRESS))
            if not action.option_strings or unset:
                continue
            block = next(b for b in blocks if b.lstrip().startswith(action.option_strings[0]))
            # Help that words its default itself keeps its words; the others get it appended.
            said = "default" in action.help
            want = "default" if said else f"(default: {action.default})"
            assert want in " ".join(block.split()), (name, block)
            checked += 1
    assert checked >= 10  # the options with a default were found


def test_a_typo_in_a_mesh_rules_key_is_an_unknown_key():
    with pytest.raises(KilnError) as e:
        config_from_dict({"mesh": {"rules": {"batchx": ["data"]}}})
    assert str(e.value) == (
        "unknown key 'mesh.rules.batchx': did you mean 'batch'? allowed: "
        + ", ".join(config_from_dict({}).mesh.rules)
    )


@pytest.mark.parametrize("text", ["[1, 2]", '"llama"', "null"])
def test_import_hf_of_a_config_json_that_is_not_an_object_is_one_line(tmp_path, text, capsys):
    from kiln.cli import main

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(text)
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json: got a JSON" in err[0], err
    assert not (tmp_path / "out").exists()
