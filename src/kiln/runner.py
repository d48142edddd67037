"""The stateful run around a pure step: set-up, resume, checkpoints, signals, metrics one step late.

Shared by `kiln train` and `kiln distill`: the caller supplies its objective and train state
(`prepare_run`); this module owns everything that touches files, clocks and signals.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from kiln import train
from kiln.checkpoint import (
    Checkpointer,
    abstract_like,
    latest_complete_step,
    restore,
    restore_params,
)
from kiln.config import Config, read_run_config
from kiln.console import Summary
from kiln.errors import KilnError, RunStopped
from kiln.metrics import MetricsLogger, perf_metrics
from kiln.profiling import ProfileWindow, cache_events, compilation_cache_for

# Sections and fields a resumed run may not change: they define the model and the token stream.
FROZEN_ON_RESUME = (
    "model",
    "data.source",
    "data.synthetic_kind",
    "data.paths",
    "data.eval_paths",
    "data.on_decode_error",
    "data.field",
    "data.tokenizer",
    "data.seq_len",
    "data.seed",
    "train.global_batch_size",
)


def previous_config(run_dir: Path) -> Config | None:
    """The resolved config of an earlier invocation in this run directory, if it left checkpoints."""
    if latest_complete_step(run_dir / "checkpoints") is None:
        return None
    return read_run_config(run_dir, "resume (the earlier run's config)")


def resume_changes(old: Config, new: Config) -> list[str]:
    """Changed fields as 'a.b: old -> new'; a KilnError if a frozen field changed."""
    before, after = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    changes = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key):
            continue
        if any(key == f or key.startswith(f + ".") for f in FROZEN_ON_RESUME):
            raise KilnError(
                f"{key}: the run in {new.run_dir} was started with {before.get(key)!r}, this config "
                f"says {after.get(key)!r}; a resumed run cannot change it (use a new "
                "train.run_name, or checkpoint.load_params_from to start from its weights)"
            )
        changes.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    return changes


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and not (prefix == "mesh." and k == "rules"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def open_run_dir(run_dir: Path, config: Config) -> bool:
    """Write the run directory and its config.yaml on process 0; returns whether this is process 0.

    With several processes, nothing is written until every one of them has validated its config,
    data and checkpoint (and has read the old config.yaml, which process 0 now replaces).
    """
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("kiln: every process validated the run")
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config.to_yaml())
    return is_main


def resume_notes(config: Config) -> list[str]:
    """What changed since the earlier invocation of this run (KilnError if it may not change)."""
    previous = previous_config(config.run_dir)
    return [f"changed on resume: {c}" for c in resume_changes(previous, config)] if previous else []


def restore_latest(config: Config, state, batches) -> tuple[Any, str | None]:
    """`state` and the data iterator from the run's latest complete checkpoint, if there is one."""
    directory = config.run_dir / "checkpoints"
    latest = latest_complete_step(directory)
    if latest is None:
        return state, None
    state, data_state = restore_state(directory, latest, state)
    if data_state:  # empty for a checkpoint of `kiln import-hf`: data from the start
        batches.set_state(data_state)
    return state, f"resuming from step {latest} ({directory / str(latest)})"


@dataclass
class PreparedRun:
    """A validated run, ready to loop: nothing has been written to its run directory yet."""

    config: Config
    command: str  # what the user runs to resume it, e.g. "kiln train"
    mesh: Any
    objective: train.Objective
    state: train.TrainState
    datasets: Any
    batches: Iterator
    notes: list[str]
    started: float  # time.perf_counter() when preparation began


def execute(
    config: Config,
    build: Callable[[Config, Any], tuple[train.Objective, train.TrainState, list[str]]],
    *,
    command: str,
    check: Callable[[Config], Any] | None = None,
):
    """`prepare_run`, then `run_loop`, with the run's persistent compilation cache in use."""
    with compilation_cache_for(config):
        return run_loop(prepare_run(config, build, command=command, check=check))


def prepare_run(
    config: Config,
    build: Callable[[Config, Any], tuple[train.Objective, train.TrainState, list[str]]],
    *,
    command: str,
    check: Callable[[Config], Any] | None = None,
) -> PreparedRun:
    """Validate against devices, data and any earlier run; build the state; resume or load.

    `build(config, mesh) -> (objective, fresh state, notes)`; `check(config)` runs cheap
    validation before any data or parameters are touched. The state then comes from the
    run's latest checkpoint (with the data iterator's position) or, for a new run, takes
    `checkpoint.load_params_from`'s parameters (those the objective adds to the model, e.g. a
    distillation projection, stay fresh).
    """
    from kiln.data import make_datasets
    from kiln.distributed import initialize
    from kiln.mesh import make_mesh
    from kiln.model.attention import check as check_attention

    started = time.perf_counter()
    initialize(config)  # before any device is touched
    mesh = make_mesh(config)
    check_attention(config.model.attention, mesh.devices.flat[0].platform, config.model.dtype)
    if check is not None:
        check(config)
    datasets = make_datasets(config)
    notes = resume_notes(config)
    objective, state, built_notes = build(config, mesh)
    batches = datasets.train_iterator()
    state, resumed = restore_latest(config, state, batches)
    source = config.checkpoint.load_params_from
    if resumed:
        notes.insert(0, resumed)
    elif source:
        keep = objective.extra_param_keys
        target = nnx.State({k: v for k, v in state.params.items() if k not in keep})
        params, step = restore_params(source, target)
        state = state.replace(params=nnx.State.merge(state.params, params))
        notes.insert(0, f"parameters from {source} (step {step})")
    return PreparedRun(
        config, command, mesh, objective, state, datasets, batches, notes + built_notes, started
    )


