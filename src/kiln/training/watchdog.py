"""The hang watchdog: a process whose training steps stop finishing writes its stacks and exits.

A step that never finishes (a collective waiting for a process that stopped, a stuck filesystem
read, a deadlock) stalls every process of a run without ending any of them: JAX's heartbeats
still flow. When no step finishes within `train.hang_timeout_s`, each process writes the Python
stacks of all its threads to `RUN_DIR/hangs/<host>-<pid>.txt`, prints one line and exits with
`EXIT_HANG`, which a scheduler takes as "restart me" (docs/multihost.md#exit-codes). Compilation,
checkpoint saves, evaluation and profiler traces are not timed: the loop pauses the watchdog
around them (`paused`). Timing starts when the first step's result arrives, since every process
has compiled by then; after a pause, the next step may also take as long as the pause did, for
the processes still in theirs (a process with a compile cache miss evaluates later than one
with a hit).
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import jax

from kiln.config import Config
from kiln.util.interrupt import exit_now

# sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to retry": no other exit
# of kiln uses it, and schedulers' requeue rules can name it.
EXIT_HANG = 75
# train.hang_timeout_s: auto = HANG_MULTIPLE x the median of the last HANG_WINDOW step times of
# this attempt, and never below HANG_FLOOR_S (also the limit until a step time is measured): a
# step ten times slower than its peers is no longer a slow step, and five minutes outlast any
# hiccup of a healthy cluster (a slow filesystem, a host's garbage collection).
HANG_MULTIPLE = 10
HANG_FLOOR_S = 300.0
HANG_WINDOW = 100


def hang_path(run_dir: Path) -> Path:
    """Where this process writes its stacks when it hangs: hangs/<host>-<pid>.txt."""
    return run_dir / "hangs" / f"{socket.gethostname()}-{os.getpid()}.txt"


class Watchdog:
    """Exits the process (`EXIT_HANG`) when `beat` is not called in time, outside `paused`.

    The loop calls `beat(step)` when a step's result arrives and says what it does meanwhile
    (`doing`), for the report. Used as a context manager: the watching thread runs inside.
    `last_saved()`: the step of the newest complete checkpoint, None if there is none; None
    where this process does not know it (it does not seal checkpoints).
    """

    def __init__(
        self, config: Config, step: int, last_saved: Callable[[], int | None] | None = None
    ):
        setting = config.train.hang_timeout_s
        self.config, self.step, self.last_saved = config, step, last_saved
        self.fixed = None if setting == "auto" else float(setting)
        self.enabled = setting != 0
        self.doing = "starting the loop"
        self._times: deque[float] = deque(maxlen=HANG_WINDOW)
        self._cv = threading.Condition()
        self._since: float | None = None  # monotonic: the last beat or the end of a pause
        self._grace = 0.0  # the last pause's length, allowed to the next step besides limit()
        self._clean = False  # whether no pause came since the last beat: its time is a step's
        self._paused = 0
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="kiln-hang-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join()

    def limit(self) -> float:
        """Seconds a step may take before it counts as hung."""
        if self.fixed is not None:
            return self.fixed
        if not self._times:
            return HANG_FLOOR_S
        return max(HANG_MULTIPLE * statistics.median(self._times), HANG_FLOOR_S)

    def rule(self) -> str:
        """How `limit` came about, for the report."""
        if self.fixed is not None:
            return f"train.hang_timeout_s={self.fixed:g}"
        if not self._times:
            return f"train.hang_timeout_s=auto: {HANG_FLOOR_S:g} s until a step time is measured"
        median = statistics.median(self._times)
        return (
            f"train.hang_timeout_s=auto: {HANG_MULTIPLE} x the median step time {median:.3g} s "
            f"of the last {len(self._times)} steps, at least {HANG_FLOOR_S:g} s"
        )

    def beat(self, step: int, doing: str) -> None:
        """Step `step`'s result arrived; the loop now does `doing`."""
        if not self.enabled:
            return
        now = time.monotonic()
        with self._cv:
            if self._since is not None and self._clean:
                self._times.append(now - self._since)
            self.step, self.doing, self._since = step, doing, now
            self._grace, self._clean = 0.0, True
            self._cv.notify()

    def set_doing(self, doing: str) -> None:
        self.doing = doing

    @contextmanager
    def paused(self, doing: str) -> Iterator[None]:
        """Not timed inside (compilation, a checkpoint save, evaluation); the time allowed for
        the next step starts at its end, with the pause's length added."""
        before, start = self.doing, time.monotonic()
        with self._cv:
            self._paused += 1
            self.doing = doing
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                self.doing = before
                if self._since is not None:
                    now = time.monotonic()
                    self._since, self._clean = now, False
                    self._grace = max(self._grace, now - start)
                self._cv.notify()

    def _watch(self) -> None:
        with self._cv:
            while not self._closed:
                if self._paused or self._since is None:
                    self._cv.wait()
                    continue
                left = self._since + self.limit() + self._grace - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                waited = time.monotonic() - self._since
                break
            else:
                return
        self._fire(waited)

    def _fire(self, waited: float) -> None:
        """Write the report, say so in one line and exit `EXIT_HANG`."""
        path = hang_path(self.config.run_dir)
        who = f"process {jax.process_index()} of {jax.process_count()}"
        saved = "" if self.last_saved is None else self.last_saved()
        if saved == "":
            resume = "resume from the last complete checkpoint"
        elif saved is None:
            resume = "start over (no checkpoint was saved yet)"
        else:
            resume = f"resume from checkpoint step {saved}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as fh:
                fh.write(self._report(waited, who, saved))
                fh.flush()
                os.fsync(fh.fileno())
            where = f"the Python stacks of its threads are in {path}"
        except OSError as e:
            where = f"its Python stacks could not be written to {path} ({e.strerror or e})"
        exit_now(
            EXIT_HANG,
            f"kiln: error: train.hang_timeout_s: no training step finished in {waited:.0f} s "
            f"(limit {self.limit() + self._grace:.0f} s) after step {self.step}, while {self.doing}, on {who} "
            f"(host {socket.gethostname()}, pid {os.getpid()}); {where}; exiting with code "
            f"{EXIT_HANG} (restart): run the same command again to {resume}",
        )

    def _report(self, waited: float, who: str, saved: int | str | None) -> str:
        """The hang report: where the run stood, then every thread's stack."""
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        lines = [
            f"kiln hang report, {now}",
            f"host {socket.gethostname()}, pid {os.getpid()}, {who}",
            f"run directory {self.config.run_dir}",
            f"last finished step {self.step} of {self.config.train.steps}; the loop was "
            f"{self.doing}",
            f"no step finished for {waited:.1f} s; limit {self.limit():.1f} s ({self.rule()})"
            + (f" + {self._grace:.1f} s after a pause" if self._grace else ""),
            "last checkpoint saved: "
            + (
                "not known to this process"
                if saved == ""
                else "none"
                if saved is None
                else f"step {saved}"
            ),
            "",
            "Python stacks of every thread (most recent call last):",
        ]
        names = {t.ident: t.name for t in threading.enumerate()}
        frames = sys._current_frames()
        frames.pop(threading.get_ident(), None)  # this thread's own stack says nothing
        main = threading.main_thread().ident
        for ident, frame in sorted(frames.items(), key=lambda item: item[0] != main):
            lines += ["", f"thread {names.get(ident, '?')} ({ident}):"]
            lines += [line.rstrip("\n") for line in traceback.format_stack(frame)]
        return "\n".join(lines) + "\n"
