"""Checkpoints of a run, on orbax: the only module that imports it, since its API moves fastest.

A checkpoint is a directory `checkpoints/<step>/` with two items: `state` (a pytree of arrays:
step, params, optimizer state) and `data` (the data iterator's JSON state). orbax writes into a
temporary directory and renames it when complete, so a killed save never looks finished;
leftover temporaries are removed when a manager opens the directory.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from kiln.config import CheckpointConfig, Config, read_run_config
from kiln.errors import KilnError, RunStopped, write_error
from kiln.mesh import make_mesh, sharded_abstract
from kiln.model import LanguageModel, build_model


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


def _manager(directory: Path, cfg: CheckpointConfig | None, *, read_only: bool = False):
    logging.getLogger("absl").addFilter(_QUIET_ORBAX)  # once: addFilter skips a repeat
    if not getattr(sys.unraisablehook, "kiln_quiet", False):
        sys.unraisablehook = _quiet_closed_loops(sys.unraisablehook)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep if cfg else None,
        keep_period=cfg.keep_every if cfg else None,
        enable_async_checkpointing=bool(cfg and cfg.async_save),
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs (with target shardings) of a pytree: what a restore fills in."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


class Checkpointer:
    """Saves and restores a run's state and data-iterator state under `run_dir/checkpoints`."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self.cfg = cfg
        self._mgr = _manager(self.directory, cfg)
        self._pending: int | None = None  # the step of the latest save started

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
        with self._failures(step):
            # A probe, so that a read-only or vanished directory stops the run here and now.
            os.rmdir(tempfile.mkdtemp(prefix=".kiln-probe-", dir=self.directory))
            args = ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(dict(data_state or {})),
            )
            self._mgr.save(step, args=args, force=True)
        self._pending = step

    def check(self) -> None:
        """RunStopped if a background save has failed (cheap: called after every step)."""
        if self._pending is not None:
            with self._failures(self._pending):
                self._mgr.check_for_errors()

    def wait(self) -> None:
        with self._failures(self._pending):
            self._mgr.wait_until_finished()
            self._mgr.check_for_errors()

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
            kept = latest_complete_step(self.directory)
            code = re.search(r"os_error_code='(\d+)'", str(e))  # tensorstore's errors
            if not isinstance(e, OSError) and code:
                e = OSError(int(code[1]), os.strerror(int(code[1])))
            if isinstance(e, OSError):
                raise write_error(e, what, kept) from None
            raise RunStopped(
                f"saving {what} failed: {_first_line(e)} (last complete checkpoint: {kept})"
            ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:300] if text else "") or type(e).__name__


def restore(directory: Path, step: int | None, abstract_state) -> tuple[Any, dict[str, Any]]:
    """Read checkpoint `step` (None = latest) of `directory` into `abstract_state`'s shardings."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise KilnError(f"checkpoint directory not found: {directory}")
    mgr = _manager(directory, None, read_only=True)
    try:
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise KilnError(f"no complete checkpoint in {directory}")
        try:
            restored = mgr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
                ),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise KilnError(
                f"checkpoint {directory / str(step)} does not match this model: "
                f"{str(e).splitlines()[0][:300]}"
            ) from None
    finally:
        mgr.close()
    leaves = jax.tree.leaves(restored.state)
    state = jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)
    return state, dict(restored.data or {})


def restore_params(
    path: str | Path, abstract_params, field: str = "checkpoint.load_params_from"
) -> tuple[Any, int]:
    """Only the params of a run directory, a checkpoints directory or one step's directory;
    errors name `field`, the setting that pointed here."""
    directory, step = resolve(path)
    return _restore_params(directory, step, abstract_params, field)


def restore_run_params(
    run_dir: str | Path, abstract_params, step: int | None = None, *, context: str
) -> tuple[Any, int]:
    """(params, step) of checkpoint `step` (None = latest) of a run directory, nothing else.

    Errors are KilnErrors starting with `context` (e.g. "kiln generate"): no checkpoint, or
    no checkpoint `step` (naming the steps there are).
    """
    directory = Path(run_dir).expanduser().absolute() / "checkpoints"
    mgr = _manager(directory, None, read_only=True) if directory.is_dir() else None
    try:
        steps = sorted(mgr.all_steps()) if mgr is not None else []
    finally:
        if mgr is not None:
            mgr.close()
    if mgr is None:
        raise KilnError(
            f"{context}: no complete checkpoint in {run_dir}: it has no checkpoints/ directory"
        )
    if not steps:
        raise KilnError(f"{context}: no complete checkpoint in {directory}")
    if step is not None and step not in steps:
        raise KilnError(
            f"{context}: --step {step}: no such checkpoint in {directory}; there are {steps}"
        )
    return _restore_params(directory, steps[-1] if step is None else step, abstract_params, context)


def _restore_params(directory: Path, step: int | None, abstract_params, context: str):
    mgr = _manager(directory, None, read_only=True)
    try:
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise KilnError(f"{context}: no complete checkpoint in {directory}")
        item = {"params": abstract_params}
        restore_args = jax.tree.map(
            lambda a: ocp.ArrayRestoreArgs(
                sharding=a.sharding, global_shape=a.shape, dtype=a.dtype
            ),
            item,
        )
        try:
            restored = mgr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=item, restore_args=restore_args, partial_restore=True
                    )
                ),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise KilnError(
                f"{context}: {directory / str(step)} does not match this model: "
                f"{str(e).splitlines()[0][:300]}"
            ) from None
    finally:
        mgr.close()
    leaves = jax.tree.leaves(restored.state["params"])
    return jax.tree.unflatten(jax.tree.structure(abstract_params), leaves), step


class RunModel(NamedTuple):
    """A trained run's model, its parameters restored onto the mesh of its config."""

    config: Config
    mesh: Mesh
    model: LanguageModel
    step: int


def load_run_model(run_dir: str | Path, step: int | None = None, *, context: str) -> RunModel:
    """The model of a run directory at checkpoint `step` (None = latest), parameters only.

    The mesh is the run config's (`mesh.*` over this process's devices); parameters are read
    straight into their shardings on it, and optimizer state is never read.
    """
    config = read_run_config(Path(run_dir).expanduser(), context)
    mesh = make_mesh(config)
    graphdef, abstract = sharded_abstract(
        lambda: build_model(config.model, rngs=nnx.Rngs(0)), mesh, config.mesh.rules
    )
    target, rest = nnx.split_state(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise KilnError(f"{context}: the {config.model.family} model has non-parameter state")
    params, step = restore_run_params(run_dir, target, step, context=context)
    return RunModel(config, mesh, nnx.merge(graphdef, params), step)


def resolve(path: str | Path) -> tuple[Path, int | None]:
    """(checkpoints directory, step or None for latest) from a run, checkpoints or step path."""
    path = Path(path).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None
    if path.name.isdigit() and (path / "state").is_dir():
        return path.parent, int(path.name)
    if path.is_dir():
        return path, None
    raise KilnError(f"checkpoint path not found: {path}")


def latest_complete_step(directory: Path) -> int | None:
    """Newest finished checkpoint in `directory` (None if there is none); creates nothing."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return None
    mgr = _manager(directory, None, read_only=True)
    try:
        return mgr.latest_step()
    finally:
        mgr.close()
