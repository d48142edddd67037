"""Checkpoints of a run, on orbax: the only module that imports it, since its API moves fastest.

A checkpoint is a directory `checkpoints/<step>/` with two items: `state` (a pytree of arrays:
step, params, optimizer state) and `data` (the data iterator's JSON state). orbax writes into a
temporary directory and renames it when complete, so a killed save never looks finished;
leftover temporaries are removed when a manager opens the directory. Once orbax has committed a
step, process 0 writes its manifest of checksums (`kiln.util.checksums`). Which steps are
complete and whether a step's files are as written are answered here; `kiln.runs.restore` reads
a step back, with the managers and restore arguments made here, once `check_files` vouched for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from kiln.config import CheckpointConfig
from kiln.errors import RunStopped, first_line, write_error
from kiln.util.checksums import (
    CheckpointDamaged,
    has_manifest,
    step_files,
    verify,
    write_manifest,
)

# Key of orbax's per-step custom metadata: the step was saved by a kiln that writes manifests,
# so a step without one is a save that did not finish (not a checkpoint from before them).
SEALED = "kiln_manifest"


class _QuietOrbax(logging.Filter):
    """Drops orbax's records below CRITICAL: it logs routine events (read-only managers,
    saves) as warnings, and its errors with tracebacks from every thread a failed save ran in,
    while the same error reaches kiln, which reports it in one line. orbax logs through absl's
    logger, which other libraries share, so the filter goes by the file a record comes from."""

    root = str(Path(ocp.__file__).parents[1]) + os.sep  # site-packages/orbax/, as imported

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL or not record.pathname.startswith(self.root)


_QUIET_ORBAX = _QuietOrbax()


def _quiet_closed_loops(previous):
    """sys.unraisablehook without orbax's "Event loop is closed": after one write of a save or
    restore fails, orbax closes its event loop and tensorstore's other callbacks find it
    closed, each printing a traceback that hides the one error kiln reports."""

    def hook(unraisable) -> None:
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        previous(unraisable)

    hook.kiln_quiet = True
    return hook


# Replicated arrays of at least this many bytes per replica slice are written in parallel by
# their replicas (orbax's replica-parallel save, which splits each replica's copy into slices);
# smaller ones by one replica whole. Each slice shape is a program compiled at the first save
# (56 of them for a two-layer DeepSeek model's norms, biases and scalars): one write of a small
# array costs less than compiling its slices.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


def _array_handler() -> None:
    """orbax's handler of jax.Array with the minimum above (once per process)."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if (
        getattr(handler, "_min_slice_bytes_for_replica_parallel", None)
        != REPLICA_PARALLEL_MIN_BYTES
    ):
        handler = ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES
        )
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def _manager(
    directory: Path, cfg: CheckpointConfig | None, *, read_only: bool = False, local: bool = False
):
    """orbax's manager of `directory`; `local`: a node-local directory of this process alone."""
    logging.getLogger("absl").addFilter(_QUIET_ORBAX)  # once: addFilter skips a repeat
    _array_handler()
    if not getattr(sys.unraisablehook, "kiln_quiet", False):
        sys.unraisablehook = _quiet_closed_loops(sys.unraisablehook)
    if local:
        return _local_manager(directory, cfg, read_only)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep if cfg else None,
        keep_period=cfg.keep_every if cfg else None,
        enable_async_checkpointing=bool(cfg and cfg.async_save),
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))


def _local_manager(directory: Path, cfg: CheckpointConfig | None, read_only: bool):
    """A manager that only this process calls (its barriers wait for no other), writing every
    shard this process holds (one copy of each) and committing its step on its own: the shape of
    orbax's emergency local manager, whose slice and replica-axis machinery kiln does not need."""
    me = jax.process_index()
    processes = ocp.options.MultiprocessingOptions(
        primary_host=None, active_processes={me}, barrier_sync_key_prefix=f"kiln-local-{me}"
    )
    arrays = ocp.type_handlers.ArrayHandler(
        primary_host=None, replica_id=None, use_replica_parallel=False
    )
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.local_keep if cfg else None,
        enable_async_checkpointing=bool(cfg and cfg.async_save),
        cleanup_tmp_directories=not read_only,
        create=False,  # orbax refuses it with active_processes: the caller makes the directory
        read_only=read_only,
        multiprocessing_options=processes,
        save_root_metadata=False,
        # orbax signals an asynchronously created directory under a key of the key-value store
        # that every process shares, named by the save's operation number alone: another
        # process's local save of the same number would tell this one its directory is there.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    handlers = {
        "state": ocp.PyTreeCheckpointHandler(
            multiprocessing_options=processes, type_handler_registry=registry
        ),
        "data": ocp.JsonCheckpointHandler(multiprocessing_options=processes),
    }
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _save_args(state, data_state, local: bool):
    state_args = ocp.args.PyTreeSave(state) if local else ocp.args.StandardSave(state)
    return ocp.args.Composite(state=state_args, data=ocp.args.JsonSave(dict(data_state or {})))


