"""The training loop: steps, logging, evaluation, checkpoints and stop requests."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
from jax.experimental import multihost_utils

from kiln.config import Config
from kiln.errors import RunStopped
from kiln.runs import local_tier
from kiln.runs.checkpoint import Checkpointer
from kiln.training import goodput
from kiln.training.console import Summary, next_commands
from kiln.training.metrics import MetricsLogger, perf_metrics
from kiln.training.profiling import ProfileWindow, cache_events
from kiln.training.watchdog import Watchdog
from kiln.util.checksums import non_finite_leaf
from kiln.util.interrupt import exit_now


def checkpoint_tree(state) -> dict[str, Any]:
    """The arrays of a train state that a checkpoint holds."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def skip_cause(state) -> str:
    """The likely cause of a run whose every step was skipped, for its error line."""
    bad = non_finite_leaf(state.params)
    if bad is not None:
        return (
            f"likely cause: the parameters hold non-finite values ({bad}): the checkpoint or "
            "checkpoint.load_params_from source this run started from"
        )
    return (
        "likely cause: the batches or the numerics (the parameters are finite, and token ids "
        "are checked against model.vocab_size as they are read): check that data.paths gives "
        "batches with tokens to predict, then model.dtype and the loss settings"
    )


@contextmanager
def stop_requests(
    say: Callable[[str], None] = lambda message: None,
    way_back: Callable[[], str] = lambda: "run the same command again to resume",
):
    """Turn SIGTERM and SIGINT into a flag the loop polls, so it can checkpoint, then exit 0.

    The first request is acknowledged at once through `say`; a second Ctrl-C (SIGINT) exits at
    once with code 130, saving nothing, in one line ending with `way_back()` (what the same
    command does next). With several processes, JAX's preemption service keeps SIGTERM (SIGINT
    is passed on to it as SIGTERM) and picks one step at which every process stops: see
    `stop_due`.
    """
    requested: list[int] = []
    several = jax.process_count() > 1

    def handler(signum, _frame):
        if requested and signum == signal.SIGINT:  # a second Ctrl-C
            # No checkpoint, no waiting for saves in flight (orbax leaves a temporary directory
            # that the next run removes); metrics.jsonl is flushed row by row; the run's lock is
            # released by the exit's cleanups.
            exit_now(
                130, f"kiln: interrupted again: exiting now without a checkpoint; {way_back()}"
            )
        requested.append(signum)  # first: a second signal may arrive while this one is told
        if len(requested) == 1:
            name = signal.Signals(signum).name
            again = "; Ctrl-C again to exit at once without one" if signum == signal.SIGINT else ""
            say(f"{name}: stopping after this step with a checkpoint{again}")
        if several:
            os.kill(os.getpid(), signal.SIGTERM)

    signals = (signal.SIGINT,) if several else (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield requested
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_due(requested: list[int], step: int) -> bool:
    """Whether to checkpoint and stop after `step`: all processes agree on the same step."""
    if jax.process_count() == 1:
        return bool(requested)
    return multihost_utils.reached_preemption_sync_point(step)


class StepClock:
    """Wall time per step between log points, measured when a step's metrics arrive.

    The interval holding the first step (compilation) is not counted.
    """

    def __init__(self, config: Config, flops_per_token: float):
        self.config, self.flops = config, flops_per_token
        self.last_step, self.last_time = None, None

    def tick(self, step: int) -> dict[str, float] | None:
        now = time.perf_counter()
        if self.last_step is None:
            self.last_step, self.last_time = step, now
            return None
        if step % self.config.train.log_every_steps and step != self.config.train.steps:
            return None
        seconds = (now - self.last_time) / max(1, step - self.last_step)
        self.last_step, self.last_time = step, now
        tokens = self.config.train.global_batch_size * self.config.data.seq_len
        return perf_metrics(seconds, tokens, self.flops, self.config)


@dataclass
class Loop:
    """One run's loop: `step_fn(state, batch) -> (state, metrics)` from state.step to train.steps."""

    config: Config
    command: str
    step_fn: Callable
    place: Callable[[Mapping[str, Any]], Any]
    batches: Iterator
    ckpt: Checkpointer
    logger: MetricsLogger
    flops_per_token: float
    evaluate: Callable[[Any], dict[str, float]] | None = None
    local: Checkpointer | None = None  # the node-local tier (checkpoint.local_dir)
    started: float | None = None  # perf_counter() at start-up, for the time to the first step
    clock: goodput.Clock = field(default_factory=goodput.Clock)  # where this attempt's time goes
    goodput_base: dict[str, float] = field(default_factory=dict)  # earlier attempts' figures

    def run(self, state):
        cfg = self.config
        self._loop_start = time.perf_counter()
        first = int(state.step) + 1
        profile = ProfileWindow(cfg.train.profile_steps, cfg.run_dir / "tensorboard", first)
        try:
            return self._run(state, first, profile)
        finally:
            profile.close()  # a run stopped or failed inside the window still writes its trace

    def _run(self, state, first: int, profile: ProfileWindow):
        cfg = self.config
        clock = StepClock(cfg, self.flops_per_token)
        self._first_step = None if self.started is None else first
        self._first_step_seconds: dict[str, float] = {}
        self._first_done = None  # perf_counter() when the first step's metrics arrived
        self._evals: dict[int, dict[str, float]] = {}  # eval figures waiting for their step's row
        self._held: tuple[int, dict[str, float]] | None = None  # a row written after a save
        skips, pending = 0, None  # pending: (step, metrics on device), read one step late
        # Complete: a save of this run is still to come (the local tier holds at most the step
        # the run resumed from).
        saved_before = max(
            (s for s in (self.ckpt.latest_step(), self.local and self.local.latest_step()) if s),
            default=None,
        )
        way_back = lambda: self._way_back(saved_before)  # noqa: E731
        # Process 0 seals the checkpoints: the others do not know which one is the last.
        sealer = jax.process_index() == 0
        last_saved = (lambda: self._last_saved(saved_before)) if sealer else None
        watchdog = Watchdog(cfg, first - 1, last_saved)
        untimed = partial(self._untimed, watchdog)
        with stop_requests(self.logger.info, way_back) as stop, watchdog:
            for step in range(first, cfg.train.steps + 1):
                with untimed("other", "starting a profiler trace", profile.edge(step)):
                    profile.before(step, state)
                self.clock.enter("data")
                watchdog.set_doing(f"reading the batch of step {step}")
                batch = self.place(next(self.batches))
                self.clock.enter("step")
                if step == first:
                    self.logger.status("compiling the train step…")
                    compile_start = time.perf_counter()
                    with untimed("compile", "compiling the train step"):
                        state, metrics = self.step_fn(state, batch)
                    # jit traces and compiles in the call; the step runs after
                    seconds = time.perf_counter() - compile_start
                    self.logger.info(f"compiled the train step in {seconds:.1f}s")
                    self.logger.status("")
                else:
                    watchdog.set_doing(f"dispatching step {step}")
                    state, metrics = self.step_fn(state, batch)
                with untimed("other", "writing a profiler trace", profile.edge(step)):
                    profile.after(step, (state, metrics))
                self.ckpt.check()  # a failed background save stops the run now, not later
                if self.local is not None:
                    self.local.check()
                if pending is not None:
                    watchdog.set_doing(f"waiting for the result of step {pending[0]}")
                    skips = skips + 1 if self._finish(*pending, clock) else 0
                    watchdog.beat(pending[0], f"running step {step}")
                    if skips >= cfg.train.max_consecutive_skips:
                        raise RunStopped(
                            f"{skips} consecutive steps had a non-finite loss or gradient (last at "
                            f"step {pending[0]}); stopping with the last good checkpoint kept "
                            f"(train.max_consecutive_skips={cfg.train.max_consecutive_skips})"
                        )
                pending = (step, metrics)
                if self.evaluate is not None and step % cfg.train.eval_every_steps == 0:
                    with untimed("eval", f"evaluating at step {step}"):
                        self._evals[step] = self.evaluate(state)  # logged in the row of its step
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                    with untimed("checkpoint", f"saving the checkpoint of step {step}"):
                        self._save(state)
                elif self._local_due(step):  # a step saved persistently is not saved locally
                    with untimed("checkpoint", f"saving the local checkpoint of step {step}"):
                        self._save_local(state)
                watchdog.set_doing(f"agreeing whether to stop after step {step}")
                if stop_due(stop, step):
                    watchdog.set_doing(f"waiting for the result of step {step}")
                    self._finish(*pending, clock, hold=True)
                    with untimed("checkpoint", f"saving the checkpoint of step {step} to stop"):
                        self._save(state)
                        self.ckpt.wait()
                    self.clock.enter("other")
                    self._write_held()
                    name = signal.Signals(stop[0]).name if stop else "SIGTERM"
                    self.logger.warn(
                        f"stopped by signal {name} at step {step}; "
                        f"checkpoint saved, run `{self.command}` again to resume"
                    )
                    return state
            if pending is not None:
                watchdog.set_doing(f"waiting for the result of step {pending[0]}")
                skips = skips + 1 if self._finish(*pending, clock, hold=True) else 0
                watchdog.beat(pending[0], "finishing the run")
            self._trained_end = time.perf_counter()
            trained = cfg.train.steps - first + 1
            if trained > 0 and skips == trained:
                self._write_held()
                raise RunStopped(
                    f"every step of this run ({first}..{cfg.train.steps}) had a non-finite loss or "
                    f"gradient and was skipped; nothing was trained or saved; {skip_cause(state)}"
                )
            with untimed("checkpoint", "saving the last checkpoint"):
                self._save(state)
                self.ckpt.wait()
        self.clock.enter("other")
        self._write_held()  # the last step's row, with the goodput of the whole run
        self.logger.summary(self._summary(first, int(state.step)))
        return state

    @contextmanager
    def _untimed(self, watchdog: Watchdog, phase: str, doing: str, when: bool = True):
        """In goodput phase `phase` and out of the watchdog's sight (if `when`); then steps."""
        if not when:
            yield
            return
        self.clock.enter(phase)
        try:
            with watchdog.paused(doing):
                yield
        finally:
            self.clock.enter("step")

    def _last_saved(self, saved_before: int | None) -> int | None:
        """The step of the newest checkpoint on disk: this run's last sealed save (the local tier's
        as sealed by this process), or the one it started from."""
        saved = self.ckpt.sealed if self.ckpt.sealed is not None else saved_before
        if self.local is not None and self.local.sealed is not None:
            saved = max(saved or 0, self.local.sealed)
        return saved

    def _way_back(self, saved_before: int | None) -> str:
        """What running the command again does after an exit without a checkpoint."""
        saved = self._last_saved(saved_before)
        if saved is None:
            return "no checkpoint was saved yet: run the same command again to start over"
        return f"run the same command again to resume from step {saved}"

    def _summary(self, first: int, last: int) -> Summary:
        """Figures of this invocation: steps, wall time, tokens/s after the first step, losses."""
        cfg, now, end = self.config, time.perf_counter(), self._trained_end
        tokens_per_sec = None
        if self._first_done is not None and last > first and end > self._first_done:
            # Steps after the first ran between its result and the last one (the final save
            # and the compilation are left out).
            tokens = (last - first) * cfg.train.global_batch_size * cfg.data.seq_len
            tokens_per_sec = tokens / (end - self._first_done)
        return Summary(
            run_dir=cfg.run_dir,
            steps=last - first + 1,
            last_step=last,
            seconds=now - (self.started if self.started is not None else self._loop_start),
            tokens_per_sec=tokens_per_sec,
            train_loss=self.logger.last.get("learning/loss"),
            eval_loss=self.logger.last.get("eval/loss"),
            hard_loss=self.logger.last.get("distill/hard_loss"),
            goodput={k: v for k, v in self.logger.last.items() if k.startswith(goodput.PREFIX)},
            checkpoint=cfg.run_dir / "checkpoints" / str(last),
            next=next_commands(cfg),
        )

    def _save(self, state) -> None:
        self.ckpt.save(int(state.step), checkpoint_tree(state), self.batches.get_state())

    def _local_due(self, step: int) -> bool:
        """A local save at `step`: not at the last step, which the persistent tier saves."""
        every = self.config.checkpoint.local_every_steps
        last = step == self.config.train.steps
        return self.local is not None and every > 0 and step % every == 0 and not last

    def _save_local(self, state) -> None:
        tree = checkpoint_tree(state)
        if not self.local.metadata:  # the same shards at every step
            self.local.metadata = local_tier.identity(self.config, tree)
        self.local.save(int(state.step), tree, self.batches.get_state())

    def _finish(self, step: int, metrics, clock: StepClock, hold: bool = False) -> bool:
        """Fetch a dispatched step's metrics and log them when due; returns whether it skipped.
        `hold`: the step's row, due or not, is kept for `_write_held` (after a save)."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if self._first_done is None:
            self._first_done = time.perf_counter()
        if step == self._first_step:
            self._first_step_seconds = {"perf/time_to_first_step_seconds": self._first_arrived()}
        perf = clock.tick(step)
        skipped = values.get("learning/step_skipped", 0.0) > 0
        self.logger.progress(step, {**values, **(perf or {})})
        if skipped:
            self.logger.warn(f"step {step}: non-finite loss or gradient, update skipped")
        due = step % self.config.train.log_every_steps == 0 or step == self.config.train.steps
        evals = self._evals.pop(step, {})
        row = evals
        if due or skipped or hold:  # one row per step: the step's evaluation joins its figures
            row = {**evals, **values, **(perf or {}), **self._first_step_seconds}
            self._first_step_seconds = {}
        if hold:
            self._held = (step, row)
        elif row:
            self._write(step, row)
        return skipped

    def _write_held(self) -> None:
        if self._held is not None:
            self._write(*self._held)
            self._held = None

    def _write(self, step: int, row: dict[str, float]) -> None:
        """Write a row with the run's goodput so far (every process takes part: a collective)."""
        figures = goodput.figures(self.goodput_base, goodput.slowest(self.clock))
        self.logger.write(step, {**row, **figures})

    def _first_arrived(self) -> float:
        """Seconds from start-up to the first step's metrics (logged with the next row)."""
        seconds = time.perf_counter() - self.started
        hits, misses = cache_events["hits"], cache_events["misses"]
        cache = self.config.train.compilation_cache_dir
        where = "off" if cache is None else f"{hits} hits, {misses} misses"
        self.logger.info(f"first step after {seconds:.1f}s (compile cache: {where})")
        return seconds
