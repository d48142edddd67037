"""scripts/kiln.sbatch decides from every task's exit code whether to requeue the job or to stop
for a person: run here with stand-ins for srun, scancel, scontrol and kiln that exit as told."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO

SBATCH = REPO / "scripts" / "kiln.sbatch"

# srun: every task of the step at once (SLURM_NTASKS of them), with its SLURM_PROCID.
SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
for (( i = 0; i < SLURM_NTASKS; i++ )); do SLURM_PROCID=$i "$@" & done
wait
"""
# scancel --signal=TERM JOB: the signal reaches every process of the job's steps (kiln and the
# shell around it), as Slurm delivers it; nothing else is cancelled here.
SCANCEL = """#!/bin/bash
echo "$@" >> "$STUBS/scancel.log"
cat "$STUBS"/pids.* | xargs kill -TERM
"""
SCONTROL = """#!/bin/bash
echo "$@" >> "$STUBS/scontrol.log"
"""
# kiln: exits with its task's word of $CODES; `lost` kills its shell as a lost node would,
# `wait` runs until SIGTERM, then exits 0 as kiln does after saving a checkpoint.
KILN = """#!/bin/bash
echo "$@" > "$STUBS/args.$SLURM_PROCID"
echo $$ $PPID > "$STUBS/pids.$SLURM_PROCID"
read -ra codes <<< "$CODES"
code=${codes[$SLURM_PROCID]}
case $code in
  lost) kill -KILL $PPID; exit 0 ;;
  137) kill -KILL $$ ;;
  wait) trap 'exit 0' TERM; touch "$STUBS/ready.$SLURM_PROCID"; while :; do sleep 0.05; done ;;
  *) exit "$code" ;;
esac
"""


def stubs(tmp_path: Path) -> Path:
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (
        ("srun", SRUN),
        ("scancel", SCANCEL),
        ("scontrol", SCONTROL),
        ("kiln", KILN),
    ):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    return bin_


def sbatch(tmp_path: Path, codes: str, restarts: int | None = None, time_limit: bool = False):
    """Run the script as Slurm would (2 tasks); returns (exit code, output, requeued)."""
    env = {
        "PATH": f"{stubs(tmp_path)}:/usr/bin:/bin",
        "STUBS": str(tmp_path / "bin"),
        "CODES": codes,
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "2",
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    proc = subprocess.Popen(
        ["bash", str(SBATCH), "configs/base.yaml", "train.output_dir=/shared/runs"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if time_limit:  # what --signal=B:USR1@300 sends, once both tasks run
        deadline = time.monotonic() + 30
        while not all((tmp_path / "bin" / f"ready.{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    log = tmp_path / "bin" / "scontrol.log"
    requeued = log.read_text().split() == ["requeue", "7"] if log.exists() else False
    return proc.returncode, out, requeued


@pytest.mark.parametrize(
    ("codes", "want"),
    [
        ("0 0", (0, False)),  # complete
        ("2 134", (2, False)),  # bad input on one host; JAX ended the other
        ("2 2", (2, False)),
        ("1 134", (1, False)),  # a fault (full disk, ...) on one host
        ("139 0", (1, False)),  # a crash
        ("75 75", (0, True)),  # a hang
        ("137 134", (0, True)),  # one process killed, JAX ended the other
        ("lost 134", (0, True)),  # a node lost: no code at all
        ("137 1", (0, True)),  # killed before the other joined: it waited, then exited 1
        ("143 143", (0, True)),  # SIGTERM before training started
    ],
)
def test_the_exit_codes_of_all_tasks_decide_requeue_or_stop(tmp_path, codes, want):
    code, out, requeued = sbatch(tmp_path, codes)
    assert (code, requeued) == want, out
    for i in range(2):
        args = (tmp_path / "bin" / f"args.{i}").read_text().split()
        assert args == [
            "train",
            "configs/base.yaml",
            "train.output_dir=/shared/runs",
            "distributed.auto=true",
        ]


def test_requeues_are_bounded(tmp_path):
    code, out, requeued = sbatch(tmp_path, "75 75", restarts=20)
    assert (code, requeued) == (1, False), out
    assert "20 restarts already: a person must look" in out


def test_the_time_limit_stops_every_process_at_a_checkpoint_and_requeues(tmp_path):
    code, out, requeued = sbatch(tmp_path, "wait wait", time_limit=True)
    assert (code, requeued) == (0, True), out
    assert (tmp_path / "bin" / "scancel.log").read_text().split() == ["--signal=TERM", "7"]
    assert "task 0: exit code 0" in out and "task 1: exit code 0" in out