def _array_restore_args(abstract):
    """orbax's restore arguments of each array of `abstract`: its sharding, shape and dtype."""
    return jax.tree.map(
        lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype),
        abstract,
    )


def restore_args(abstract, *, local: bool = False, params_only: bool = False):
    """orbax's arguments to restore a step into `abstract`'s shardings (state and data items);
    `params_only`: `abstract` is the parameters alone, read without the rest of the state (the
    restored state is then `{"params": ...}`, with no data item)."""
    if params_only:
        item = {"params": abstract}
        arrays = _array_restore_args(item)
        state = ocp.args.PyTreeRestore(item=item, restore_args=arrays, partial_restore=True)
        return ocp.args.Composite(state=state)
    if local:  # a process's own shards: orbax's per-array arguments name them
        state = ocp.args.PyTreeRestore(item=abstract, restore_args=_array_restore_args(abstract))
    else:
        state = ocp.args.StandardRestore(abstract)
    return ocp.args.Composite(state=state, data=ocp.args.JsonRestore())


def read_only_manager(directory: Path, *, local: bool = False):
    """orbax's manager of `directory` for reading: creates and removes nothing."""
    return _manager(directory, None, read_only=True, local=local)


class Checkpointer:
    """Saves a run's state and data-iterator state under `run_dir/checkpoints`, each step sealed
    by a manifest of checksums once orbax has committed it (in the background when async).

    With `local_directory`, the node-local tier instead: this process's shards alone, in that
    directory (made here), sealed by this process.
    """

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, local_directory: Path | None = None):
        self.local = local_directory is not None
        if self.local:
            self.directory = Path(local_directory).absolute()
            self.directory.mkdir(parents=True, exist_ok=True)
        else:
            self.directory = Path(run_dir).absolute() / "checkpoints"
        self.cfg = cfg
        self._mgr = _manager(self.directory, cfg, local=self.local)
        self._pending: int | None = None  # the step of the latest save started
        self._sealer: threading.Thread | None = None
        self._seal_error: BaseException | None = None
        self.sealed_bytes = 0  # of the last manifest, for benchmarks
        self.sealed: int | None = None  # the newest step this process sealed: complete on disk
        # Called once a step is sealed (in the sealing thread when async): uploads of a run
        # whose output_dir is a URL; its errors stop the run like those of the save.
        self.after_seal: Callable[[], None] | None = None
        # JSON saved with every step in orbax's step metadata (`step_metadata`): the topology
        # that saved it; in the local tier, the shards it holds (`local_tier.identity`).
        self.metadata: dict[str, Any] = {}

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def save(self, step: int, state, data_state: Mapping[str, Any] | None) -> None:
        """Start saving (in the background when async); a save at an existing step is a no-op.

        RunStopped (one line) if the directory cannot be written or an earlier background save
        failed: orbax would otherwise fail in a thread and wait minutes for the lost signal.
        """
        if step in self._mgr.all_steps():
            return
        self.check()
        self._join_sealer()
        with self._failures(step):
            # A probe, so that a read-only or vanished directory stops the run here and now.
            os.rmdir(tempfile.mkdtemp(prefix=".kiln-probe-", dir=self.directory))
            args = _save_args(state, data_state, self.local)
            meta = {**self.metadata, SEALED: 1}
            self._mgr.save(step, args=args, force=True, custom_metadata=meta)
        self._pending = step
        if not self.local and jax.process_index() != 0:
            return
        if self.cfg.async_save:
            self._sealer = threading.Thread(
                target=self._seal_in_background, args=(step,), name="kiln-manifest", daemon=True
            )
            self._sealer.start()
        else:
            with self._failures(step):
                self._seal(step)

    def _seal(self, step: int) -> None:
        # orbax renames the step directory when every process has written its files; its
        # post-finalization callback runs before that rename, so kiln waits for the save instead.
        self._mgr.wait_until_finished()
        self.sealed_bytes = write_manifest(self.directory / str(step))
        self.sealed = step
        if self.after_seal is not None:
            self.after_seal()

    def _seal_in_background(self, step: int) -> None:
        try:
            self._seal(step)
        except BaseException as e:  # re-raised in the main thread by _join_sealer
            self._seal_error = e

    def _join_sealer(self) -> None:
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None
        if self._seal_error is not None:
            error, self._seal_error = self._seal_error, None
            with self._failures(self._pending):
                raise error

    def check(self) -> None:
        """RunStopped if a background save has failed (cheap: called after every step)."""
        if self._pending is not None:
            with self._failures(self._pending):
                self._mgr.check_for_errors()
            if self._seal_error is not None:
                self._join_sealer()

    def wait(self) -> None:
        with self._failures(self._pending):
            self._mgr.wait_until_finished()
            self._mgr.check_for_errors()
        self._join_sealer()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._mgr.close()

    @contextmanager
    def _failures(self, step: int | None) -> Iterator[None]:
        """Errors of saving `step` as one RunStopped line; the last complete checkpoint stays."""
        try:
            yield
        except Exception as e:
            what = self.directory / str(step)
            # The local tier's newest step may be older than the run's newest checkpoint.
            kept = "" if self.local else latest_complete_step(self.directory)
            code = re.search(r"os_error_code='(\d+)'", str(e))  # tensorstore's errors
            if not isinstance(e, OSError) and code:
                e = OSError(int(code[1]), os.strerror(int(code[1])))
            if isinstance(e, OSError):
                raise write_error(e, what, kept) from None
            newest = "" if self.local else f" (last complete checkpoint: {kept})"
            raise RunStopped(f"saving {what} failed: {first_line(e)}{newest}") from None


