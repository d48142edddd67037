"""The MoE layer: the router, the routed experts (on this device or in `shard_map` over the
expert axis) and the shared experts, and the block that holds it in place of llama's MLP.

Einsum letters as in `kiln.model.moe`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from kiln.config import ModelConfig
from kiln.config.axes import entry_axes
from kiln.errors import KilnError
from kiln.model.interface import DTYPES
from kiln.model.llama import Block, Mlp
from kiln.model.llama.layers import param
from kiln.model.moe.experts import (
    NATIVE_RAGGED,
    ExpertAxis,
    capacity,
    expert_outputs,
    receive_rows,
)
from kiln.model.moe.grouped import GROUPED_MATMULS, ExpertWeights, grouped_matmul, swiglu
from kiln.model.moe.routing import route
from kiln.parallel.mesh import current_reduce_dtype, current_rules, logical_spec, traced_platform

# An expert weight's logical names: [experts, in, out].
_EXPERT_IN = ("experts", "embed", "mlp")
_EXPERT_OUT = ("experts", "mlp", "embed")


class MoeMlp(nnx.Module):
    """Routed experts (SwiGLU each) and optional shared experts, with their auxiliary sums."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe = cfg.moe
        d, e, f = cfg.d_model, moe.num_experts, moe.d_ff_expert
        self.router = param(rngs, cfg, (d, e), ("embed", None), "router")
        self.w_gate = param(rngs, cfg, (e, d, f), _EXPERT_IN, "matrix", ("embed",))
        self.w_up = param(rngs, cfg, (e, d, f), _EXPERT_IN, "matrix", ("embed",))
        self.w_down = param(rngs, cfg, (e, f, d), _EXPERT_OUT, "matrix", ("mlp",))
        # DeepSeek-V3's routing bias: moved by the balance rule after each step, never by the
        # optimizer (its gradient is zero: it only chooses experts).
        self.bias = (
            nnx.Param(
                jnp.zeros((e,), jnp.float32),
                out_sharding=(None,),
                eager_sharding=False,
                role="buffer",
            )
            if moe.balance == "aux_free"
            else None
        )
        shared = moe.num_shared_experts * f
        self.shared = Mlp(cfg.model_copy(update={"d_ff": shared}), rngs=rngs) if shared else None
        self.moe = moe
        self.dtype = DTYPES[cfg.dtype]

    def __call__(self, h_BSD, segment_ids_BS) -> tuple[jax.Array, dict[str, jax.Array]]:
        moe, dt = self.moe, self.dtype
        bias = None if self.bias is None else self.bias[...]
        experts_BSK, gates_BSK, probs_BSE, logits_BSE = route(
            h_BSD, self.router[...], bias, moe, self._router_bias()
        )
        real_BS = segment_ids_BS > 0
        y_BSD, dropped = routed(
            h_BSD, experts_BSK, gates_BSK, real_BS, self._experts(), moe, dt, self._act()
        )
        if self.shared is not None:
            y_BSD = y_BSD + self.shared(h_BSD)
        y_BSD = checkpoint_name(y_BSD, "mlp_out")
        return y_BSD, self._aux(segment_ids_BS, experts_BSK, probs_BSE, logits_BSE, dropped)

    def _router_bias(self) -> jax.Array | None:
        """The router's learned bias [E] on its logits (none here; a family may add one)."""
        return None

    def _experts(self) -> ExpertWeights:
        """The routed experts' parameters (a family with expert biases adds them)."""
        return ExpertWeights(self.w_gate[...], self.w_up[...], self.w_down[...])

    def _act(self):
        """The experts' activation: act(gate, up) -> the hidden units (SwiGLU's here)."""
        return swiglu

    def _aux(self, segment_ids_BS, experts_BSK, probs_BSE, logits_BSE, dropped):
        """float32 sums over this call's tokens (padding, segment id 0, excluded)."""
        moe = self.moe
        e, k = moe.num_experts, moe.experts_per_token
        real_BS = (segment_ids_BS > 0).astype(jnp.float32)
        chosen_BSE = jax.nn.one_hot(experts_BSK, e, dtype=jnp.float32).sum(axis=2)
        tokens_E = jnp.einsum("BSE,BS->E", chosen_BSE, real_BS)
        aux = {"moe/expert_tokens": tokens_E}
        if moe.router_z_loss:
            lse_BS = jax.nn.logsumexp(logits_BSE, axis=-1)
            aux["learning/router_z_loss"] = moe.router_z_loss * jnp.sum(real_BS * lse_BS**2)
        if moe.load_balance_loss:
            n = jnp.sum(real_BS)
            mean_prob_E = jnp.einsum("BSE,BS->E", probs_BSE, real_BS) / jnp.maximum(n, 1.0)
            # E * sum_e f_e P_e with f_e = tokens_e / (K n), times n: a sum over the tokens.
            balance = e / k * jnp.sum(jax.lax.stop_gradient(tokens_E) * mean_prob_E)
            aux["learning/moe_lb_loss"] = moe.load_balance_loss * balance
        if dropped is not None:
            aux["moe/dropped_tokens"] = dropped
        return aux


