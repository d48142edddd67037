"""The suite's waits: a process is waited for while it uses CPU time, and failed once it stalls."""

import subprocess
import sys

import pytest

import conftest
from conftest import communicate, run_process, wait_until


@pytest.fixture
def short_stall(monkeypatch):
    monkeypatch.setattr(conftest, "STALL_S", 1.0)


def test_a_process_that_sleeps_is_stuck_and_killed(short_stall):
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with pytest.raises(AssertionError, match="no CPU time"):
        communicate(proc)
    assert proc.poll() is not None  # killed, not left behind


def test_a_working_process_is_waited_for_past_the_stall_limit(short_stall):
    # 3 s of CPU work against a stall limit of 1 s: waited for, because it keeps using CPU time.
    busy = "import time\nend = time.process_time() + 3\nwhile time.process_time() < end: pass\nprint('done')"
    assert run_process([sys.executable, "-c", busy]).stdout == "done\n"


def test_wait_until_fails_when_the_process_exits_first():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match="process exited 0"):
        wait_until(lambda: False, proc, "a file that never appears")