def run_loop(run: PreparedRun):
    """Write the run directory (everything is validated by now), then loop, log and save."""
    config, mesh = run.config, run.mesh
    is_main = open_run_dir(config.run_dir, config)
    ckpt = Checkpointer(config.run_dir, config.checkpoint)
    logger = MetricsLogger(config.run_dir, config, enabled=is_main, start_step=int(run.state.step))
    for note in run.notes + run.datasets.notes:
        logger.info(note)
    for warning in run.datasets.warnings:
        logger.warn(warning)

    eval_fn = None
    if config.train.eval_every_steps:
        eval_step = train.make_eval_step(config, mesh)
        eval_batches = run.datasets.eval_batches(config.train.eval_batches)

        def eval_fn(state):
            return train.evaluate(eval_step, state, eval_batches, mesh, config)

    loop = Loop(
        config=config,
        command=run.command,
        step_fn=train.make_step(run.objective, train.shardings_of(run.state)),
        place=lambda batch: train.place_batch(batch, mesh, config),
        batches=run.batches,
        ckpt=ckpt,
        logger=logger,
        flops_per_token=run.objective.flops_per_token(),
        evaluate=eval_fn,
        started=run.started,
    )
    try:
        return loop.run(run.state)
    finally:
        ckpt.close()
        logger.close()


def checkpoint_tree(state) -> dict[str, Any]:
    """The arrays of a train state that a checkpoint holds."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def restore_state(directory: Path, step: int, state):
    """`state` with its arrays replaced by checkpoint `step`, in `state`'s shardings."""
    tree, data_state = restore(directory, step, abstract_like(checkpoint_tree(state)))
    return state.replace(**tree), data_state


@contextmanager
def stop_requests():
    """Turn SIGTERM and SIGINT into a flag the loop polls, so it can checkpoint, then exit 0.

    With several processes, JAX's preemption service keeps SIGTERM (SIGINT is passed on to it as
    SIGTERM) and picks one step at which every process stops: see `stop_due`.
    """
    requested: list[int] = []
    several = jax.process_count() > 1

    def handler(signum, _frame):
        requested.append(signum)
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
    started: float | None = None  # perf_counter() at start-up, for the time to the first step

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
        skips, pending = 0, None  # pending: (step, metrics on device), read one step late
        with stop_requests() as stop:
            for step in range(first, cfg.train.steps + 1):
                profile.before(step, state)
                batch = self.place(next(self.batches))
                if step == first:
                    self.logger.status("compiling the train step…")
                    compile_start = time.perf_counter()
                state, metrics = self.step_fn(state, batch)
                if step == first:  # jit traces and compiles in the call; the step runs after
                    seconds = time.perf_counter() - compile_start
                    self.logger.info(f"compiled the train step in {seconds:.1f}s")
                    self.logger.status("")
                profile.after(step, (state, metrics))
                if pending is not None:
                    skips = skips + 1 if self._finish(*pending, clock) else 0
                    if skips >= cfg.train.max_consecutive_skips:
                        raise RunStopped(
                            f"{skips} consecutive steps had a non-finite loss or gradient (last at "
                            f"step {pending[0]}); stopping with the last good checkpoint kept "
                            f"(train.max_consecutive_skips={cfg.train.max_consecutive_skips})"
                        )
                pending = (step, metrics)
                if self.evaluate is not None and step % cfg.train.eval_every_steps == 0:
                    self.logger.write(step, self.evaluate(state))
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                    self._save(state)
                if stop_due(stop, step):
                    self._finish(*pending, clock)
                    self._save(state)
                    self.ckpt.wait()
                    name = signal.Signals(stop[0]).name if stop else "SIGTERM"
                    self.logger.warn(
                        f"stopped by signal {name} at step {step}; "
                        f"checkpoint saved, run `{self.command}` again to resume"
                    )
                    return state
            if pending is not None:
                skips = skips + 1 if self._finish(*pending, clock) else 0
        self._trained_end = time.perf_counter()
        trained = cfg.train.steps - first + 1
        if trained > 0 and skips == trained:
            raise RunStopped(
                f"every step of this run ({first}..{cfg.train.steps}) had a non-finite loss or "
                "gradient and was skipped; nothing was trained or saved"
            )
        self._save(state)
        self.ckpt.wait()
        self.logger.summary(self._summary(first, int(state.step)))
        return state

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
            checkpoint=cfg.run_dir / "checkpoints" / str(last),
        )

    def _save(self, state) -> None:
        self.ckpt.save(int(state.step), checkpoint_tree(state), self.batches.get_state())

    def _finish(self, step: int, metrics, clock: StepClock) -> bool:
        """Fetch a dispatched step's metrics and log them when due; returns whether it skipped."""
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
        if due or skipped:
            self.logger.write(step, {**values, **(perf or {}), **self._first_step_seconds})
            self._first_step_seconds = {}
        return skipped

    def _first_arrived(self) -> float:
        """Seconds from start-up to the first step's metrics (logged with the next row)."""
        seconds = time.perf_counter() - self.started
        hits, misses = cache_events["hits"], cache_events["misses"]
        cache = self.config.train.compilation_cache_dir
        where = "off" if cache is None else f"{hits} hits, {misses} misses"
        self.logger.info(f"first step after {seconds:.1f}s (compile cache: {where})")
        return seconds
