"""The node-local checkpoint tier: frequent saves to each host's own disk, beside the persistent
checkpoints of the run directory.

Process `i` saves the shards it holds (one copy of each) and the data iterator's state to
`checkpoint.local_dir/<run_name>/process_<i>/<step>/`, on its own (`Checkpointer` with a local
directory: atomic, async, sealed by a manifest of checksums). No host reads another's
directory, so a local step is usable only where every process has it complete and holds the
same shards of the same arrays as when it was saved (the same process count, mesh and
shardings); the processes agree on that with an all-gather before anything is restored.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from kiln.config import Config
from kiln.errors import KilnError
from kiln.runs.checkpoint import Checkpointer, complete_steps, step_metadata
from kiln.runs.restore import restore_local
from kiln.util.checksums import CheckpointDamaged

KEY = "kiln_local"  # of orbax's per-step custom metadata: which run and layout saved the step
# Local steps each process offers to the agreement (newest first): more than checkpoint.local_keep.
OFFERED = 16


def tier_root(config: Config) -> Path | None:
    """`local_dir/<run_name>`, shared by the processes of one host; None without a local tier."""
    if config.checkpoint.local_dir is None:
        return None
    return Path(config.checkpoint.local_dir).expanduser().absolute() / config.train.run_name


def process_dir(root: Path) -> Path:
    return root / f"process_{jax.process_index()}"


def layout(tree) -> str:
    """Digest of each array's name, shape, dtype and the index ranges of the shards this process
    holds: equal at save and restore exactly when this process can restore its part alone."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        indices = leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
        spans = sorted(
            {tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape, strict=True))
             for index in indices}
        )  # fmt: skip
        entry = [jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype), spans]
        digest.update(json.dumps(entry).encode())
    return digest.hexdigest()


def _check_covered(tree) -> None:
    """KilnError if orbax's local save would leave out a shard this process holds: it writes the
    addressable shards of one replica number, that of the first (`replica_id=None`), which on
    every regular mesh covers them all; a device order where it does not is refused, not saved
    with a hole that a restore would fill with zeros."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shards = leaf.addressable_shards
        chosen = {str(s.index) for s in shards if s.replica_id == shards[0].replica_id}
        if chosen != {str(s.index) for s in shards}:
            raise KilnError(
                f"checkpoint.local_dir: on process {jax.process_index()} the shards of "
                f"{jax.tree_util.keystr(path)} are replicas of different numbers, which a local "
                "save cannot write whole; allowed: checkpoint.local_every_steps: 0 with this "
                "mesh's device order"
            )


def identity(config: Config, tree) -> dict[str, Any]:
    """The metadata a local step is saved with (`Checkpointer.metadata`); checks first that the
    save writes every shard of this process."""
    _check_covered(tree)
    return {
        KEY: {
            "run_dir": str(config.run_dir.absolute()),
            "processes": jax.process_count(),
            "layout": layout(tree),
        }
    }


def own_steps(config: Config) -> list[int]:
    """This process's complete local steps of this run and process count, newest first; none
    for a run directory without its config.yaml (deleted by hand: a new run of the same path)."""
    root = tier_root(config)
    if root is None or not (config.run_dir / "config.yaml").is_file():
        return []
    directory = process_dir(root)
    out = []
    for step in complete_steps(directory, local=True):
        saved = step_metadata(directory, step, local=True).get(KEY, {})
        if (
            saved.get("run_dir") == str(config.run_dir.absolute())
            and saved.get("processes") == jax.process_count()
        ):
            out.append(step)
    return out


def agreed_steps(config: Config) -> tuple[list[int], int | None, list[int]]:
    """(local steps complete on every process, newest first; the newest local step of any
    process; the processes lacking it). A collective with several processes."""
    if tier_root(config) is None:  # the same config on every process: none of them gathers
        return [], None, []
    mine = own_steps(config)[:OFFERED]
    if jax.process_count() == 1:
        return mine, (mine[0] if mine else None), []
    offered = np.full(OFFERED, -1, np.int32)
    offered[: len(mine)] = mine
    rows = np.asarray(multihost_utils.process_allgather(offered))  # [processes, OFFERED]
    held = [set(int(s) for s in row if s >= 0) for row in rows]
    common = sorted(set.intersection(*held), reverse=True)
    newest = max((max(h) for h in held if h), default=None)
    lacking = [p for p, h in enumerate(held) if newest is not None and newest not in h]
    return common, newest, lacking


def _all(flag: bool) -> list[int]:
    """The processes where `flag` is false (every process calls this at the same point)."""
    if jax.process_count() == 1:
        return [] if flag else [0]
    flags = np.asarray(multihost_utils.process_allgather(np.asarray([flag], np.int32)))
    return [p for p, f in enumerate(flags.reshape(-1)) if not f]


def restore_newest(
    config: Config, abstract, after: int | None
) -> tuple[tuple[int, Any, dict[str, Any]] | None, list[str]]:
    """((step, state, data state) of the newest local step newer than `after` (the persistent
    tier's newest) that every process restores, or None; notes on the local steps passed over).

    A collective with several processes: every process calls it.
    """
    root = tier_root(config)
    steps, newest, lacking = agreed_steps(config)
    notes = []
    if newest is not None and lacking and (after is None or newest > after):
        where = ", ".join(map(str, lacking))
        notes.append(
            f"local checkpoint step {newest} skipped: not complete on every process "
            f"(missing on process {where})"
        )
    for step in steps:
        if after is not None and step <= after:
            break
        found, reason = None, ""
        directory = process_dir(root)
        try:
            saved = step_metadata(directory, step, local=True).get(KEY, {})
            if saved.get("layout") != layout(abstract):
                raise CheckpointDamaged(
                    "it holds other shards than this process needs (another mesh or sharding)"
                )
            found = restore_local(directory, step, abstract, checksums=config.checkpoint.verify)
        except KilnError as e:  # damage, or a model that does not match: the others must hear
            reason = str(e)
            if jax.process_index() != 0:  # process 0's reason is in the note below
                print(f"kiln: local checkpoint step {step} unusable here: {e}", file=sys.stderr)
        failed = _all(found is not None)
        if not failed:
            return (step, *found), notes
        why = f": {reason}" if reason else ""
        notes.append(
            f"local checkpoint step {step} skipped: not usable on process "
            f"{', '.join(map(str, failed))}{why}"
        )
    return None, notes


def open_tier(config: Config, restored: int | None) -> Checkpointer | None:
    """This process's local Checkpointer, its directory holding only the local step the run
    resumed from (`restored`, None if it did not): the others are of an earlier attempt of the
    run, newer than where it goes on, or of another run. None without a local tier."""
    root = tier_root(config)
    if root is None:
        return None
    directory = process_dir(root)
    if directory.is_dir():
        for entry in directory.iterdir():
            if entry.name != str(restored):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    return Checkpointer(config.run_dir, config.checkpoint, local_directory=directory)
