"""The stateful run around a pure step: set-up, resume, checkpoints, signals, metrics one step late.

Shared by `kiln train` and `kiln distill`: the caller supplies its objective and train state
(`prepare_run`); this module owns everything that touches files, clocks and signals.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from kiln.config import Config
from kiln.data import make_datasets
from kiln.data.eval_tasks import parse_tasks
from kiln.data.pipeline import FirstRead
from kiln.errors import write_error
from kiln.model import check_state_memory
from kiln.model.attention import check as check_attention
from kiln.parallel.distributed import initialize
from kiln.parallel.mesh import describe_topology, make_mesh, topology
from kiln.runs import local_tier, pinned
from kiln.runs import sync as run_sync
from kiln.runs.checkpoint import Checkpointer, latest_complete_step, step_metadata
from kiln.runs.lock import RunLock
from kiln.runs.paths import check_output_paths
from kiln.runs.remote import local_run
from kiln.runs.restore import abstract_like, restore_newest_intact, restore_params
from kiln.runs.rundir import (
    RunComplete,
    check_entries,
    keep_config_history,
    move_aside,
    restart_target,
)
from kiln.training import goodput, train
from kiln.training.batches import place_batch
from kiln.training.loop import Loop, checkpoint_tree
from kiln.training.metrics import MetricsLogger
from kiln.training.objective import Objective
from kiln.training.optim import make_optimizer, state_name
from kiln.training.profiling import compilation_cache_for
from kiln.training.resume import check_start, previous_config, resume_changes, starts_over
from kiln.training.scoring import Evaluator, load_tasks
from kiln.training.tracking import check_wandb
from kiln.util.checksums import set_aside


def open_run_dir(
    run_dir: Path,
    config: Config,
    lock: RunLock,
    start_step: int = 0,
    restart_to: Path | None = None,
) -> tuple[bool, str | None]:
    """Write the run directory and its config.yaml on process 0, which holds the run's lock;
    returns whether this is process 0, and a note if a dead process's lock was taken over.

    With several processes, nothing is written until every one of them has validated its config,
    data and checkpoint (and has read the old config.yaml, which process 0 now replaces). A
    changed config.yaml is kept as config.<start_step>.yaml; `--restart` first moves the earlier
    run to `restart_to`.
    """
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("kiln: every process validated the run")
    is_main = jax.process_index() == 0
    note = None
    if is_main:
        try:
            if restart_to is not None:
                move_aside(run_dir, restart_to)
            run_dir.mkdir(parents=True, exist_ok=True)
            note = lock.acquire()  # a no-op if taken at start-up (the directory existed then)
            keep_config_history(run_dir, config, start_step)
            (run_dir / "config.yaml").write_text(config.to_yaml())
        except OSError as e:
            raise write_error(e, e.filename or run_dir) from None
    return is_main, note


def newest_checkpoint(config: Config) -> int | None:
    """The newest step complete in either tier: the run directory's checkpoints, or the local
    tier on every process (a collective with several processes)."""
    steps = [latest_complete_step(config.run_dir / "checkpoints")]
    steps.append(next(iter(local_tier.agreed_steps(config)[0]), None))
    return max((s for s in steps if s is not None), default=None)


def resume_notes(config: Config, restart: bool = False, latest: Any = ...) -> list[str]:
    """What changed since the earlier invocation of this run (KilnError if it may not change,
    checkpoint or not); then whether the run has anything to do
    (`kiln.training.resume.check_start`). `latest`: the newest checkpoint, if known
    (`newest_checkpoint`, a collective with several processes)."""
    if restart:
        return []
    if latest is ...:
        latest = newest_checkpoint(config)
    previous = previous_config(config.run_dir)
    changes = resume_changes(previous, config, latest is not None) if previous else []
    check_start(config, previous, latest)
    return [f"changed on resume: {c}" for c in changes]


def restore_latest(config: Config, state, batches, mesh) -> tuple[Any, list[str], list[int], bool]:
    """`state` and the data iterator from the run's newest intact checkpoint, if there is one;
    also a note per damaged newer checkpoint skipped, their steps (set aside by run_loop), and
    whether the state came from the local tier (`kiln.runs.local_tier`): its newest step complete
    on every process, when newer than the persistent tier's.

    A checkpoint saved on another topology than `mesh`'s (processes, devices, mesh shape) says
    so in its note: the state and data order carry over, the sums of a step change order."""
    directory = config.run_dir / "checkpoints"
    notes, skipped = [], []
    abstract = abstract_like(checkpoint_tree(state))
    if config.checkpoint.local_dir is not None:
        found, notes = local_tier.restore_newest(config, abstract, latest_complete_step(directory))
        if found is not None:
            step, tree, data_state = found
            batches.set_state(data_state)
            where = local_tier.tier_root(config) / f"process_<i>/{step}"
            return (
                state.replace(**tree),
                [f"resuming from step {step} (local checkpoint tier {where})", *notes],
                [],
                True,
            )

    def skip(step: int, reason: str) -> None:
        skipped.append(step)
        notes.append(
            f"checkpoint step {step} skipped, it is damaged: {reason}; "
            f"moved to {config.run_dir / 'damaged-checkpoints'}"
        )

    found = restore_newest_intact(
        directory, abstract, checksums=config.checkpoint.verify, skipped=skip
    )
    if found is None:
        return state, notes, skipped, False
    step, tree, data_state = found
    state = state.replace(**tree)
    if data_state:  # empty for a checkpoint of `kiln import-hf`: data from the start
        batches.set_state(data_state)
    resuming = [f"resuming from step {step} ({directory / str(step)})"]
    saved, now = step_metadata(directory, step).get("topology"), topology(mesh)
    if saved is not None and saved != now:
        try:
            was = describe_topology(saved)
        except (AttributeError, KeyError, TypeError, ZeroDivisionError):  # written by another kiln
            was = f"{saved!r}"
        resuming.append(f"resuming on another topology: {was} -> {describe_topology(now)}")
    return state, [*resuming, *notes], skipped, False


@dataclass
class PreparedRun:
    """A validated run, ready to loop: nothing has been written to its run directory yet."""

    config: Config
    command: str  # what the user runs to resume it, e.g. "kiln train"
    mesh: Any
    objective: Objective
    state: train.TrainState
    datasets: Any
    batches: Iterator
    notes: list[str]
    started: float  # time.perf_counter() when preparation began
    clock: goodput.Clock  # where this attempt's wall time goes (goodput)
    lock: RunLock  # held by process 0 (taken in `prepare_run` or, for a new run, `run_loop`)
    eval_tasks: list = field(default_factory=list)  # train.eval_tasks, read and tokenized
    damaged: list[int] = field(default_factory=list)  # steps to set aside
    from_local: bool = False  # the state was restored from the local checkpoint tier
    inputs: dict[str, Any] = field(default_factory=dict)  # pinned in inputs.json
    restart_to: Path | None = None  # `--restart`: where the earlier run is moved
    sync: run_sync.RunSync | None = None  # a URL train.output_dir: the mirror's link to it
    # A start-over after an attempt that saved no checkpoint: that attempt's metrics.jsonl, moved
    # aside with it, whose goodput figures this run carries on (all its steps are lost work).
    carry_from: Path | None = None


def execute(
    config: Config,
    build: Callable[[Config, Any], tuple[Objective, train.TrainState, list[str]]],
    *,
    command: str,
    check: Callable[[Config], Any] | None = None,
    restart: bool = False,
    wrap_batches: Callable[[Config, Any, Iterator], Iterator] | None = None,
    whole_process: bool = False,
    abstract: Callable[[Config, Any], tuple[Objective, train.TrainState]] | None = None,
):
    """`prepare_run`, then `run_loop`, with the run's persistent compilation cache in use.

    A finished run (latest checkpoint at or past train.steps) says so in one line and returns
    None, having read its config.yaml and checkpoint steps and written nothing.
    """
    with compilation_cache_for(config):
        try:
            run = prepare_run(
                config, build, command=command, check=check, restart=restart,
                wrap_batches=wrap_batches, whole_process=whole_process, abstract=abstract,
            )  # fmt: skip
        except RunComplete as done:
            if jax.process_index() == 0:
                print(f"kiln: {done}", file=sys.stderr)
            return None
        return run_loop(run)


def prepare_run(
    config: Config,
    build: Callable[[Config, Any], tuple[Objective, train.TrainState, list[str]]],
    *,
    command: str,
    check: Callable[[Config], Any] | None = None,
    restart: bool = False,
    wrap_batches: Callable[[Config, Any, Iterator], Iterator] | None = None,
    whole_process: bool = False,
    abstract: Callable[[Config, Any], tuple[Objective, train.TrainState]] | None = None,
) -> PreparedRun:
    """Validate against devices, data and any earlier run; build the state; resume or load.

    `build(config, mesh) -> (objective, fresh state, notes)`; `check(config)` runs cheap
    validation before any data or parameters are touched. The state then comes from the
    run's latest checkpoint (with the data iterator's position) or, for a new run, takes
    `checkpoint.load_params_from`'s parameters (those the objective adds to the model, e.g. a
    distillation projection, stay fresh). `restart`: start over; the earlier run is moved aside
    when the run directory is opened. `wrap_batches(config, datasets, iterator)` adds keys to
    the training batches (an iterator with the data's get_state/set_state, restored with it).
    `whole_process`: this process is the command's own (`kiln train`), so the run's goodput
    counts its start-up from the start of the process, interpreter and imports included; else
    from this call. `abstract(config, mesh) -> (objective, state as sharded
    ShapeDtypeStructs)`: what a resume restores into instead of a fresh state, which it would
    initialise only to replace (its initialisation's time and, until then, twice the memory).
    Raises RunComplete when there is nothing to train.
    """
    started = time.perf_counter()
    clock = goodput.Clock(whole_process)
    check_output_paths(config)
    initialize(config)  # before any device is touched
    lock = RunLock(config.run_dir, command)
    # An existing run is locked before its checkpoints are read (and before a URL's files are
    # fetched into its mirror); a new one when it is written.
    main = jax.process_index() == 0
    taken = lock.acquire() if main and config.run_dir.is_dir() else None
    try:
        sync = run_sync.start(config)  # a URL output_dir: the mirror is up to date from here
        if main and config.run_dir.is_dir():  # a mirror the fetch made (a no-op if held)
            taken = lock.acquire() or taken
        run = _prepare(
            config, build, abstract, command, check, lock, started, restart, wrap_batches, clock
        )
    except BaseException:
        lock.release()
        raise
    if taken:
        run.notes.insert(0, taken)
    if sync is not None:
        run.sync = sync
        run.notes.insert(
            0,
            f"run directory {sync.url} mirrored in {config.run_dir} "
            f"({sync.fetched} files fetched); uploaded after each checkpoint",
        )
    return run


def _prepare(
    config, build, abstract, command, check, lock, started, restart, wrap, clock
) -> PreparedRun:
    # These read only metrics.jsonl, config.yaml and the checkpoint steps.
    check_entries(config.run_dir, restart)
    latest = None if restart else newest_checkpoint(config)  # in either tier
    notes = resume_notes(config, restart, latest)  # a changed model is refused, checkpoint or not
    over = None if restart else starts_over(config.run_dir, latest)
    if over is not None:  # a new start, not a resume: nothing "changed on resume"
        notes, restart = [], True
    mesh = make_mesh(config)
    # Before data is read or a parameter allocated.
    check_state_memory(config, mesh, make_optimizer(config.optim).init, state_name(config.optim))
    check_attention(config.model.attention, mesh.devices.flat[0].platform, config.model.dtype)
    check_wandb(config)
    if check is not None:
        check(config)
    datasets = make_datasets(config)
    eval_tasks = []
    if config.train.eval_every_steps:  # tasks run beside the held-out loss, or not at all
        specs = parse_tasks(config.train.eval_tasks)
        eval_tasks = load_tasks(specs, config, datasets.tokenizer)
    if not restart:
        pinned.check_data(config, datasets.inputs)
    objective = state = None
    if abstract is not None and latest is not None and not restart:
        objective, state = abstract(config, mesh)
        if jax.tree.leaves(state.rest):  # variables a checkpoint does not hold: initialised
            objective = state = None
    if state is None:
        objective, state, built_notes = build(config, mesh)
    else:
        built_notes = []
    batches = datasets.train_iterator()
    if wrap is not None:
        batches = wrap(config, datasets, batches)
    restart_to = restart_target(config.run_dir) if restart else None
    if restart_to is not None:
        why = over or "--restart"
        notes.append(f"{why}: the earlier run in {config.run_dir} moves to {restart_to}")
    with clock.within("checkpoint"):
        state, resumed, damaged, from_local = (
            (state, [], [], False) if restart else restore_latest(config, state, batches, mesh)
        )
    if isinstance(state.step, jax.ShapeDtypeStruct):  # no intact checkpoint after all
        objective, state, built_notes = build(config, mesh)
    batches = FirstRead(batches)  # the first batch to train on, read before anything is written
    source = config.checkpoint.load_params_from
    if resumed:
        notes[:0] = resumed
    elif source:
        keep = objective.extra_param_keys
        target = nnx.State({k: v for k, v in state.params.items() if k not in keep})
        with clock.within("checkpoint"):
            params, step, skipped = restore_params(
                local_run(source, "checkpoint.load_params_from", config),
                target,
                what="checkpoint.load_params_from",
                checksums=config.checkpoint.verify,
            )
        state = state.replace(params=nnx.State.merge(state.params, params))
        notes[:0] = [f"parameters from {source} (step {step})", *skipped]
    notes += built_notes
    return PreparedRun(
        config,
        command,
        mesh,
        objective,
        state,
        datasets,
        batches,
        notes,
        started,
        clock,
        lock,
        eval_tasks,
        damaged,
        from_local,
        {**datasets.inputs, **objective.pinned_inputs()},
        restart_to,
        carry_from=None if over is None or restart_to is None else restart_to / "metrics.jsonl",
    )


def run_loop(run: PreparedRun):
    """Write the run directory (everything is validated by now), then loop, log and save."""
    config, mesh = run.config, run.mesh
    try:
        is_main, taken = open_run_dir(
            config.run_dir, config, run.lock, int(run.state.step), run.restart_to
        )
        if is_main:
            pinned.write(config.run_dir, run.inputs)
        if run.damaged:
            if is_main:
                set_aside(config.run_dir / "checkpoints", run.damaged)
            if jax.process_count() > 1:  # no process opens its checkpoint manager before the move
                multihost_utils.sync_global_devices("kiln: damaged checkpoints set aside")
        ckpt = Checkpointer(config.run_dir, config.checkpoint)
        ckpt.metadata = {"topology": topology(mesh)}  # a resume elsewhere says it moved
        if run.sync is not None:  # a sealed checkpoint goes up, then the logs beside it
            ckpt.after_seal = run.sync.push
    except BaseException as e:
        run.lock.release()
        if isinstance(e, OSError):
            raise write_error(e, config.run_dir / "checkpoints") from None
        raise
    try:
        local = local_tier.open_tier(config, int(run.state.step) if run.from_local else None)
    except BaseException as e:
        _close_all((ckpt.close, run.lock.release), failing=True)
        if isinstance(e, OSError):
            raise write_error(e, e.filename or local_tier.tier_root(config)) from None
        raise
    closers = (ckpt.close,) if local is None else (ckpt.close, local.close)
    base = {}
    try:
        if is_main:  # before the rows after the restored step are dropped: they tell work lost
            restored = 0 if run.carry_from else int(run.state.step)
            base = goodput.carried(run.carry_from or config.run_dir / "metrics.jsonl", restored)
        logger = MetricsLogger(
            config.run_dir,
            config,
            enabled=is_main,
            start_step=int(run.state.step),
            started=run.started,
        )
    except BaseException:
        _close_all((*closers, run.lock.release), failing=True)
        raise
    failing = True
    try:
        for note in ([taken] if taken else []) + run.notes + run.datasets.notes:
            logger.info(note)
        for warning in run.datasets.warnings:
            logger.warn(warning)

        eval_fn = None
        if config.train.eval_every_steps:
            eval_step = train.make_eval_step(config, mesh)
            # By source: one set, or each source of a mixture (eval/loss/<name>).
            eval_sets = run.datasets.eval_sets(config.train.eval_batches)
            tasks = Evaluator(config, mesh, run.eval_tasks) if run.eval_tasks else None

            def eval_fn(state):
                held_out = run.datasets.combine_eval(
                    {
                        name: train.evaluate(eval_step, state, batches, mesh, config)
                        for name, batches in eval_sets.items()
                    }
                )
                return held_out if tasks is None else {**held_out, **tasks.metrics(state)}

        loop = Loop(
            config=config,
            command=run.command,
            step_fn=train.make_step(run.objective, train.shardings_of(run.state)),
            place=lambda batch: place_batch(batch, mesh, config),
            batches=run.batches,
            ckpt=ckpt,
            local=local,
            logger=logger,
            flops_per_token=run.objective.flops_per_token(),
            evaluate=eval_fn,
            started=run.started,
            clock=run.clock,
            goodput_base=base,
        )
        state = loop.run(run.state)
        failing = False
        return state
    finally:
        push = () if run.sync is None else (run.sync.push,)  # after the last save and rows
        _close_all((*closers, logger.close, *push, run.lock.release), failing=failing)


def _close_all(closers, *, failing: bool) -> None:
    """Call each closer; while an error is on its way out, a closer's own error (e.g. the disk
    that failed the run failing the last flush too) must not replace it."""
    first = None
    for close in closers:
        try:
            close()
        except Exception as e:
            first = first or e
    if first is not None and not failing:
        raise first
