"""Batch placement: a global batch's rows on the mesh, and its layouts inside the step.

`place_batch` puts each process's rows of a global batch on the devices that hold them (the
host-to-device side of every command that runs a step), `abstract_batch` is the same layout
without arrays (`kiln compile`); inside the traced step, `micro_batches` cuts a global batch
for gradient accumulation and `balance_batch` permutes the tokens along the sequence for
context-parallel load balance.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from kiln.config import Config
from kiln.config.axes import entry_axes
from kiln.errors import KilnError
from kiln.model.attention import balanced_order, sequence_shards
from kiln.parallel.mesh import batch_sharding, logical_spec

Batch = Mapping[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")


def place_batch(batch: Mapping[str, Any], mesh: Mesh, config: Config) -> Batch:
    """Put this process's rows of a global batch on the mesh as global arrays.

    Process p of P holds rows p*n .. (p+1)*n - 1 of the global batch (n = its row count), the
    rows its own devices hold, so the global array is the same for any number of processes.
    """
    sharding = batch_sharding(mesh, config.mesh.rules)
    out = {}
    # Keys beyond the token stream's (e.g. stored teacher logits) share its leading [B, S] layout.
    for k in (*BATCH_KEYS, *(k for k in batch if k not in BATCH_KEYS)):
        x = batch[k]
        if isinstance(x, jax.Array) and x.sharding == sharding:
            out[k] = x
        else:
            x = np.asarray(x)
            shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
            _check_process_rows(sharding, shape, jax.process_index(), jax.process_count())
            out[k] = jax.make_array_from_process_local_data(sharding, x, shape)
    return out


@functools.lru_cache(maxsize=8)
def _check_process_rows(sharding: NamedSharding, shape: tuple[int, ...], p: int, count: int):
    """KilnError unless process `p` of `count` has devices holding exactly its own batch rows."""
    n = shape[0] // count
    held = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        held.update(range(*index[0].indices(shape[0])))
    if held != set(range(p * n, (p + 1) * n)):
        raise KilnError(
            f"mesh: the devices of process {p} hold {len(held)} rows of each global batch "
            f"(from row {min(held)}), but its data are rows {p * n}..{(p + 1) * n - 1}; split the "
            f"batch over the {count} processes: the mesh axes of its rows "
            f"(mesh.rules.batch: {list(entry_axes(sharding.spec[0]))}) must span the processes "
            "(tensor and sequence axes within a process)"
        )


def abstract_batch(config: Config, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch as ShapeDtypeStructs in the sharding `place_batch` gives the real one."""
    shape = (config.train.global_batch_size, config.data.seq_len)
    sharding = batch_sharding(mesh, config.mesh.rules)
    dtype = {k: jnp.float32 if k == "weights" else jnp.int32 for k in BATCH_KEYS}
    return {k: jax.ShapeDtypeStruct(shape, dtype[k], sharding=sharding) for k in BATCH_KEYS}


def micro_batches(batch: Batch, accum: int, mesh: Mesh, rules) -> Batch:
    """[G, S] -> [accum, G/accum, S], micro-batch a = rows a, a+accum, ... (keeps each shard's rows)."""
    sharding = NamedSharding(mesh, logical_spec((None, "batch", "length"), rules))

    def split(x):
        g = x.shape[0]
        x = x.reshape(g // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, sharding)

    return {k: split(x) for k, x in batch.items()}


def balance_batch(batch: Batch, config: Config, data: NamedSharding) -> tuple[Batch, bool]:
    """(the batch, whether it is placed for load balance): every key's rows [B, S, ...] in
    `balanced_order` when `model.context_load_balance` is on for the traced mesh's sequence
    shards. Traced inside the step: a static permutation of the tokens along the sequence,
    which moves at most half of each shard's token ids (and positions, segment ids, weights)
    to another shard; the model's activations are then placed so from the embedding on."""
    shards = sequence_shards()
    if not config.model.balances_context(shards):
        return batch, False
    order = balanced_order(config.data.seq_len, shards)
    placed = {
        k: jax.lax.with_sharding_constraint(jnp.take(x, order, axis=1), data)
        for k, x in batch.items()
    }
    return placed, True
