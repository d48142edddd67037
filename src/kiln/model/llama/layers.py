"""The `llama` family's layers: RMSNorm, rotary embeddings, attention, the MLP, the block, and
the scan of a stack of blocks (`stacked_blocks` builds one, `scan_blocks` runs it).

Einsum letters: B batch, S query positions, T key positions, D d_model, N query heads,
K key/value heads, G = N/K query heads per key/value head, H head_dim, F d_ff, V vocab,
L layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kiln.config import ModelConfig
from kiln.model.attention import attention, cached_attention, causal_attention
from kiln.model.interface import (
    DTYPES,
    RollingLayer,
)
from kiln.model.project import project
from kiln.parallel.mesh import constrain, gathered
from kiln.parallel.pipeline import in_stages

# Residual stream and every [batch, seq, d_model] activation between sub-layers: its length is
# `act_length` (sequence parallelism over tensor), inside a sub-layer it is `length`.
ACT_BSD = ("batch", "act_length", "act_embed")
HEADS = ("batch", "length", "act_heads", None)
# Keys and values split along length like the queries (projected once per token); each
# attention implementation gathers them along length as it needs (kiln.model.attention).
KV_HEADS = ("batch", "length", "act_kv_heads", None)
_MLP = ("batch", "length", "act_mlp")
# The block's named intermediates (jax.ad_checkpoint.checkpoint_name; identity ops that the
# remat policies below select by name): projections before qk-norm and rope, attention's
# per-head output before wo, and the sub-layers' outputs before the residual adds.
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
MLP_NAMES = ("mlp_gate", "mlp_up")
TAGS = (*QKV_NAMES, "attn_out", "out_proj", *MLP_NAMES, "mlp_out")
# What each `model.remat` keeps from a block's forward pass for its backward (the block's
# input, the scan carry, is always kept); everything else is recomputed. docs/performance.md
# lists them in order of memory; "none" is no jax.checkpoint at all.
_save = jax.checkpoint_policies.save_only_these_names
REMAT_POLICIES = {
    # Outputs of matmuls without batch dimensions: the q/k/v, wo, gate and up projections
    # (w_down's output is never needed). Attention's scores and probs @ v are batched matmuls,
    # so they are recomputed, as are norms, rope, softmax and silu.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # The same tensors chosen by name (MaxText's `minimal`): the q/k/v, wo, gate, up and down
    # projections' outputs; the down projection's is named but never needed, so never kept.
    "save_projections": _save(*QKV_NAMES, "out_proj", *MLP_NAMES, "mlp_out"),
    # The attention sub-layer's projections and output; the MLP and softmax are recomputed.
    "minimal": _save(*QKV_NAMES, "attn_out", "out_proj"),
    "save_qkv_proj": _save(*QKV_NAMES),
    "save_out_proj": _save("out_proj"),
    # save_dots' tensors, moved to host memory (pinned_host) instead of kept on the device.
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=(*QKV_NAMES, "out_proj", *MLP_NAMES),
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "full": None,  # save nothing inside a block; recompute it all in the backward pass
}


def param(
    rngs: nnx.Rngs,
    cfg: ModelConfig,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    role: str,
    fan_in: tuple[str, ...] = (),
):
    """A normal(init_std) parameter tagged with the logical names of its dimensions and its
    role (`kiln.model.interface.ROLES`; a matrix's `fan_in`: the names of its input axes)."""
    dtype = DTYPES[cfg.param_dtype]
    value = (cfg.init_std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    # Sharding is applied from these names by mesh.sharded_init (jit out_shardings), not eagerly.
    extra = {"fan_in": fan_in} if role == "matrix" else {}
    return nnx.Param(value, out_sharding=names, eager_sharding=False, role=role, **extra)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32, returned in x's dtype."""

    def __init__(self, dim: int, axis: str, cfg: ModelConfig):
        """`axis`: the logical name of the normalised dimension (how `scale` is sharded)."""
        ones = jnp.ones((dim,), DTYPES[cfg.param_dtype])
        self.scale = nnx.Param(ones, out_sharding=(axis,), eager_sharding=False, role="norm")
        self.eps = cfg.norm_eps

    def multiplier(self) -> jax.Array:
        """What the normalised x is multiplied by, in float32: the scale itself."""
        return self.scale[...].astype(jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.multiplier()).astype(x.dtype)


def rope_frequencies(half: int, theta: float, scaling: tuple[float, ...] | None) -> jax.Array:
    """theta^(-i/half), i < half, in float32; `scaling` = (factor,) divides them all by factor
    (linear), (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    applies Llama 3.1's rescaling: wavelengths 2 pi / freq above original / low_freq_factor are
    stretched by factor, those below original / high_freq_factor kept, and between them
    freq' = (1 - s) freq / factor + s freq with s = (original / wavelength - low) / (high - low).
    """
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return freq
    if len(scaling) == 1:
        return freq / scaling[0]
    factor, low, high, original = scaling
    wavelength = 2 * jnp.pi / freq
    smooth = (original / wavelength - low) / (high - low)
    between = (1 - smooth) * freq / factor + smooth * freq
    stretched = jnp.where(wavelength > original / low, freq / factor, between)
    return jnp.where(wavelength < original / high, freq, stretched)


def rope(
    x_BSNH: jax.Array,
    positions_BS: jax.Array,
    theta: float,
    scaling: tuple[float, ...] | None = None,
) -> jax.Array:
    """Rotary embedding (rotate-half layout) of heads x at integer positions; float32 inside."""
    half = x_BSNH.shape[-1] // 2
    freq = rope_frequencies(half, theta, scaling)
    angle_BSh = positions_BS[..., None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle_BSh)[:, :, None, :], jnp.cos(angle_BSh)[:, :, None, :]
    x1, x2 = jnp.split(x_BSNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSNH.dtype)


def scaling_tuple(r) -> tuple[float, ...] | None:
    """model.rope_scaling as the tuple `rope_frequencies` reads (None: no rescaling)."""
    if r is None:
        return None
    if r.rope_type == "linear":
        return (r.factor,)
    return (r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings)


class Attention(nnx.Module):
    """Grouped-query causal self-attention that stays inside each packed document."""

    norm: ClassVar[type[RMSNorm]] = RMSNorm  # of the query and key heads, with model.qk_norm

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
        into, out_of = ("embed",), ("heads", "head_dim")
        self.wq = param(rngs, cfg, (d, n, h), ("embed", "heads", "head_dim"), "matrix", into)
        self.wk = param(rngs, cfg, (d, k, h), ("embed", "kv_heads", "head_dim"), "matrix", into)
        self.wv = param(rngs, cfg, (d, k, h), ("embed", "kv_heads", "head_dim"), "matrix", into)
        self.wo = param(rngs, cfg, (n, h, d), ("heads", "head_dim", "embed"), "matrix", out_of)
        self.q_norm = self._query_norm(cfg) if cfg.qk_norm else None
        self.k_norm = self.norm(h, "head_dim", cfg) if cfg.qk_norm else None
        self.theta = cfg.rope_theta
        self.rope_scaling = scaling_tuple(cfg.rope_scaling)
        self.dtype = DTYPES[cfg.dtype]
        self.implementation = cfg.attention
        self.context = cfg.context_parallel
        self.window = cfg.sliding_window
        self.local_theta = cfg.local_rope_theta
        # GPT-OSS's sinks: one logit per query head, kept in float32 like the norms.
        self.sinks = (
            nnx.Param(
                cfg.init_std * jax.random.normal(rngs.params(), (n,), jnp.float32),
                out_sharding=("heads",),
                eager_sharding=False,
                role="bias",
            )
            if cfg.attention_sinks
            else None
        )

    def _query_norm(self, cfg: ModelConfig) -> RMSNorm:
        """The query heads' norm (a family may fold a scale of the scores into it)."""
        return self.norm(cfg.resolved_head_dim, "head_dim", cfg)

    def _rope(self, x_BSNH, positions_BS, local):
        """Rotary embedding of the layer's kind: a sliding_attention layer's own base
        (model.local_rope_theta, unscaled) when set; `local` traced: chosen per layer."""
        full = rope(x_BSNH, positions_BS, self.theta, self.rope_scaling)
        if self.local_theta is None or local is False:
            return full
        own = rope(x_BSNH, positions_BS, self.local_theta)
        return own if local is True else jnp.where(local, own, full)

    def _attend(self, q_BSNH, k_BTKH, v_BTKH, local, fn):
        """`fn(q, k, v, window=..., sinks_N=...)` for the layer's kind: with the sliding window
        when `local`; `local` traced (a stack mixing kinds): both, chosen per layer by a
        `lax.cond`, so each is compiled with its own static mask (and skips its own blocks)."""
        sinks_N = None if self.sinks is None else self.sinks[...]
        if local is True or local is False:
            return fn(
                q_BSNH, k_BTKH, v_BTKH, window=self.window if local else None, sinks_N=sinks_N
            )

        def kind(window):
            return lambda q, k, v, sinks: fn(q, k, v, window=window, sinks_N=sinks)

        return jax.lax.cond(local, kind(self.window), kind(None), q_BSNH, k_BTKH, v_BTKH, sinks_N)

    def _weight(self, w: nnx.Param) -> jax.Array:
        """A projection's weight in the compute dtype. Inside pipeline stages it is gathered over
        fsdp here, as one value for the layer's forward pass and both of its backward products:
        left to XLA, the TPU compiler gathered the query weight twice in each layer's backward
        pass (for the recomputed forward and again for the input's gradient) and moved the
        others around rings, 787.0 against 720.9 GB a step on Llama-3-70B (docs/pipeline.md).
        Outside stages (measured on the 8B on a v5p-16) and on the MLP's weights the same
        constraint turned gradient sums into all-reduces, so it is not applied there."""
        value = w[...].astype(self.dtype)
        if not in_stages():
            return value
        return gathered(value, w.out_sharding[-value.ndim :])  # a stacked layer's: one layer's

    def _projections(self, x_BSD):
        """Queries [B,S,N,H], keys and values [B,S,K,H]: x's projections (a family may add
        biases)."""
        q_BSNH = project("BSD,DNH->BSNH", x_BSD, self._weight(self.wq))
        k_BTKH = project("BSD,DKH->BSKH", x_BSD, self._weight(self.wk))
        v_BTKH = project("BSD,DKH->BSKH", x_BSD, self._weight(self.wv))
        return q_BSNH, k_BTKH, v_BTKH

    def _output(self, out_BSNH):
        """The heads' output projected to [B,S,D] (a family may add a bias)."""
        return project("BSNH,NHD->BSD", out_BSNH, self._weight(self.wo))

    def _qkv(self, x_BSD, positions_BS, local=False):
        """Queries [B,S,N,H], keys and values [B,S,K,H] of x, normed (if configured) and rotated."""
        q_BSNH, k_BTKH, v_BTKH = self._projections(x_BSD)
        q_BSNH = checkpoint_name(q_BSNH, "q_proj")
        k_BTKH = checkpoint_name(k_BTKH, "k_proj")
        v_BTKH = checkpoint_name(v_BTKH, "v_proj")
        if self.q_norm is not None:
            q_BSNH, k_BTKH = self.q_norm(q_BSNH), self.k_norm(k_BTKH)
        q_BSNH = constrain(self._rope(q_BSNH, positions_BS, local), HEADS)
        k_BTKH = constrain(self._rope(k_BTKH, positions_BS, local), KV_HEADS)
        v_BTKH = constrain(v_BTKH, KV_HEADS)
        return q_BSNH, k_BTKH, v_BTKH

    def _out(self, out_BSNH):
        out_BSNH = checkpoint_name(constrain(out_BSNH, HEADS), "attn_out")
        return checkpoint_name(self._output(out_BSNH), "out_proj")

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, local=False):
        """`local`: a sliding_attention layer (a bool, or traced in a stack of both kinds)."""
        q_BSNH, k_BTKH, v_BTKH = self._qkv(x_BSD, positions_BS, local)

        def fn(q, k, v, **masks):
            return attention(
                q,
                k,
                v,
                segment_ids_BS,
                implementation=self.implementation,
                context=self.context,
                **masks,
            )

        return self._out(self._attend(q_BSNH, k_BTKH, v_BTKH, local, fn))

    def cached(self, x_BSD, positions_BS, segment_ids_BS, layer, local=False):
        """(output, new keys [B,S,K,H], new values) of S new tokens over a layer's cache.

        `layer` is (k_BTKH, v_BTKH, segment_ids_BT, index) with the new tokens' segment ids
        already at slots index.., a `RollingLayer` (a sliding_attention layer's last W slots),
        or None for an empty cache (a prefill: the new tokens attend only to each other,
        through the blocked XLA attention, which takes any length on any platform). A
        sliding_attention layer masks the slots before its window.
        """
        q_BSNH, k_BSKH, v_BSKH = self._qkv(x_BSD, positions_BS, local)
        if layer is None:

            def fn(q, k, v, **masks):
                return causal_attention(q, k, v, segment_ids_BS, **masks)

            out_BSNH = self._attend(q_BSNH, k_BSKH, v_BSKH, local, fn)
        elif isinstance(layer, RollingLayer):  # the window's slots, then the new tokens
            s = x_BSD.shape[1]
            k_BTKH = jnp.concatenate([layer.k, k_BSKH.astype(layer.k.dtype)], axis=1)
            v_BTKH = jnp.concatenate([layer.v, v_BSKH.astype(layer.v.dtype)], axis=1)
            segment_ids_BT = jnp.concatenate([layer.segment_ids, segment_ids_BS], axis=1)
            slots_T = jnp.concatenate([layer.slots, layer.index + jnp.arange(s)])

            def fn(q, k, v, **masks):
                return cached_attention(
                    q, k, v, segment_ids_BS, segment_ids_BT, layer.index, slots_T=slots_T, **masks
                )

            out_BSNH = self._attend(q_BSNH, k_BTKH, v_BTKH, local, fn)
        else:
            k_BTKH, v_BTKH, segment_ids_BT, index = layer
            at = (0, index, 0, 0)
            k_BTKH = jax.lax.dynamic_update_slice(k_BTKH, k_BSKH.astype(k_BTKH.dtype), at)
            v_BTKH = jax.lax.dynamic_update_slice(v_BTKH, v_BSKH.astype(v_BTKH.dtype), at)

            def fn(q, k, v, **masks):
                return cached_attention(q, k, v, segment_ids_BS, segment_ids_BT, index, **masks)

            out_BSNH = self._attend(q_BSNH, k_BTKH, v_BTKH, local, fn)
        return self._out(out_BSNH), k_BSKH, v_BSKH


class Mlp(nnx.Module):
    """SwiGLU: (silu(x W_gate) * x W_up) W_down (another gate `activation`: GeGLU, say)."""

    activation: ClassVar = staticmethod(jax.nn.silu)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.w_gate = param(rngs, cfg, (d, f), ("embed", "mlp"), "matrix", ("embed",))
        self.w_up = param(rngs, cfg, (d, f), ("embed", "mlp"), "matrix", ("embed",))
        self.w_down = param(rngs, cfg, (f, d), ("mlp", "embed"), "matrix", ("mlp",))
        self.dtype = DTYPES[cfg.dtype]

    def __call__(self, x_BSD):
        dt = self.dtype
        gate_BSF = project("BSD,DF->BSF", x_BSD, self.w_gate[...].astype(dt))
        up_BSF = project("BSD,DF->BSF", x_BSD, self.w_up[...].astype(dt))
        gate_BSF, up_BSF = checkpoint_name(gate_BSF, "mlp_gate"), checkpoint_name(up_BSF, "mlp_up")
        h_BSF = constrain(self.activation(gate_BSF) * up_BSF, _MLP)
        out_BSD = project("BSF,FD->BSD", h_BSF, self.w_down[...].astype(dt))
        return checkpoint_name(out_BSD, "mlp_out")


class Block(nnx.Module):
    """Pre-norm Transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    Returns (x, aux): aux holds the block's auxiliary sums (`ModelOutput.aux`), none for the
    dense MLP; a family with another MLP overrides `_make_mlp` and `_mlp`, one with another
    attention `_make_attention` (a module with `__call__` and `cached` as `Attention`'s),
    another RMSNorm `norm`.
    """

    norm: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = self.norm(cfg.d_model, "norm", cfg)
        self.attn = self._make_attention(cfg, rngs)
        self.mlp_norm = self.norm(cfg.d_model, "norm", cfg)
        self.mlp = self._make_mlp(cfg, rngs)

    def _make_attention(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return Attention(cfg, rngs=rngs)

    def _make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return Mlp(cfg, rngs=rngs)

    def _mlp(self, h_BSD, segment_ids_BS) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The MLP sub-layer's output and its auxiliary sums."""
        return self.mlp(h_BSD), {}

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, local=False):
        """`local`: a sliding_attention layer (`Attention.__call__`)."""
        # Norms and residual adds run on the residual's sharding (ACT_BSD); each sub-layer's
        # output is pinned to it too, so its partial sums over tensor are reduce-scattered.
        h_BSD = constrain(self.attn_norm(x_BSD), ACT_BSD)
        attn_BSD = self.attn(h_BSD, positions_BS, segment_ids_BS, local)
        return self._rest(x_BSD, attn_BSD, segment_ids_BS)

    def cached(self, x_BSD, positions_BS, segment_ids_BS, layer, local=False):
        """The block on new tokens over a layer's cache: (output, new keys, new values)."""
        h_BSD = constrain(self.attn_norm(x_BSD), ACT_BSD)
        attn_BSD, k_BSKH, v_BSKH = self.attn.cached(
            h_BSD, positions_BS, segment_ids_BS, layer, local
        )
        x_BSD, _ = self._rest(x_BSD, attn_BSD, segment_ids_BS)
        return x_BSD, k_BSKH, v_BSKH

    def _rest(self, x_BSD, attn_BSD, segment_ids_BS):
        """The attention's residual add, then the MLP sub-layer: (output, aux)."""
        x_BSD = x_BSD + constrain(attn_BSD, ACT_BSD)
        h_BSD = constrain(self.mlp_norm(x_BSD), ACT_BSD)
        y_BSD, aux = self._mlp(h_BSD, segment_ids_BS)
        x_BSD = x_BSD + constrain(y_BSD, ACT_BSD)
        return constrain(x_BSD, ACT_BSD), aux


def stack_size(blocks: nnx.Module) -> int:
    """Number of layers of a stack of blocks (the leading `layers` axis of its parameters)."""
    return jax.tree.leaves(nnx.state(blocks))[0].shape[0]


def layer_kinds(local: Sequence[bool] | jax.Array) -> tuple[bool | None, jax.Array | None]:
    """(the `local` every block of a stack gets, or None; the [L] bools to scan over, or None):
    a stack whose layers are all of one kind compiles one attention, a mixed one gets each
    layer's kind as a scanned input (as does an array of kinds, e.g. a pipeline stage's)."""
    if isinstance(local, jax.Array):
        return None, local
    if len(set(local)) == 1:
        return bool(local[0]), None
    return None, jnp.asarray(local)


def scan_blocks(
    blocks,
    x_BSD,
    positions_BS,
    segment_ids_BS,
    *,
    remat: str,
    collect: bool,
    casts: bool = False,
    local: Sequence[bool] | jax.Array = (False,),
    repeat: jax.Array | None = None,
):
    """Run a stack of blocks over x: (x after the stack, the residual stream after each block
    [L,B,S,D] if `collect` else None, each block's aux stacked along a leading [L] axis).
    `local`: per layer, whether it is a sliding_attention layer (`layer_kinds`; a bool array
    when the layers a call runs are only known when traced).

    `repeat`: the blocks' parameters (and an array `local`) are [L, R, ...], the weights of a
    pipeline stage's R repeats (`kiln.parallel.pipeline.stack`), and layer j runs with
    [j, repeat]. The slice is taken inside the layer's remat, so that the backward pass keeps
    the stage's weights once instead of a slice of them per pipeline iteration.

    `casts`: the blocks cast their weights to another compute dtype. Each layer's weights then
    get a zero that differs per layer added first (x + 0.0 is x, and its gradient is the
    identity), so that XLA casts one layer's weights per iteration instead of moving the cast
    out of the loop, which would hold a cast copy of the whole stack (3.5 GB on the 8B).
    An optimization barrier on the layer's weights instead does not keep the TPU compiler from
    making bf16 copies of whole stacks ([6, 352, 32] in tests/test_compile.py's
    `test_layer_weights_are_cast_to_the_compute_dtype_one_layer_at_a_time`, which pins this).
    """
    graphdef, params = nnx.split(blocks)

    every, scanned = layer_kinds(local)

    def body(x_BSD, xs):
        layer_params, zero, kind = xs
        if repeat is not None:
            layer_params = jax.tree.map(lambda w: w[repeat], layer_params)
            kind = None if kind is None else kind[repeat]
        if casts:
            layer_params = jax.tree.map(lambda w: w + zero.astype(w.dtype), layer_params)
        block = nnx.merge(graphdef, layer_params)
        flag = every if kind is None else kind
        y_BSD, aux = block(x_BSD, positions_BS, segment_ids_BS, flag)
        return y_BSD, ((y_BSD if collect else None), aux)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    zeros = jnp.arange(stack_size(blocks), dtype=jnp.float32) * 0.0 if casts else None
    x_BSD, (all_LBSD, aux) = jax.lax.scan(body, x_BSD, (params, zeros, scanned))
    return x_BSD, all_LBSD, aux


def stacked_blocks(
    cfg: ModelConfig,
    rngs: nnx.Rngs,
    block: type[Block] = Block,
    num_layers: int | None = None,
    axis: str = "layers",
) -> Block:
    """One `block` whose parameters have a leading axis of size `num_layers` (default:
    model.num_layers) named `axis`: `layers`, or `unstaged_layers` for a stack that runs
    outside pipeline stages (docs/pipeline.md)."""

    @nnx.split_rngs(splits=cfg.num_layers if num_layers is None else num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(layer_rngs: nnx.Rngs) -> Block:
        return block(cfg, rngs=layer_rngs)

    return make(rngs)
