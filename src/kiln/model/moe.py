"""The `moe` family: llama's blocks with the MLP replaced by routed experts (Mixture-of-Experts).

Each token's router (float32) picks its top-k experts; the token runs through exactly those
experts' SwiGLU MLPs, weighted by their router probabilities, plus the shared experts if any.
Dropless by default: the assignments are grouped by expert and run through grouped matmuls
(`jax.lax.ragged_dot` on TPU/GPU, equal-size blocks on CPU), so no token is dropped and no
capacity padding is multiplied. On a mesh the experts are split over the `experts` rule's mesh
axis (`expert`); inside `shard_map` each device sends its assignments to the devices holding
their experts by all-to-all, runs its own experts, and sends the outputs back.

Einsum letters as in `kiln.model.llama`, plus E experts, K experts per token, T tokens (B*S
flattened), A assignments (T*K), R rows of a grouped matmul, N blocks of rows, b rows per
block, F d_ff_expert.
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from kiln.config import ModelConfig
from kiln.config.axes import entry_axes
from kiln.errors import KilnError
from kiln.model.hf import Tensor, export_error, require, unsupported
from kiln.model.interface import DTYPES
from kiln.model.llama import (
    FULL_ATTENTION,
    Block,
    LlamaHF,
    Mlp,
    Transformer,
    _join,
    _param,
    stacked_blocks,
)
from kiln.model.project import current_reduce_dtype
from kiln.parallel.mesh import current_rules, logical_spec, traced_platform

# Largest block of rows the blocked grouped matmul multiplies by one expert's weights.
BLOCK_ROWS = 128
# What `model.moe.grouped_matmul: auto` runs per platform.
AUTO_GROUPED = {"tpu": "ragged_dot", "gpu": "ragged_dot", "cpu": "blocked"}
# An expert weight's logical names: [experts, in, out].
_EXPERT_IN = ("experts", "embed", "mlp")
_EXPERT_OUT = ("experts", "mlp", "embed")


# ---------------------------------------------------------------------------------------------
# Routing


def route(x_BSD, router_DE, bias_E, moe):
    """(experts [B,S,K] int32, weights [B,S,K], probabilities [B,S,E], logits [B,S,E]), float32.

    scores = softmax(x W_router), or sigmoid(x W_router) with `moe.score: sigmoid`; the top
    `moe.experts_per_token` of scores + bias choose the experts (`bias_E` None = no bias),
    within the `moe.topk_group` best of `moe.n_group` groups (a group's worth: the sum of its
    two best biased scores), and the unbiased scores of the chosen ones weight them, divided by
    their sum if `moe.norm_topk_prob`, times `moe.routed_scaling_factor`. probabilities: the scores (sigmoid
    ones normalised over the experts), for the load-balance loss.
    """
    logits_BSE = jnp.einsum("BSD,DE->BSE", x_BSD.astype(jnp.float32), router_DE.astype(jnp.float32))
    sigmoid = moe.score == "sigmoid"
    if sigmoid:
        scores_BSE = jax.nn.sigmoid(logits_BSE)
        probs_BSE = scores_BSE / jnp.sum(scores_BSE, axis=-1, keepdims=True)
    else:
        scores_BSE = probs_BSE = jax.nn.softmax(logits_BSE, axis=-1)
    choice_BSE = scores_BSE if bias_E is None else scores_BSE + jax.lax.stop_gradient(bias_E)
    if moe.n_group > 1:
        choice_BSE = _group_limited(jax.lax.stop_gradient(choice_BSE), moe.n_group, moe.topk_group)
    _, experts_BSK = jax.lax.top_k(choice_BSE, moe.experts_per_token)
    weights_BSK = jnp.take_along_axis(scores_BSE, experts_BSK, axis=-1)
    if moe.norm_topk_prob:
        total_BS1 = jnp.sum(weights_BSK, axis=-1, keepdims=True)
        weights_BSK = weights_BSK / (total_BS1 + 1e-20 if sigmoid else total_BS1)
    if moe.routed_scaling_factor != 1.0:
        weights_BSK = weights_BSK * moe.routed_scaling_factor
    return experts_BSK.astype(jnp.int32), weights_BSK, probs_BSE, logits_BSE


def _group_limited(choice_BSE, n_group: int, topk_group: int):
    """The choice scores with every expert outside each token's `topk_group` best groups at
    -inf; a group's worth is the sum of its two best scores (DeepSeek-V3)."""
    b, s, e = choice_BSE.shape
    grouped_BSGe = choice_BSE.reshape(b, s, n_group, e // n_group)
    best = jax.lax.top_k(grouped_BSGe, min(2, e // n_group))[0]
    _, groups_BSk = jax.lax.top_k(jnp.sum(best, axis=-1), topk_group)
    keep_BSG = jnp.sum(jax.nn.one_hot(groups_BSk, n_group, dtype=jnp.bool_), axis=2) > 0
    keep_BSE = jnp.repeat(keep_BSG, e // n_group, axis=-1)
    return jnp.where(keep_BSE, choice_BSE, -jnp.inf)


def ranks(e_A: jax.Array, groups: int) -> tuple[jax.Array, jax.Array]:
    """(rank of each element among the equal values before it, count per value < groups)."""
    order_A = jnp.argsort(e_A, stable=True)
    counts = jnp.zeros((groups + 1,), jnp.int32).at[jnp.minimum(e_A, groups)].add(1)[:groups]
    start = jnp.cumsum(counts) - counts
    sorted_e = e_A[order_A]
    rank_sorted = jnp.arange(e_A.shape[0], dtype=jnp.int32) - jnp.where(
        sorted_e < groups, start[jnp.minimum(sorted_e, groups - 1)], 0
    )
    return jnp.zeros_like(e_A).at[order_A].set(rank_sorted), counts


# ---------------------------------------------------------------------------------------------
# Grouped matmuls: row r through expert e_r's MLP


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def ragged_rows(x_RD, e_R, valid_R, w_gate, w_up, w_down):
    """Each valid row through its expert's SwiGLU (0 for the others), by `jax.lax.ragged_dot`
    over the rows sorted by expert: the grouped matmul TPU and GPU run natively."""
    num_experts = w_gate.shape[0]
    e_R = jnp.where(valid_R, e_R, num_experts)  # invalid rows sort last, outside every group
    order_R = jnp.argsort(e_R, stable=True)
    sizes_E = jnp.zeros((num_experts + 1,), jnp.int32).at[e_R].add(1)[:num_experts]
    xs_RD = x_RD[order_R]
    gate = checkpoint_name(jax.lax.ragged_dot(xs_RD, w_gate, sizes_E), "mlp_gate")
    up = checkpoint_name(jax.lax.ragged_dot(xs_RD, w_up, sizes_E), "mlp_up")
    ys_RD = jax.lax.ragged_dot(_swiglu(gate, up), w_down, sizes_E)
    y_RD = jnp.zeros_like(ys_RD).at[order_R].set(ys_RD)
    return jnp.where(valid_R[:, None], y_RD, 0)


def blocked_rows(x_RD, e_R, valid_R, w_gate, w_up, w_down, block: int | None = None):
    """Each valid row through its expert's SwiGLU (0 for the others), in blocks of `block`
    rows: each expert's rows padded to whole blocks, each block multiplied by its expert's
    weights (a batched matmul). Exact; the padding adds at most E * (block - 1) rows, which
    the default block keeps near 1/8 of the rows. XLA's CPU backend has no grouped matmul of
    its own (it runs `ragged_dot` as E dense matmuls over every row)."""
    rows, d = x_RD.shape
    num_experts = w_gate.shape[0]
    if block is None:
        per_expert = max(1, rows // (4 * num_experts))
        block = max(8, min(BLOCK_ROWS, 1 << (per_expert.bit_length() - 1)))
    blocks = -(-(rows + num_experts * (block - 1)) // block)
    e_R = jnp.where(valid_R, e_R, num_experts)
    rank_R, counts_E = ranks(e_R, num_experts)
    padded_E = -(-counts_E // block) * block
    end_E = jnp.cumsum(padded_E)
    slot_R = jnp.where(valid_R, (end_E - padded_E)[jnp.minimum(e_R, num_experts - 1)] + rank_R, -1)
    slot_R = jnp.where(slot_R < 0, blocks * block, slot_R)  # out of range: dropped
    xs = jnp.zeros((blocks * block, d), x_RD.dtype).at[slot_R].set(x_RD, mode="drop")
    xs_NbD = xs.reshape(blocks, block, d)
    first_N = jnp.arange(blocks, dtype=jnp.int32) * block
    expert_N = jnp.minimum(
        jnp.searchsorted(end_E, first_N, side="right", method="compare_all"), num_experts - 1
    )
    gate = checkpoint_name(jnp.einsum("NbD,NDF->NbF", xs_NbD, w_gate[expert_N]), "mlp_gate")
    up = checkpoint_name(jnp.einsum("NbD,NDF->NbF", xs_NbD, w_up[expert_N]), "mlp_up")
    ys_NbD = jnp.einsum("NbF,NFD->NbD", _swiglu(gate, up), w_down[expert_N])
    return ys_NbD.reshape(blocks * block, d).at[slot_R].get(mode="fill", fill_value=0)


GROUPED_MATMULS = {"ragged_dot": ragged_rows, "blocked": blocked_rows}


def grouped_matmul(name: str) -> str:
    """The grouped matmul `model.moe.grouped_matmul=name` runs on this platform."""
    return AUTO_GROUPED.get(traced_platform(), "blocked") if name == "auto" else name


# ---------------------------------------------------------------------------------------------
# Dispatch: assignments to experts and back, on one device or across the expert axis


def capacity(tokens: int, k: int, num_experts: int, factor: float | None) -> int | None:
    """Assignments one expert takes from `tokens` tokens of one device (None: all, dropless)."""
    return None if factor is None else max(1, math.ceil(factor * tokens * k / num_experts))


def dispatch(x_TD, e_TK, keep_TK, w_gate, w_up, w_down, *, rows, axis, num_experts, per_dest):
    """Outputs [T,K,D] of each kept assignment (token t through expert e_TK[t, j]).

    `axis` None: every expert is here (weights [E, ...]). Otherwise the experts are split over
    mesh axis `axis` of size P (weights [E/P, ...] on each device): the assignments go to
    their experts' devices by all-to-all, in one buffer of `per_dest` rows per destination
    (all of this device's assignments when dropless, else the capacity of E/P experts), run
    there, and come back by the reverse all-to-all.
    """
    t, k = e_TK.shape
    d = x_TD.shape[-1]
    x_AD = jnp.repeat(x_TD, k, axis=0)  # assignment a = t * K + j
    e_A, keep_A = e_TK.reshape(-1), keep_TK.reshape(-1)
    if axis is None:
        return rows(x_AD, e_A, keep_A, w_gate, w_up, w_down).reshape(t, k, d)
    shards = jax.lax.axis_size(axis)
    local = num_experts // shards
    # Per destination, its assignments in order of expert: one contiguous run of rows.
    e_A = jnp.where(keep_A, e_A, num_experts)
    dest_A = jnp.minimum(e_A // local, shards)
    kept = keep_A.astype(jnp.int32)
    per_expert = jnp.zeros((num_experts + 1,), jnp.int32).at[e_A].add(kept)[:num_experts]
    # Rank within the destination in order of expert: the experts before e there, plus e's rank.
    rank_e, _ = ranks(e_A, num_experts)
    before_E = jnp.cumsum(per_expert) - per_expert
    dest_first_E = before_E[jnp.arange(shards) * local]
    e_safe = jnp.minimum(e_A, num_experts - 1)
    rank_A = before_E[e_safe] - dest_first_E[jnp.minimum(dest_A, shards - 1)] + rank_e
    m = per_dest
    slot_A = jnp.where(keep_A & (rank_A < m), dest_A * m + rank_A, shards * m)
    send = jnp.zeros((shards * m, d), x_AD.dtype).at[slot_A].set(x_AD, mode="drop")
    counts_PE = per_expert.reshape(shards, local)
    recv_PMD = jax.lax.all_to_all(send.reshape(shards, m, d), axis, 0, 0, tiled=True)
    recv_counts_PE = jax.lax.all_to_all(counts_PE, axis, 0, 0, tiled=True)
    # Rows from each source arrive in order of local expert, recv_counts_PE[s] of each.
    ends_PE = jnp.cumsum(recv_counts_PE, axis=1)
    i_M = jnp.arange(m, dtype=jnp.int32)
    e_PM = jax.vmap(lambda ends: jnp.searchsorted(ends, i_M, side="right", method="compare_all"))(
        ends_PE
    )
    valid_PM = i_M[None, :] < ends_PE[:, -1:]
    y_R = rows(
        recv_PMD.reshape(shards * m, d),
        jnp.minimum(e_PM, local - 1).reshape(-1),
        valid_PM.reshape(-1),
        w_gate,
        w_up,
        w_down,
    )
    back = jax.lax.all_to_all(y_R.reshape(shards, m, d), axis, 0, 0, tiled=True)
    y_AD = back.reshape(shards * m, d).at[slot_A].get(mode="fill", fill_value=0)
    return y_AD.reshape(t, k, d)


# ---------------------------------------------------------------------------------------------
# The layer


class MoeMlp(nnx.Module):
    """Routed experts (SwiGLU each) and optional shared experts, with their auxiliary sums."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe = cfg.moe
        d, e, f = cfg.d_model, moe.num_experts, moe.d_ff_expert
        self.router = _param(rngs, cfg, (d, e), ("embed", None), "router")
        self.w_gate = _param(rngs, cfg, (e, d, f), _EXPERT_IN, "matrix", ("embed",))
        self.w_up = _param(rngs, cfg, (e, d, f), _EXPERT_IN, "matrix", ("embed",))
        self.w_down = _param(rngs, cfg, (e, f, d), _EXPERT_OUT, "matrix", ("mlp",))
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
        experts_BSK, weights_BSK, probs_BSE, logits_BSE = route(h_BSD, self.router[...], bias, moe)
        weights = tuple(w[...] for w in (self.w_gate, self.w_up, self.w_down))
        real_BS = segment_ids_BS > 0
        y_BSD, dropped = routed(h_BSD, experts_BSK, weights_BSK, real_BS, weights, moe, dt)
        if self.shared is not None:
            y_BSD = y_BSD + self.shared(h_BSD)
        y_BSD = checkpoint_name(y_BSD, "mlp_out")
        return y_BSD, self._aux(segment_ids_BS, experts_BSK, probs_BSE, logits_BSE, dropped)

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


def routed(h_BSD, experts_BSK, weights_BSK, real_BS, weights, moe, dtype):
    """(sum over each token's experts of weight * expert(token) [B,S,D], real tokens'
    assignments dropped for capacity or None when dropless), on this device or in `shard_map`
    over the mesh. Padding (`real_BS` False) is not routed: its output is 0 and it takes no
    capacity.

    `weights` (gate, up, down) are cast to the compute `dtype` before they are gathered for
    `shard_map`, unless `train.grad_reduce_dtype` asks for weight gradients in another dtype:
    then they are cast inside, so their gradients leave `shard_map`, and are summed across
    devices, in the parameters' dtype.
    """
    rows = GROUPED_MATMULS[grouped_matmul(moe.grouped_matmul)]
    reduce = current_reduce_dtype()
    inside = reduce is not None and reduce != jnp.dtype(dtype)
    if not inside:
        weights = tuple(w.astype(dtype) for w in weights)

    def local(h_BSD, experts_BSK, weights_BSK, real_BS, w_gate, w_up, w_down, *, axis, token_axes):
        w_gate, w_up, w_down = (w.astype(dtype) for w in (w_gate, w_up, w_down))
        b, s, d = h_BSD.shape
        k = experts_BSK.shape[-1]
        local_experts = w_gate.shape[0]
        e_TK = experts_BSK.reshape(b * s, k)
        cap = capacity(b * s, k, moe.num_experts, moe.capacity_factor)
        real_TK = jnp.broadcast_to(real_BS.reshape(b * s, 1), e_TK.shape)
        keep_TK = real_TK
        if cap is not None:
            # First choices before second ones, then in token order (GShard's priority).
            e_KT = jnp.where(real_TK, e_TK, moe.num_experts).T.reshape(-1)
            rank_KT, _ = ranks(e_KT, moe.num_experts)
            keep_TK = real_TK & (rank_KT < cap).reshape(k, b * s).T
        y_TKD = dispatch(
            h_BSD.reshape(b * s, d),
            e_TK,
            keep_TK,
            w_gate,
            w_up,
            w_down,
            rows=rows,
            axis=axis,
            num_experts=moe.num_experts,
            per_dest=b * s * k if cap is None else min(b * s * k, cap * local_experts),
        )
        w_TK = weights_BSK.reshape(b * s, k) * keep_TK
        y_TD = jnp.einsum("TKD,TK->TD", y_TKD.astype(jnp.float32), w_TK)
        dropped = None
        if cap is not None:
            dropped = jnp.sum(real_TK & ~keep_TK).astype(jnp.float32)
            if token_axes:
                dropped = jax.lax.psum(dropped, token_axes)
        return y_TD.astype(h_BSD.dtype).reshape(b, s, d), dropped

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(h_BSD, experts_BSK, weights_BSK, real_BS, *weights, axis=None, token_axes=())
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
    w_spec = PartitionSpec(axis, None, None)
    dropped_spec = PartitionSpec() if moe.capacity_factor is not None else None

    def per_device(h_BSD, experts_BSK, weights_BSK, real_BS, w_gate, w_up, w_down):
        return local(
            h_BSD,
            experts_BSK,
            weights_BSK,
            real_BS,
            w_gate,
            w_up,
            w_down,
            axis=axis,
            token_axes=token_axes,
        )

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, PartitionSpec(*tokens[:2]), w_spec, w_spec, w_spec),
        out_specs=(tokens, dropped_spec),
        check_vma=False,
    )(h_BSD, experts_BSK, weights_BSK, real_BS, *weights)


class MoeBlock(Block):
    """llama's block with routed experts in place of its MLP; returns (x, aux sums)."""

    def _make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoeMlp(cfg, rngs=rngs)

    def _mlp(self, h_BSD, segment_ids_BS):
        return self.mlp(h_BSD, segment_ids_BS)


class MoeTransformer(Transformer):
    """The `moe` family: `first_dense_layers` llama blocks, then MoE blocks (two scanned stacks).

    Implements `kiln.model.LanguageModel`. aux (`ModelOutput.aux`): the router z-loss and the
    load-balance loss as sums over the tokens (summed over layers; absent when their weight is
    0), the tokens each layer sent to each expert (`moe/expert_tokens` [L_moe, E]) and, with a
    capacity, the assignments dropped per layer (`moe/dropped_tokens` [L_moe]).
    """

    # The blocks of the two stacks (a family with another attention overrides both).
    dense_block: ClassVar[type[Block]] = Block
    moe_block: ClassVar[type[Block]] = MoeBlock

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe = cfg.moe
        if moe is None or not 0 <= moe.first_dense_layers < cfg.num_layers:
            raise KilnError(
                f"model.moe.first_dense_layers: {getattr(moe, 'first_dense_layers', None)}; "
                f"allowed: 0..{cfg.num_layers - 1} (model.num_layers={cfg.num_layers})"
            )
        super().__init__(cfg, rngs=rngs)
        # Replaces the dense stack the base class built with the two stacks.
        dense = moe.first_dense_layers
        self.dense_blocks = stacked_blocks(cfg, rngs, self.dense_block, dense) if dense else None
        self.blocks = stacked_blocks(cfg, rngs, self.moe_block, cfg.num_layers - dense)

    def _stacks(self) -> list[nnx.Module]:
        return [b for b in (self.dense_blocks, self.blocks) if b is not None]

    def _routed(self) -> list[nnx.Module]:
        """The stacks of routed-expert MLPs, in the order of their rows in the aux arrays."""
        return [self.blocks.mlp]

    def _aux(self, per_stack):
        """The routed stacks' per-layer aux joined along layers ([L_moe, ...] per key; the
        dense stack has none): statistics as arrays, losses summed."""
        routed = [aux for aux in per_stack if aux]
        aux = {k: _join([a[k] for a in routed]) for k in (routed[0] if routed else ())}
        out = {k: v for k, v in aux.items() if k.startswith("moe/")}
        out.update({k: jnp.sum(v) for k, v in aux.items() if not k.startswith("moe/")})
        return out

    def update_balance(self, aux) -> None:
        """balance: aux_free: each expert's bias moves by bias_update_rate towards equal load,
        from the step's global `moe/expert_tokens` (DeepSeek-V3: up if below the mean), centred:
        the mean move of a layer's biases is taken out, so they never drift together (a shift
        common to every expert chooses nothing)."""
        moe = self.cfg.moe
        if moe.balance != "aux_free":
            return
        tokens_LE = aux["moe/expert_tokens"]
        mean_L1 = jnp.mean(tokens_LE, axis=-1, keepdims=True)
        move_LE = jnp.sign(mean_L1 - tokens_LE)
        move_LE = move_LE - jnp.mean(move_LE, axis=-1, keepdims=True)
        first = 0
        for mlp in self._routed():
            bias = mlp.bias
            rows = bias.shape[0]
            bias[...] = bias[...] + moe.bias_update_rate * move_LE[first : first + rows]
            first += rows

    @staticmethod
    def aux_metrics(cfg: ModelConfig, sums) -> dict[str, jax.Array]:
        """Scalars logged from the global aux sums: each MoE layer's most loaded expert over
        the mean load (and the worst layer's), and the fraction of assignments dropped."""
        tokens_LE = sums["moe/expert_tokens"]
        mean_L = jnp.mean(tokens_LE, axis=-1)
        ratio_L = jnp.max(tokens_LE, axis=-1) / jnp.where(mean_L > 0, mean_L, 1.0)
        first = cfg.moe.first_dense_layers
        out = {"moe/expert_load_max_over_mean": jnp.max(ratio_L)}
        for i in range(tokens_LE.shape[0]):
            out[f"moe/expert_load_max_over_mean/layer_{first + i}"] = ratio_L[i]
        if "moe/dropped_tokens" in sums:
            total = jnp.sum(tokens_LE)
            out["moe/dropped_fraction"] = jnp.sum(sums["moe/dropped_tokens"]) / jnp.where(
                total > 0, total, 1.0
            )
        return out

    def matmul_params(self) -> int:
        """Active parameters that multiply activations: attention, dense MLPs, the router and
        the K routed plus the shared experts each token passes through, and the LM head."""
        m, dense = self.cfg, self.cfg.moe.first_dense_layers
        layers = m.num_layers * self._attention_params() + dense * 3 * m.d_model * m.d_ff
        routed = (m.num_layers - dense) * self._routed_layer_params()
        return layers + routed + m.d_model * m.vocab_size

    def _attention_params(self) -> int:
        """Matmul parameters of one layer's attention (grouped-query: q, k, v and o)."""
        m = self.cfg
        d, h, n, kv = m.d_model, m.resolved_head_dim, m.num_heads, m.kv_heads
        return d * (n + 2 * kv) * h + n * h * d

    def _routed_layer_params(self) -> int:
        """Active matmul parameters of one routed MLP: the router, the K routed and the
        shared experts a token passes through."""
        m, moe = self.cfg, self.cfg.moe
        expert = 3 * m.d_model * moe.d_ff_expert
        return (
            m.d_model * moe.num_experts + (moe.experts_per_token + moe.num_shared_experts) * expert
        )

    def inactive_params(self) -> int:
        """Parameters a token does not use: the routed experts beyond its top-k, every layer."""
        m, moe = self.cfg, self.cfg.moe
        idle = (moe.num_experts - moe.experts_per_token) * 3 * m.d_model * moe.d_ff_expert
        return (m.num_layers - moe.first_dense_layers) * idle


__all__ = ["MoeTransformer", "route", "routed"]


# ---------------------------------------------------------------------------------------------
# Hugging Face: Qwen3-MoE with model.qk_norm, Mixtral without

# An MoE layer's module, and its experts' (gate, up, down) Linear names, per HF model_type.
MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
EXPERT_PATHS = (("mlp", "w_gate"), ("mlp", "w_up"), ("mlp", "w_down"))


class MoeHF(LlamaHF):
    """With `model.qk_norm`, Qwen3-MoE (Qwen3's attention; `first_dense_layers` = its
    `mlp_only_layers` 0..N-1; `moe_intermediate_size` = d_ff_expert, `intermediate_size` =
    d_ff of the dense layers); without it, Mixtral (Llama's attention, experts in every layer,
    top-k weights always renormalised). Both route as kiln does: softmax over the experts, the
    top-k probabilities as weights, divided by their sum if norm_topk_prob; neither has shared
    experts, a routing bias or a token capacity. The first_dense_layers are kiln's
    `dense_blocks` stack and the MoE layers its `blocks`; router [D,E] -> gate.weight [E, D],
    expert e's slice of w_gate/w_up [E,D,F] and w_down [E,F,D] -> that expert's Linears."""

    architectures: ClassVar[dict[str, str]] = {
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
    }

    def model_type(self, m) -> str:
        return "qwen3_moe" if m.qk_norm else "mixtral"

    def check_exportable(self, m, kind: str) -> None:
        super().check_exportable(m, kind)
        moe, name = m.moe, self.architectures[kind]
        if moe.balance == "aux_free":
            raise export_error(
                "model.moe.balance",
                moe.balance,
                f"Hugging Face {name} chooses experts without a routing bias",
                "model.moe.balance=aux_loss",
            )
        routing = (
            ("score", moe.score, "softmax"),
            ("n_group", moe.n_group, 1),
            ("routed_scaling_factor", moe.routed_scaling_factor, 1.0),
        )
        for field, value, plain in routing:
            if value != plain:
                raise export_error(
                    f"model.moe.{field}",
                    value,
                    f"Hugging Face {name} routes by a softmax over every expert, unscaled",
                    f"model.moe.{field}={plain}",
                )
        if moe.num_shared_experts:
            raise export_error(
                "model.moe.num_shared_experts",
                moe.num_shared_experts,
                f"Hugging Face {name} has no shared experts",
                "model.moe.num_shared_experts=0",
            )
        if kind == "mixtral" and moe.first_dense_layers:
            raise export_error(
                "model.moe.first_dense_layers",
                moe.first_dense_layers,
                "Mixtral (the export of an moe model without model.qk_norm) has experts in "
                "every layer",
                "first_dense_layers=0, or model.qk_norm=true (Qwen3-MoE)",
            )
        if kind == "mixtral" and not moe.norm_topk_prob:
            raise export_error(
                "model.moe.norm_topk_prob",
                "false",
                "Mixtral (the export of an moe model without model.qk_norm) renormalises the "
                "top-k weights",
                "norm_topk_prob=true, or model.qk_norm=true (Qwen3-MoE)",
            )

    def export_notes(self, m) -> list[str]:
        if m.moe.capacity_factor is None:
            return []
        return [
            f"model.moe.capacity_factor {m.moe.capacity_factor} not exported: Hugging Face's "
            f"{self.architectures[self.model_type(m)]} runs every token through its experts "
            "(dropless), as kiln does with capacity_factor null"
        ]

    def config_fields(self, m, kind: str) -> dict:
        moe = m.moe
        routing = {
            "num_experts_per_tok": moe.experts_per_token,
            "router_aux_loss_coef": moe.load_balance_loss,
            "output_router_logits": False,
        }
        if kind == "mixtral":
            return {
                "intermediate_size": moe.d_ff_expert,
                "num_local_experts": moe.num_experts,
                **routing,
                "router_jitter_noise": 0.0,
                "sliding_window": None,
            }
        return {
            **FULL_ATTENTION,
            "intermediate_size": m.d_ff,
            "moe_intermediate_size": moe.d_ff_expert,
            # transformers 5 also reads num_local_experts; 4.x only num_experts (the Hub's name).
            "num_experts": moe.num_experts,
            **routing,
            "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.first_dense_layers)),
            "attention_bias": False,
        }

    def section(self, hf, path, kind: str, names=()) -> dict:
        return {
            "family": "moe",
            "moe": _moe_section(hf, path, kind),
            **super().section(hf, path, kind, names),
        }

    def layer_tensors(self, m, kind: str, layer: int) -> list[Tensor]:
        dense = m.moe.first_dense_layers
        stack, j = ("dense_blocks", layer) if layer < dense else ("blocks", layer - dense)
        out = self.attention_tensors(m, layer, stack, j)
        if layer < dense:
            return out + self.mlp_tensors(layer, stack, j)
        module, expert_names = MOE_NAMES[kind]
        prefix = f"model.layers.{layer}.{module}"
        out.append(Tensor(f"{prefix}.gate.weight", (stack, "mlp", "router"), (j,), 1))
        for e in range(m.moe.num_experts):
            for linear, path in zip(expert_names, EXPERT_PATHS):
                out.append(
                    Tensor(f"{prefix}.experts.{e}.{linear}.weight", (stack, *path), (j, e), 1)
                )
        return out

    def describe(self, m) -> str:
        moe = m.moe
        text = f", {moe.num_experts} experts (top {moe.experts_per_token})"
        return text + (f" after {moe.first_dense_layers} dense" if moe.first_dense_layers else "")


def _moe_section(hf, path, kind: str) -> dict:
    """kiln's model.moe from a Qwen3-MoE or Mixtral config.json (defaults as transformers')."""
    common = {
        "experts_per_token": require(hf, "num_experts_per_tok", path),
        # The same weight; kiln's term is per layer, summed (docs/interop.md).
        "load_balance_loss": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    if kind == "mixtral":
        if hf.get("sliding_window") is not None:
            raise unsupported(path, "sliding_window", hf["sliding_window"], "null (full attention)")
        if hf.get("router_jitter_noise", 0.0):
            raise unsupported(
                path,
                "router_jitter_noise",
                hf["router_jitter_noise"],
                "0 (kiln's router has no noise)",
            )
        return {
            "num_experts": require(hf, "num_local_experts", path),
            "d_ff_expert": require(hf, "intermediate_size", path),
            "norm_topk_prob": True,
            **common,
        }
    # transformers 5 writes num_local_experts, the Hub's files and transformers 4 num_experts.
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        require(hf, "num_experts", path)
    layers = require(hf, "num_hidden_layers", path)
    dense = _dense_layers(hf, path, layers, experts)
    if dense != list(range(len(dense))) or len(dense) >= layers:
        raise KilnError(
            f"{path}: mlp_only_layers {hf.get('mlp_only_layers') or []} with "
            f"decoder_sparse_step {hf.get('decoder_sparse_step', 1)} give dense layers {dense} "
            f"of {layers}; kiln imports only dense layers 0..N-1 before the MoE layers "
            "(model.moe.first_dense_layers = N < num_hidden_layers)"
        )
    return {
        "num_experts": experts,
        "d_ff_expert": require(hf, "moe_intermediate_size", path),
        "first_dense_layers": len(dense),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        **common,
    }


def _dense_layers(hf, path, layers: int, experts) -> list[int]:
    """Layers of a Qwen3-MoE with a dense MLP, as transformers' Qwen3MoeDecoderLayer picks them."""
    only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    if type(step) is not int or step < 1:
        raise unsupported(path, "decoder_sparse_step", step, "a positive integer")
    return [i for i in range(layers) if i in only or not experts or (i + 1) % step]
