"""Checkpoints of a run, on orbax: the only module that imports it, since its API moves fastest.

A checkpoint is a directory `checkpoints/<step>/` with two items: `state` (a pytree of arrays:
step, params, optimizer state) and `data` (the data iterator's JSON state). orbax writes into a
temporary directory and renames it when complete, so a killed save never looks finished;
leftover temporaries are removed when a manager opens the directory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from kiln.config import CheckpointConfig, Config, read_run_config
from kiln.errors import KilnError
from kiln.mesh import make_mesh, sharded_abstract
from kiln.model import LanguageModel, build_model


class _QuietOrbax(logging.Filter):
    """Drops orbax's records below ERROR: it logs routine events (read-only managers, saves)
    as warnings, and kiln reports its own. orbax logs through absl's logger, which other
    libraries share, so the filter goes by the file a record comes from."""

    root = str(Path(ocp.__file__).parents[1]) + os.sep  # site-packages/orbax/, as imported

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not record.pathname.startswith(self.root)


_QUIET_ORBAX = _QuietOrbax()


def _manager(directory: Path, cfg: CheckpointConfig | None, *, read_only: bool = False):
    logging.getLogger("absl").addFilter(_QUIET_ORBAX)  # once: addFilter skips a repeat
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

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def save(self, step: int, state, data_state: Mapping[str, Any] | None) -> None:
        """Start saving (in the background when async); a save at an existing step is a no-op."""
        if step in self._mgr.all_steps():
            return
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(dict(data_state or {})),
        )
        self._mgr.save(step, args=args, force=True)

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()


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


def restore_params(path: str | Path, abstract_params) -> tuple[Any, int]:
    """Only the params of a run directory, a checkpoints directory or one step's directory."""
    directory, step = resolve(path)
    return _restore_params(directory, step, abstract_params, "checkpoint.load_params_from")


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
