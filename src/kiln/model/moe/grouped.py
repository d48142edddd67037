"""Grouped matmuls: rows grouped by expert (sizes_E rows each, the rest unused) through their
experts' gated MLPs, act(x W_gate + b_gate, x W_up + b_up) W_down + b_down: the biases
(`biases` = b_gate [E,F], b_up [E,F], b_down [E,D]) only when given, act SwiGLU's by default.

`model.moe.grouped_matmul` picks one (`GROUPED_MATMULS`): `jax.lax.ragged_dot`, or equal-size
blocks of rows through batched matmuls. Einsum letters as in `kiln.model.moe`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from kiln.model.moe.layout import block_layout, group_of
from kiln.parallel.exchange import take_rows
from kiln.parallel.mesh import traced_platform

# What `model.moe.grouped_matmul: auto` runs per platform.
AUTO_GROUPED = {"tpu": "ragged_dot", "gpu": "blocked", "cpu": "blocked"}


class ExpertWeights(NamedTuple):
    """The routed experts' parameters, [E, ...] each: the gate and up projections [E,D,F],
    the down projection [E,F,D], and their biases [E,F], [E,F], [E,D] (None: no biases)."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


def swiglu(gate, up):
    """SwiGLU's activation of an expert's gate and up projections: silu(gate) * up."""
    return jax.nn.silu(gate) * up


def ragged_rows(xs_RD, sizes_E, w_gate, w_up, w_down, *, biases=None, act=swiglu):
    """`jax.lax.ragged_dot` over the groups: the grouped matmul TPU runs natively (its compiled
    HLO has ragged-dot kernels, `benchmarks/moe.py --tpu-topology`). Rows past the groups are
    never read."""
    gate = jax.lax.ragged_dot(xs_RD, w_gate, sizes_E)
    up = jax.lax.ragged_dot(xs_RD, w_up, sizes_E)
    if biases is not None:  # each row's expert's
        r = jnp.arange(xs_RD.shape[0], dtype=jnp.int32)
        e_R = jnp.minimum(group_of(jnp.cumsum(sizes_E), r), sizes_E.shape[0] - 1)
        gate, up = gate + biases[0][e_R], up + biases[1][e_R]
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    ys_RD = jax.lax.ragged_dot(act(gate, up), w_down, sizes_E)
    return ys_RD if biases is None else ys_RD + biases[2][e_R]


def expert_blocks(xs_NbD, expert_N, w_gate, w_up, w_down, biases, act):
    """Each block of rows through its expert's weights (batched matmuls)."""
    gate = jnp.einsum("NbD,NDF->NbF", xs_NbD, w_gate[expert_N])
    up = jnp.einsum("NbD,NDF->NbF", xs_NbD, w_up[expert_N])
    if biases is not None:  # each block's expert's
        gate, up = gate + biases[0][expert_N, None], up + biases[1][expert_N, None]
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    ys_NbD = jnp.einsum("NbF,NFD->NbD", act(gate, up), w_down[expert_N])
    return ys_NbD if biases is None else ys_NbD + biases[2][expert_N, None]


def blocked_rows(
    xs_RD, sizes_E, w_gate, w_up, w_down, block: int | None = None, *, biases=None, act=swiglu
):
    """Each group padded to whole blocks of `block` rows (`block_layout`), each block
    multiplied by its expert's weights (a batched matmul); rows past the groups give 0. Exact.
    XLA's CPU backend has no grouped matmul of its own (it runs `ragged_dot` as E dense
    matmuls over every row). The rows move into and out of the blocks by `take_rows` (gathers
    both ways)."""
    rows, d = xs_RD.shape
    src_U, dst_R, expert_N, block = block_layout(sizes_E, rows, block)
    xs_NbD = take_rows(xs_RD, src_U, dst_R).reshape(-1, block, d)
    ys_NbD = expert_blocks(xs_NbD, expert_N, w_gate, w_up, w_down, biases, act)
    return take_rows(ys_NbD.reshape(-1, d), dst_R, src_U)


def run_grouped(matmul, xs_RD, sizes_E, weights: ExpertWeights):
    """`matmul` (a grouped matmul) over the groups with the experts' weights and biases."""
    biases = None if weights.gate_bias is None else weights[3:]
    return matmul(xs_RD, sizes_E, *weights[:3], biases=biases)


GROUPED_MATMULS = {"ragged_dot": ragged_rows, "blocked": blocked_rows}


def grouped_matmul(name: str) -> str:
    """The grouped matmul `model.moe.grouped_matmul=name` runs on this platform."""
    return AUTO_GROUPED.get(traced_platform(), "blocked") if name == "auto" else name
