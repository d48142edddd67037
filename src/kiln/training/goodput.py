"""Goodput: where a run's wall time went, over every attempt (start, resumes, restarts).

Each process keeps a `Clock` that is in exactly one phase at a time, from the start of the
process: so the phases add up to its wall time. The loop logs them in every row of
metrics.jsonl as cumulative `goodput/*` figures, each the maximum over the processes (the
slowest host), plus what the earlier attempts of the run recorded. An attempt that died loses
the steps it computed after the checkpoint the next attempt restores: the next attempt finds
them in the dead attempt's rows beyond that step (`carried`), before those rows are dropped, and
moves their step time from `goodput/step_seconds` to `goodput/lost_seconds`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

# Where a process's time goes, in order; every second of it is in exactly one.
PHASES = ("init", "compile", "data", "step", "checkpoint", "eval", "other")
PREFIX = "goodput/"
# The figures of a row: the phases, work lost to attempts that died, the attempts, the sum.
KEYS = (
    *(f"{PREFIX}{p}_seconds" for p in PHASES),
    f"{PREFIX}lost_seconds",
    f"{PREFIX}lost_steps",
    f"{PREFIX}attempts",
    f"{PREFIX}wall_seconds",
)
GOODPUT = f"{PREFIX}goodput"  # step_seconds / wall_seconds


def process_age() -> float:
    """Seconds since this process started (interpreter start-up and imports included), from
    /proc; 0 where /proc is not there."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Clock:
    """This process's wall time by phase: one phase at a time, starting in `init`, from the start
    of the process (`whole_process`) or from the clock's creation."""

    def __init__(self, whole_process: bool = False):
        now = time.monotonic()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds["init"] = process_age() if whole_process else 0.0
        self.phase, self.since = "init", now

    def enter(self, phase: str) -> str:
        """Switch to `phase`; returns the phase left."""
        now = time.monotonic()
        left = self.phase
        self.seconds[left] += now - self.since
        self.phase, self.since = phase, now
        return left

    @contextmanager
    def within(self, phase: str) -> Iterator[None]:
        """In `phase` inside, back to the phase before at the end."""
        before = self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far, the current one up to now."""
        out = dict(self.seconds)
        out[self.phase] += time.monotonic() - self.since
        return out


def slowest(clock: Clock) -> dict[str, float]:
    """Each phase's seconds and the wall time of this attempt, the maximum over the processes.

    With several processes a collective: every process calls it at the same points.
    """
    totals = clock.totals()
    vector = np.asarray([*(totals[p] for p in PHASES), sum(totals.values())], np.float32)
    if jax.process_count() > 1:
        vector = np.max(multihost_utils.process_allgather(vector), axis=0)
    return {**dict(zip(PHASES, map(float, vector[:-1]), strict=True)), "wall": float(vector[-1])}


def figures(base: dict[str, float], attempt: dict[str, float]) -> dict[str, float]:
    """The goodput/* figures of a row: the earlier attempts' (`base`, from `carried`) plus this
    attempt's (`slowest`)."""
    out = {key: base.get(key, 0.0) for key in KEYS}
    for phase in PHASES:
        out[f"{PREFIX}{phase}_seconds"] += attempt[phase]
    out[f"{PREFIX}wall_seconds"] += attempt["wall"]
    out[f"{PREFIX}attempts"] += 1
    wall = out[f"{PREFIX}wall_seconds"]
    out[GOODPUT] = out[f"{PREFIX}step_seconds"] / wall if wall > 0 else 0.0
    return out


def carried(path: Path, restored: int) -> dict[str, float]:
    """The goodput/* figures of the earlier attempts of the run whose metrics.jsonl is `path`,
    resumed from the checkpoint of step `restored` (0: from the start), before its rows after
    that step are dropped: the latest row's, with the step time of the rows after `restored`
    moved to lost work. Empty for a run without goodput figures."""
    rows = []
    try:
        with open(path, "rb") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a torn or damaged line: drop_rows_after reports it
                if isinstance(row, dict) and isinstance(row.get("step"), int) and KEYS[0] in row:
                    rows.append(row)
    except OSError:  # none yet; an unreadable file is reported when the rows are trimmed
        return {}
    if not rows:
        return {}
    last = rows[-1]
    out = {key: float(last.get(key, 0.0)) for key in KEYS}
    if last["step"] > restored:
        kept = [r for r in rows if r["step"] <= restored]
        step_key = f"{PREFIX}step_seconds"
        lost = out[step_key] - (float(kept[-1][step_key]) if kept else 0.0)
        out[step_key] -= lost
        out[f"{PREFIX}lost_seconds"] += lost
        out[f"{PREFIX}lost_steps"] += last["step"] - restored
    return out
