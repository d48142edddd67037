"""`kiln prepare` under signals: its worker processes never outlive it, SIGTERM stops it as SIGINT
does (with its own exit code, 143)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import communicate, wait_until

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="finds worker processes through /proc"
)


def children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _parent_and_state(int(entry.name))[0] == pid:
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    return _parent_and_state(pid)[1] not in (None, "Z", "X")


def _parent_and_state(pid: int) -> tuple[int | None, str | None]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None, None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[1]), fields[0]) if fields[0] not in "ZX" else (None, fields[0])


@pytest.fixture
def stuck_prepare(tmp_path):
    """`kiln prepare --workers 2` whose second task waits forever: it reads a FIFO nobody writes.

    Yields (process, its two worker pids); kills whatever is left when the test ends.
    """
    data = tmp_path / "in"
    data.mkdir()
    (data / "a.txt").write_text("kiln prepares tokens\n" * 10_000)  # 210 kB: a task of its own
    os.mkfifo(data / "b.fifo")  # size 0: the second task
    cmd = [sys.executable, "-m", "kiln.cli", "prepare", "--format", "text", "--workers", "2"]
    inputs = ["--input", str(data / "a.txt"), str(data / "b.fifo")]
    with interruptible():
        proc = subprocess.Popen(
            [*cmd, *inputs, "--output", str(tmp_path / "out")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    workers: list[int] = []
    try:

        def started() -> bool:
            workers[:] = children(proc.pid)
            return len(workers) >= 2

        wait_until(started, proc, "kiln prepare's 2 worker processes")
        assert len(workers) == 2, workers
        yield proc, workers
    finally:
        for pid in [proc.pid, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        communicate(proc)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Processes started inside get SIGINT at its default, as a command typed at a terminal has it.

    A suite started in the background by a non-interactive shell (`pytest &`) inherits SIGINT
    ignored, and would pass that on: Python then keeps ignoring it instead of raising
    KeyboardInterrupt, and the SIGINT case would wait for its timeout. A handled signal, unlike
    an ignored one, is back at its default in a new program.
    """
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def wait_gone(pids: list[int]) -> None:
    """Wait for the processes `pids` (not this process's children) to exit."""
    wait_until(lambda: not any(alive(p) for p in pids), what=f"processes {pids} to exit")


def test_workers_exit_when_prepare_is_killed(stuck_prepare):
    proc, workers = stuck_prepare
    os.kill(proc.pid, signal.SIGKILL)
    communicate(proc)
    wait_gone(workers)


@pytest.mark.parametrize(
    "signum, code, line",
    [(signal.SIGTERM, 143, "kiln: stopped by SIGTERM"), (signal.SIGINT, 130, "kiln: interrupted")],
)
def test_sigterm_and_sigint_stop_prepare_cleanly(stuck_prepare, tmp_path, signum, code, line):
    proc, workers = stuck_prepare
    proc.send_signal(signum)
    _, err = communicate(proc)
    # 128 + the signal's number, as every kiln command exits on a signal (kiln train included).
    assert proc.returncode == code, err[-2000:]
    assert err.splitlines() == [line]
    wait_gone(workers)
    # No output and no staging directory left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_signal_handling_is_restored_after_prepare():
    from kiln.data.workers import signals_as_interrupt

    def mine(_signum, _frame):
        pass

    before = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt) as e, signals_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode; never reached
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is mine
        assert e.value.signum == signal.SIGTERM
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