def routed(h_BSD, experts_BSK, gates_BSK, real_BS, weights, moe, dtype, act=swiglu):
    """(sum over each token's experts of gate * expert(token) [B,S,D], real tokens'
    assignments dropped for a capacity or the receive buffer, or None when nothing can be
    dropped), on this device or in `shard_map` over the mesh. Padding (`real_BS` False) is not
    routed: its output is 0 and it takes no capacity. experts_BSK and gates_BSK: the router's
    choices and their gates (`route`); `weights`: the experts' matrices, an `ExpertWeights` (or
    the gate, up and down projections); `act` the experts' activation (`ragged_rows`).

    On a mesh the experts are split over the `experts` rule's axis (`_expert_parallel`). With
    `moe.expert_tensor_parallel` and the `mlp` rule's axis (tensor) splitting the tokens, the
    expert weights stay split over it along d_ff: the devices of that axis gather their tokens
    (an all-gather), route and send all of them, multiply them by their slices of the experts,
    and reduce-scatter the partial sums back to their own tokens (Megatron's expert tensor
    parallelism); otherwise each device gathers its experts whole.

    `weights` (gate, up, down) are cast to the compute `dtype` before they are gathered for
    `shard_map`, unless `train.grad_reduce_dtype` asks for weight gradients in another dtype:
    then they are cast inside, so their gradients leave `shard_map`, and are summed across
    devices, in the parameters' dtype.
    """
    matmul = functools.partial(GROUPED_MATMULS[grouped_matmul(moe.grouped_matmul)], act=act)
    reduce = current_reduce_dtype()
    inside = reduce is not None and reduce != jnp.dtype(dtype)
    weights = ExpertWeights(*weights)
    if not inside:
        weights = ExpertWeights(*(None if w is None else w.astype(dtype) for w in weights))
    counted = moe.capacity_factor is not None or moe.buffer_factor is not None

    def local(h_BSD, experts_BSK, gates_BSK, real_BS, ws, *, axis, count_axes, tensor):
        tensor_axis, tensor_dim = tensor
        if tensor_axis is not None:  # the tensor group's tokens, for its slices of the experts
            gather = functools.partial(
                jax.lax.all_gather, axis_name=tensor_axis, axis=tensor_dim, tiled=True
            )
            h_BSD, experts_BSK, gates_BSK, real_BS = map(
                gather, (h_BSD, experts_BSK, gates_BSK, real_BS)
            )
        b, s, d = h_BSD.shape
        k = experts_BSK.shape[-1]
        cap = capacity(b * s, k, moe.num_experts, moe.capacity_factor)
        expert_axis = None
        if axis is not None:
            shards = jax.lax.axis_size(axis)
            buffer = receive_rows(b * s, k, moe.num_experts, shards, cap, moe.buffer_factor)
            expert_axis = ExpertAxis(axis, buffer, traced_platform() in NATIVE_RAGGED)
        ws = ExpertWeights(*(None if w is None else w.astype(dtype) for w in ws))
        if tensor_axis is not None and ws.down_bias is not None:
            # The devices' partial sums over their slices of d_ff add up: one holds the bias.
            first = jax.lax.axis_index(tensor_axis) == 0
            ws = ws._replace(down_bias=jnp.where(first, ws.down_bias, 0))
        y_TKD, dropped = expert_outputs(
            h_BSD.reshape(b * s, d),
            experts_BSK.reshape(b * s, k),
            jnp.broadcast_to(real_BS.reshape(b * s, 1), (b * s, k)),
            ws,
            matmul=matmul,
            num_experts=moe.num_experts,
            cap=cap,
            expert_axis=expert_axis,
        )
        gates_TK = gates_BSK.reshape(b * s, k)
        y_BSD = jnp.einsum("TKD,TK->TD", y_TKD.astype(jnp.float32), gates_TK).reshape(b, s, d)
        if tensor_axis is not None:  # each device's partial sums, back to its tokens
            y_BSD = jax.lax.psum_scatter(
                y_BSD, tensor_axis, scatter_dimension=tensor_dim, tiled=True
            )
        dropped = dropped.astype(jnp.float32) if counted else None
        if counted and count_axes:
            dropped = jax.lax.psum(dropped, count_axes)
        return y_BSD.astype(h_BSD.dtype), dropped

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(
            h_BSD,
            experts_BSK,
            gates_BSK,
            real_BS,
            weights,
            axis=None,
            count_axes=(),
            tensor=(None, 0),
        )
    rules = current_rules()
    tokens = logical_spec(("batch", "act_length", None), rules)
    token_axes = tuple(a for entry in tokens for a in entry_axes(entry))
    expert_spec = logical_spec(("experts",), rules)
    expert_axes = entry_axes(expert_spec[0])
    if len(expert_axes) > 1:
        raise KilnError(
            f"mesh.rules.experts: {list(expert_axes)}; allowed: at most one mesh axis "
            "(the all-to-all runs over one axis)"
        )
    axis = expert_axes[0] if expert_axes and mesh.shape[expert_axes[0]] > 1 else None
    if moe.num_experts % (mesh.shape[axis] if axis else 1):
        raise KilnError(
            f"model.moe.num_experts: {moe.num_experts} is not divisible by mesh.{axis}="
            f"{mesh.shape[axis]}; allowed: a multiple of the expert-parallel size"
        )
    tensor = _expert_tensor_axis(moe, mesh, rules, tokens, axis)
    w_in = PartitionSpec(axis, None, tensor[0])
    w_out = PartitionSpec(axis, tensor[0], None)
    b_in, b_out = PartitionSpec(axis, tensor[0]), PartitionSpec(axis, None)
    # The specs of the weights there are (the biases' only with biases).
    w_specs = [
        spec
        for spec, w in zip((w_in, w_in, w_out, b_in, b_in, b_out), weights, strict=True)
        if w is not None
    ]
    count_axes = tuple(a for a in token_axes if a != tensor[0])

    def per_device(h_BSD, experts_BSK, gates_BSK, real_BS, *ws):
        return local(
            h_BSD,
            experts_BSK,
            gates_BSK,
            real_BS,
            ExpertWeights(*ws),
            axis=axis,
            count_axes=count_axes,
            tensor=tensor,
        )

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, PartitionSpec(*tokens[:2]), *w_specs),
        out_specs=(tokens, PartitionSpec() if counted else None),
        check_vma=False,
    )(h_BSD, experts_BSK, gates_BSK, real_BS, *(w for w in weights if w is not None))


def _expert_tensor_axis(moe, mesh, rules, tokens, expert_axis) -> tuple[str | None, int]:
    """(the mesh axis that splits the experts' d_ff inside the expert computation, the token
    dimension it splits), or (None, 0): expert tensor parallelism needs one axis of size > 1
    under the `mlp` rule that splits the tokens (the `act_length` rule's tensor) and is not the
    expert axis."""
    mlp_axes = entry_axes(logical_spec(("mlp",), rules)[0])
    if not moe.expert_tensor_parallel or len(mlp_axes) != 1:
        return None, 0
    name = mlp_axes[0]
    if name == expert_axis or mesh.shape[name] == 1:
        return None, 0
    for dim, entry in enumerate(tokens[:2]):
        if name in entry_axes(entry):
            return name, dim
    return None, 0


class MoeBlock(Block):
    """llama's block with routed experts in place of its MLP; returns (x, aux sums)."""

    def _make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoeMlp(cfg, rngs=rngs)

    def _mlp(self, h_BSD, segment_ids_BS):
        return self.mlp(h_BSD, segment_ids_BS)