def complete_steps(directory: Path, *, local: bool = False) -> list[int]:
    """Steps orbax finished in `directory`, newest first, without a save that never sealed."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return []
    mgr = _manager(directory, None, read_only=True, local=local)
    try:
        steps = sorted(mgr.all_steps(), reverse=True)
        return [s for s in steps if has_manifest(directory / str(s)) or not _sealed(mgr, s)]
    finally:
        mgr.close()


def latest_complete_step(directory: Path, *, local: bool = False) -> int | None:
    """Newest finished checkpoint in `directory` (None if there is none); creates nothing."""
    steps = complete_steps(directory, local=local)
    return steps[0] if steps else None


def _sealed(mgr, step: int) -> bool:
    """Whether the step was saved to get a manifest (unreadable metadata: assume not)."""
    try:
        return SEALED in (mgr.metadata(step).custom_metadata or {})
    except Exception:  # a damaged _CHECKPOINT_METADATA: the checks of the step's files decide
        return False


def check_files(mgr, directory: Path, step: int, *, checksums: bool) -> bool:
    """CheckpointDamaged if step's files are not as written; returns whether a manifest vouched."""
    step_dir = directory / str(step)
    if has_manifest(step_dir):
        verify(step_dir, checksums=checksums)
        manifest = True
    elif _sealed(mgr, step):
        raise CheckpointDamaged("its save did not finish (no kiln_manifest.json, written last)")
    elif not step_files(step_dir):
        raise CheckpointDamaged("the step directory is empty")
    else:
        manifest = False  # saved before manifests: checked by structure, then finite values
    data = step_dir / "data" / "metadata"
    try:
        json.loads(data.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"data/metadata is missing or not JSON ({first_line(e)})") from None
    return manifest


def array_shapes(directory: Path, step: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every array of a step's `state`, from orbax's metadata."""
    try:
        tree = ocp.StandardCheckpointHandler().metadata(directory / str(step) / "state").tree
        return {m.name: tuple(m.shape) for m in jax.tree.leaves(tree)}
    except Exception as e:  # orbax raises many types for a missing or garbled _METADATA
        raise CheckpointDamaged(
            f"state/_METADATA is missing or unreadable ({first_line(e)})"
        ) from None


def step_metadata(directory: Path, step: int, *, local: bool = False) -> dict[str, Any]:
    """What `Checkpointer.metadata` held when `step` was saved ({} if unreadable)."""
    mgr = _manager(Path(directory).absolute(), None, read_only=True, local=local)
    try:
        return dict(mgr.metadata(step).custom_metadata or {})
    except Exception:  # damaged or missing metadata: the restore's checks say which
        return {}
    finally:
        mgr.close()
