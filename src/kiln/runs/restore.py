"""Reading a checkpoint back: a step's files checked, then its arrays into a state's shardings.

A checkpoint is written and sealed by `kiln.runs.checkpoint` (the only module that imports
orbax); this module restores one: the whole train state and data-iterator state of a step, the
newest intact step of a run (skipping damaged newer ones), or the parameters alone
(`checkpoint.load_params_from`, `kiln generate`, `kiln export-hf`). A damaged checkpoint is
reported as damage, never as a model that does not match.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from kiln.errors import KilnError, first_line
from kiln.runs.checkpoint import (
    array_shapes,
    check_files,
    complete_steps,
    latest_complete_step,
    read_only_manager,
    restore_args,
)
from kiln.util.checksums import CheckpointDamaged, check_shapes, damaged, non_finite_leaf


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs (with target shardings) of a pytree: what a restore fills in."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _restore_step(
    mgr,
    directory: Path,
    step: int,
    abstract,
    *,
    checksums: bool,
    what: str | None = None,
    local: bool = False,
):
    """(state tree, data state) of one step, checked; CheckpointDamaged or KilnError if not.

    With `what` (the field or command asking, e.g. "kiln generate"), `abstract` is the
    parameters alone, read without the rest of the state; the data state is then {}.
    """
    vouched = check_files(mgr, directory, step, checksums=checksums)
    where = f"{what}: {directory / str(step)}" if what else f"checkpoint {directory / str(step)}"
    try:
        check_shapes(array_shapes(directory, step), abstract, prefix="params." if what else "")
    except CheckpointDamaged:
        raise
    except KilnError as e:
        raise KilnError(f"{where} does not match this model: {e}") from None
    args = restore_args(abstract, local=local, params_only=bool(what))
    try:
        restored = mgr.restore(step, args=args)
    except Exception as e:  # files vouched for (or structure matched) but unreadable: damage
        raise CheckpointDamaged(f"its arrays could not be read ({first_line(e)})") from None
    leaves = jax.tree.leaves(restored.state["params"] if what else restored.state)
    state = jax.tree.unflatten(jax.tree.structure(abstract), leaves)
    if not vouched and (bad := non_finite_leaf(state)):
        raise CheckpointDamaged(f"{'params.' if what else ''}{bad} holds non-finite values")
    return state, ({} if what else dict(restored.data or {}))


def restore(
    directory: Path, step: int | None, abstract_state, *, checksums: bool = True
) -> tuple[Any, dict[str, Any]]:
    """Read checkpoint `step` (None = latest) of `directory` into `abstract_state`'s shardings."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise KilnError(f"checkpoint directory not found: {directory}")
    step = latest_complete_step(directory) if step is None else step
    if step is None:
        raise KilnError(f"no complete checkpoint in {directory}")
    mgr = read_only_manager(directory)
    try:
        return _restore_step(mgr, directory, step, abstract_state, checksums=checksums)
    except CheckpointDamaged as e:
        raise damaged(directory, step, str(e)) from None
    finally:
        mgr.close()


def restore_local(
    directory: Path, step: int, abstract_state, *, checksums: bool
) -> tuple[Any, dict[str, Any]]:
    """(state, data state) of step `step` of this process's node-local `directory`: the shards
    of `abstract_state` this process holds. CheckpointDamaged if its files are not as written."""
    directory = Path(directory).absolute()
    mgr = read_only_manager(directory, local=True)
    try:
        return _restore_step(mgr, directory, step, abstract_state, checksums=checksums, local=True)
    finally:
        mgr.close()


def restore_newest_intact(
    directory: Path, abstract_state, *, checksums: bool, skipped: Callable[[int, str], None]
) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, data state) of the newest intact checkpoint, None if there is none at all;
    `skipped(step, reason)` is told of each damaged newer one. KilnError if all are damaged."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return None
    mgr = read_only_manager(directory)
    try:
        steps = sorted(mgr.all_steps(), reverse=True)
        reasons = []
        for step in steps:
            try:
                state, data = _restore_step(
                    mgr, directory, step, abstract_state, checksums=checksums
                )
            except CheckpointDamaged as e:
                skipped(step, str(e))
                reasons.append(f"step {step}: {e}")
                continue
            return step, state, data
    finally:
        mgr.close()
    if not steps:
        return None
    raise CheckpointDamaged(f"no intact checkpoint in {directory}: {'; '.join(reasons)}")


def restore_params(
    path: str | Path,
    abstract_params,
    *,
    what: str = "checkpoint.load_params_from",
    checksums: bool = True,
) -> tuple[Any, int, list[str]]:
    """(params, step, notes) of a run directory, a checkpoints directory or one step's directory.

    A named step must be intact; otherwise the newest intact step is used, with a note for each
    damaged newer one.
    """
    directory, step = resolve(path)
    return _restore_params(directory, step, abstract_params, what, checksums)


def restore_run_params(
    run_dir: str | Path, abstract_params, step: int | None = None, *, context: str
) -> tuple[Any, int]:
    """(params, step) of checkpoint `step` (None = the newest intact) of a run directory, nothing
    else; a damaged newer checkpoint skipped is said on stderr.

    Errors are KilnErrors starting with `context` (e.g. "kiln generate"): no checkpoint, or
    no checkpoint `step` (naming the steps there are).
    """
    directory = Path(run_dir).expanduser().absolute() / "checkpoints"
    if not directory.is_dir():
        raise KilnError(
            f"{context}: no complete checkpoint in {run_dir}: it has no checkpoints/ directory"
        )
    steps = sorted(complete_steps(directory))
    if not steps:
        raise KilnError(f"{context}: no complete checkpoint in {directory}")
    if step is not None and step not in steps:
        raise KilnError(
            f"{context}: --step {step}: no such checkpoint in {directory}; there are {steps}"
        )
    params, step, notes = _restore_params(directory, step, abstract_params, context, True)
    for note in notes:
        print(f"kiln: {note}", file=sys.stderr)
    return params, step


def _restore_params(directory: Path, step: int | None, abstract_params, what: str, checksums: bool):
    mgr = read_only_manager(directory)
    notes = []
    try:
        candidates = [step] if step is not None else complete_steps(directory)
        if not candidates:
            raise KilnError(f"{what}: no complete checkpoint in {directory}")
        for s in candidates:
            try:
                params, _ = _restore_step(
                    mgr, directory, s, abstract_params, checksums=checksums, what=what
                )
            except CheckpointDamaged as e:
                if s == candidates[-1]:
                    raise KilnError(f"{what}: {damaged(directory, s, str(e))}") from None
                notes.append(f"{what}: checkpoint step {s} skipped, it is damaged: {e}")
                continue
            return params, s, notes
    finally:
        mgr.close()
    raise AssertionError("unreachable: the last candidate returns or raises")


def resolve(path: str | Path) -> tuple[Path, int | None]:
    """(checkpoints directory, step or None for latest) from a run, checkpoints or step path."""
    path = Path(path).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None
    if path.name.isdigit() and ((path / "state").is_dir() or path.parent.name == "checkpoints"):
        return path.parent, int(path.name)
    if path.is_dir():
        return path, None
    raise KilnError(f"checkpoint path not found: {path}")
