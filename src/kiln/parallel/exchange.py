"""Rows moved by index: permutations whose backward pass is a gather too, and the ragged
all-to-all that sends each peer only its rows.

`take_rows` permutes rows by a gather and differentiates by the gather of the inverse
permutation, not by the scatter-add XLA would transpose a gather into (slow on TPU);
`take_copies` does the same for rows taken several times (a token's K assignments).

`ragged_exchange` sends chunks of rows of different sizes to the devices of a mesh axis, as
`jax.lax.ragged_all_to_all` does: natively where the backend has it (TPU, GPU), and on CPU,
whose XLA backend does not (`UNIMPLEMENTED: HLO opcode ragged-all-to-all`), by a dense
all-to-all of chunks padded to a common size, which moves the same rows to the same places.
Its backward pass is the reverse exchange.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


@jax.custom_vjp
def take_rows(x, index, inverse):
    """Rows `x[index]`, 0 where `index` is out of range (use x.shape[0]).

    `index` takes each row of x at most once, and `inverse` [x.shape[0]] is its inverse:
    inverse[index[p]] = p for the rows taken, out of range (index.shape[0]) for the others.
    The gradient with respect to x is then the gather `dy[inverse]`.
    """
    return x.at[index].get(mode="fill", fill_value=0)


def _take_rows_fwd(x, index, inverse):
    return take_rows(x, index, inverse), inverse


def _take_rows_bwd(inverse, dy):
    return dy.at[inverse].get(mode="fill", fill_value=0), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@jax.custom_vjp
def take_copies(x, index, inverse_KN):
    """Rows `x[index]`, 0 where `index` is out of range, when each row of x is taken up to K
    times: `inverse_KN` [K, x.shape[0]] holds the K positions each row went to (out of range,
    index.shape[0], for a copy not taken). The gradient is the sum of K gathers, not a
    scatter-add."""
    return x.at[index].get(mode="fill", fill_value=0)


def _take_copies_fwd(x, index, inverse_KN):
    return take_copies(x, index, inverse_KN), inverse_KN


def _take_copies_bwd(inverse_KN, dy):
    # Gathered [N, K, D], a row's K copies side by side, summed over the middle axis: the same
    # sums as [K, N, D] over the leading one, which XLA:CPU's fused reduction ran 10x slower
    # (moe_tiny's layer backward, docs/moe.md).
    dx_NKD = dy.at[inverse_KN.T].get(mode="fill", fill_value=0)
    return jnp.sum(dx_NKD, axis=1), None, None


take_copies.defvjp(_take_copies_fwd, _take_copies_bwd)


class Plan(NamedTuple):
    """One ragged all-to-all over a mesh axis of P devices, from this device's side ([P] int32
    each, peer j): the chunk for j starts at `input_offsets[j]` of the operand and has
    `send_sizes[j]` rows; it lands at `output_offsets[j]` of j's output; `recv_sizes[j]` rows
    arrive from j (as `jax.lax.ragged_all_to_all`). `source_offsets[j]` and `landing_offsets[j]`
    describe the same exchange from j's side: where the chunk j sends here starts in j's operand,
    and where it lands here; they make the reverse exchange."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array
    source_offsets: jax.Array
    landing_offsets: jax.Array

    def reverse(self) -> Plan:
        """The exchange that sends every row back to where it came from."""
        return Plan(
            self.landing_offsets,
            self.recv_sizes,
            self.source_offsets,
            self.send_sizes,
            self.output_offsets,
            self.input_offsets,
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def ragged_exchange(x, plan: Plan, rows: int, axis: str, native: bool):
    """The rows `plan` sends, received into `rows` zeroed rows (inside `shard_map` over `axis`).

    `native`: `jax.lax.ragged_all_to_all` (TPU, GPU); else a dense all-to-all of chunks padded
    to min(x rows, `rows`) each, the same result. The gradient is the reverse exchange.
    """
    return _exchange(x, plan, rows, axis, native)


def _exchange_fwd(x, plan, rows, axis, native):
    return _exchange(x, plan, rows, axis, native), (plan, x.shape[0])


def _exchange_bwd(rows, axis, native, residuals, dy):
    plan, operand_rows = residuals
    back = _exchange(dy, plan.reverse(), operand_rows, axis, native)
    return back, None


ragged_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _exchange(x, plan: Plan, rows: int, axis: str, native: bool):
    out = jnp.zeros((rows, *x.shape[1:]), x.dtype)
    if native:
        return jax.lax.ragged_all_to_all(
            x,
            out,
            plan.input_offsets,
            plan.send_sizes,
            plan.output_offsets,
            plan.recv_sizes,
            axis_name=axis,
        )
    chunk = min(x.shape[0], rows)
    i = jnp.arange(chunk, dtype=jnp.int32)
    # Slot j of the send buffer: the chunk for peer j, padded with zeros.
    take_PC = jnp.where(
        i[None, :] < plan.send_sizes[:, None], plan.input_offsets[:, None] + i[None, :], x.shape[0]
    )
    send = x.at[take_PC].get(mode="fill", fill_value=0)
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)
    # Where each peer's chunk lands here: that peer's output_offsets for this device.
    landing_P = jax.lax.all_to_all(plan.output_offsets[:, None], axis, 0, 0, tiled=True)[:, 0]
    put_PC = jnp.where(i[None, :] < plan.recv_sizes[:, None], landing_P[:, None] + i[None, :], rows)
    return out.at[put_PC].set(recv, mode="drop")
