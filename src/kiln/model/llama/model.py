"""The `llama` family's network: a decoder-only Transformer (Llama-style, Flax NNX) over the
blocks of `kiln.model.llama.layers`, its decode cache and its size accounting.

Einsum letters: B batch, S query positions, T key positions, D d_model, V vocab, L layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from kiln.config import ModelConfig
from kiln.errors import KilnError
from kiln.losses import logits as head_logits
from kiln.model.interface import (
    CACHE_LBTKH,
    DTYPES,
    KVCache,
    ModelOutput,
    RollingLayer,
    logits_dtype,
)
from kiln.model.llama.layers import (
    ACT_BSD,
    Block,
    RMSNorm,
    layer_kinds,
    param,
    scan_blocks,
    stack_size,
    stacked_blocks,
)
from kiln.parallel import pipeline
from kiln.parallel.mesh import constrain


def join_layers(parts: list[jax.Array]) -> jax.Array:
    """Per-layer arrays of consecutive stacks as one [L, ...] array."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


class Transformer(nnx.Module):
    """Token embedding, `num_layers` scanned blocks, final RMSNorm; the LM head is separate.

    Implements `kiln.model.LanguageModel`; activations are sharded by `kiln.parallel.mesh.constrain`,
    so run it inside `kiln.parallel.mesh.use_mesh` to shard, outside to run on one device.
    """

    block: ClassVar[type[Block]] = Block
    norm: ClassVar[type[RMSNorm]] = RMSNorm  # the final norm

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        shape = (cfg.vocab_size, cfg.d_model)
        self.embedding = param(rngs, cfg, shape, ("vocab", "embed"), "embedding")
        self._build_stacks(cfg, rngs)
        self.final_norm = self.norm(cfg.d_model, "norm", cfg)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), "head")
        )

    def _build_stacks(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        """The scanned stacks of blocks, between the embedding and the final norm: one of
        `num_layers` blocks (`self.blocks`) for this family."""
        self.blocks = stacked_blocks(cfg, rngs, self.block)

    def hidden_states(
        self,
        inputs_BS: jax.Array,
        positions_BS: jax.Array,
        segment_ids_BS: jax.Array,
        *,
        collect: Sequence[int] = (),
    ) -> ModelOutput:
        """Hidden states [B,S,D] after the final norm, in the compute dtype.

        With `collect`, features [len(collect),B,S,D]: the residual stream after each listed
        block (0-based), before the final norm; otherwise features is None. aux: the blocks'
        auxiliary sums, combined by `_aux` (none for this family).
        """
        x_BSD, features, aux = self.trunk(inputs_BS, positions_BS, segment_ids_BS, collect=collect)
        args = (x_BSD, inputs_BS, positions_BS, segment_ids_BS)
        schedule = pipeline.current_schedule()
        if schedule is not None and self.predicts_ahead(self.cfg)[0]:
            # After the stages, on the stages' micro-batches: the modules' routing statistics
            # are then those of the micro-batches gradient accumulation would run.
            ahead, ahead_aux = pipeline.each_microbatch(self._ahead, args, schedule.microbatches)
        else:
            ahead, ahead_aux = self._ahead(*args)
        return ModelOutput(self.final_norm(x_BSD), features, self._aux(aux + ahead_aux), ahead)

    def _ahead(self, x_BSD, inputs_BS, positions_BS, segment_ids_BS):
        """(`ModelOutput.ahead`, the per-layer aux of the modules that make it, as one more
        stack's) from the residual stream after the last block: none for this family."""
        return (), []

    def trunk(self, inputs_BS, positions_BS, segment_ids_BS, *, collect: Sequence[int] = ()):
        """(the residual stream after the last block, before the final norm; the features of
        `collect` as in `hidden_states`, or None; each stack's per-layer aux, in order)."""
        cfg = self.cfg
        collect = tuple(int(i) for i in collect)
        for i in collect:
            if not 0 <= i < cfg.num_layers:
                raise KilnError(
                    f"layer {i} requested for features, but the model has "
                    f"model.num_layers={cfg.num_layers} (allowed: 0..{cfg.num_layers - 1})"
                )
        x_BSD = self.embed(inputs_BS)
        schedule = pipeline.current_schedule()
        if schedule is not None and collect:
            raise KilnError(  # the config's checks refuse this first (kiln.config.rules)
                "mesh.stage: pipeline stages do not collect features"
            )
        all_LBSD, aux, first, local = [], [], 0, cfg.local_layers()
        for blocks in self._stacks():
            n = stack_size(blocks)
            if schedule is not None and blocks is self.blocks:
                # The main stack in pipeline stages; the others run before it as they do
                # without stages, on every stage (docs/pipeline.md).
                x_BSD, stack_aux = self._stages(
                    x_BSD, positions_BS, segment_ids_BS, schedule, local[first : first + n]
                )
                all_BSD = None
            else:
                x_BSD, all_BSD, stack_aux = scan_blocks(
                    blocks,
                    x_BSD,
                    positions_BS,
                    segment_ids_BS,
                    remat=cfg.remat,
                    collect=bool(collect),
                    casts=cfg.dtype != cfg.param_dtype,
                    local=local[first : first + n],
                )
            all_LBSD.append(all_BSD)
            aux.append(stack_aux)
            first += n
        features = join_layers(all_LBSD)[jnp.asarray(collect)] if collect else None
        return x_BSD, features, aux

    def _stages(self, x_BSD, positions_BS, segment_ids_BS, schedule, local):
        """(x after the main stack `blocks`, its per-layer aux) with the stack in pipeline
        stages (`kiln.parallel.pipeline.stack`): each stage scans its layers as `trunk` scans
        the whole stack. `local`: each layer's kind; when they differ, each layer's goes with
        its weights to the stage that runs it."""
        cfg = self.cfg
        graphdef, params = nnx.split(self.blocks)
        mixed = len(set(local)) > 1
        stacked = (params, jnp.asarray(local)) if mixed else params

        def run_layers(layer_params, x_BSD, extras, repeat):
            positions_BS, segment_ids_BS = extras
            layer_params, kinds = layer_params if mixed else (layer_params, local[:1])
            y_BSD, _, aux = scan_blocks(
                nnx.merge(graphdef, layer_params),
                x_BSD,
                positions_BS,
                segment_ids_BS,
                remat=cfg.remat,
                collect=False,
                casts=cfg.dtype != cfg.param_dtype,
                local=kinds,
                repeat=repeat,
            )
            return y_BSD, aux

        extras = (positions_BS, segment_ids_BS)
        return pipeline.stack(run_layers, stacked, x_BSD, extras, schedule)

    def _stacks(self) -> list[nnx.Module]:
        """The scanned stacks of blocks, in order (each with a leading `layers` axis)."""
        return [self.blocks]

    def _aux(self, per_stack: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
        """`ModelOutput.aux` from each stack's per-layer aux (none for the dense blocks)."""
        return {}

    def embed(self, inputs_BS):
        """The embedding rows of `inputs_BS` in the compute dtype, sharded as the residual stream
        ([B, S, D])."""
        # The rows are looked up where the table lies: every device takes its slice of the
        # embed dimension for all tokens (the ids are gathered, not the table), and one
        # all-to-all moves the [B, S, D] result to the batch/length split. The table is never
        # whole on a device (2.1 GB in float32 on Llama-3-8B: 128,256 x 4,096). With pipeline
        # stages, all tokens of the stage's rows: the batch is split over `stage` outside the
        # stages (kiln.config.axes), and a lookup of every row would have the backward pass
        # gather the whole batch's gradient on every device.
        with pipeline.rows_by_stage():
            rows_BSD = jnp.take(self.embedding[...], inputs_BS, axis=0)
            x_BSD = constrain(rows_BSD, ("batch", None, "embed"))
        return constrain(x_BSD.astype(DTYPES[self.cfg.dtype]), ACT_BSD)

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache [L,B,length,K,H] in the compute dtype (zeros; index 0); with
        sliding_attention layers whose window W is shorter than `length`, those layers keep
        their last W slots only (`KVCache.local_k`)."""
        c = self.cfg
        local = sum(c.local_layers()) if c.sliding_window and c.sliding_window < length else 0

        def zeros(layers: int, slots: int):
            shape = (layers, batch, slots, c.kv_heads, c.resolved_head_dim)
            return constrain(jnp.zeros(shape, DTYPES[c.dtype]), CACHE_LBTKH)

        kv = zeros(c.num_layers - local, length)
        segment_ids_BT = constrain(jnp.zeros((batch, length), jnp.int32), ("batch", None))
        rolling = zeros(local, c.sliding_window) if local else None
        return KVCache(kv, kv, segment_ids_BT, jnp.zeros((), jnp.int32), rolling, rolling)

    def cache_bytes_per_token(self) -> tuple[int, str]:
        """Keys and values of every layer: 2 x layers x key/value heads x head_dim values
        (a sliding_attention layer's only until its window is full: it keeps W tokens)."""
        c = self.cfg
        itemsize = jnp.dtype(DTYPES[c.dtype]).itemsize
        per_layer = 2 * c.kv_heads * c.resolved_head_dim * itemsize
        what = (
            f"keys and values, {c.num_layers} layers x {c.kv_heads} heads x "
            f"{c.resolved_head_dim}, {c.dtype}"
        )
        local = sum(c.local_layers())
        if local:
            what += (
                f"; of them, {local} sliding_attention keep their last {c.sliding_window} "
                f"tokens only, {local * per_layer * c.sliding_window:,} bytes in all once that "
                f"many are decoded, so {(c.num_layers - local) * per_layer:,} bytes per token "
                "after that"
            )
        return c.num_layers * per_layer, what

    def constrain_cache(self, cache: KVCache) -> KVCache:
        """The cache pinned to its layout: rows split like the batch, heads like the keys'."""
        rolling = cache.local_k is not None
        return KVCache(
            constrain(cache.k, CACHE_LBTKH),
            constrain(cache.v, CACHE_LBTKH),
            constrain(cache.segment_ids, ("batch", None)),
            cache.index,
            constrain(cache.local_k, CACHE_LBTKH) if rolling else None,
            constrain(cache.local_v, CACHE_LBTKH) if rolling else None,
        )

    def extend(self, inputs_BS, positions_BS, segment_ids_BS, cache: KVCache, *, fresh=False):
        """Hidden states [B,S,D] of new tokens written at `cache.index`, and the cache after.

        See `kiln.model.LanguageModel.extend`; each stack of blocks is scanned as in
        `hidden_states`, each block reading its layer of the cache and returning its new keys
        and values, which are written into the whole cache once after the scans (in place when
        the cache is donated).
        """
        x_BSD = self.embed(inputs_BS)
        at = (0, cache.index)
        segment_ids_BT = jax.lax.dynamic_update_slice(
            cache.segment_ids, segment_ids_BS.astype(jnp.int32), at
        )
        if cache.local_k is not None:
            return self._extend_rolling(
                x_BSD, positions_BS, segment_ids_BS, segment_ids_BT, cache, fresh
            )
        new_k, new_v, first = [], [], 0
        for blocks in self._stacks():
            graphdef, params = nnx.split(blocks)
            n = stack_size(blocks)

            every, scanned = layer_kinds(self.cfg.local_layers()[first : first + n])

            def body(x_BSD, xs, graphdef=graphdef, every=every):
                layer_params, kind, *kv = xs
                layer = None if fresh else (*kv, segment_ids_BT, cache.index)
                block = nnx.merge(graphdef, layer_params)
                flag = every if kind is None else kind
                x_BSD, k_BSKH, v_BSKH = block.cached(
                    x_BSD, positions_BS, segment_ids_BS, layer, flag
                )
                return x_BSD, (k_BSKH, v_BSKH)

            layers = slice(first, first + n)
            whole = n == cache.k.shape[0]
            xs = (
                (params, scanned)
                if fresh
                else (params, scanned, *(c if whole else c[layers] for c in (cache.k, cache.v)))
            )
            x_BSD, (k_LBSKH, v_LBSKH) = jax.lax.scan(body, x_BSD, xs)
            new_k.append(k_LBSKH)
            new_v.append(v_LBSKH)
            first += n
        at = (0, 0, cache.index, 0, 0)
        k = jax.lax.dynamic_update_slice(cache.k, join_layers(new_k).astype(cache.k.dtype), at)
        v = jax.lax.dynamic_update_slice(cache.v, join_layers(new_v).astype(cache.v.dtype), at)
        index = cache.index + inputs_BS.shape[1]
        cache = self.constrain_cache(KVCache(k, v, segment_ids_BT, index))
        return self.final_norm(x_BSD), cache

    def _extend_rolling(self, x_BSD, positions_BS, segment_ids_BS, segment_ids_BT, cache, fresh):
        """`extend` over a rolling cache: the layers one by one (a stack of both kinds has two
        cache shapes), each sliding_attention layer reading its window's W slots and keeping
        the new tokens' last W at slot mod W; the other layers as in `extend`."""
        c, index = self.cfg, cache.index
        w, s = c.sliding_window, x_BSD.shape[1]
        # Ring position j holds the latest slot before index that is j mod W (none yet: < 0).
        slots_W = index - 1 - jnp.mod(index - 1 - jnp.arange(w), w)
        ring_segments_BW = jnp.where(
            slots_W >= 0, jnp.take(cache.segment_ids, jnp.maximum(slots_W, 0), axis=1), 0
        )
        local = c.local_layers()
        new = {True: [], False: []}
        for blocks in self._stacks():
            graphdef, params = nnx.split(blocks)
            for j in range(stack_size(blocks)):
                kind = local[len(new[True]) + len(new[False])]
                i = len(new[kind])
                if fresh:
                    layer = None
                elif kind:
                    k_BWKH, v_BWKH = cache.local_k[i], cache.local_v[i]
                    layer = RollingLayer(k_BWKH, v_BWKH, ring_segments_BW, slots_W, index)
                else:
                    layer = (cache.k[i], cache.v[i], segment_ids_BT, index)
                block = nnx.merge(graphdef, jax.tree.map(lambda p, j=j: p[j], params))
                x_BSD, k_BSKH, v_BSKH = block.cached(
                    x_BSD, positions_BS, segment_ids_BS, layer, kind
                )
                new[kind].append((k_BSKH, v_BSKH))
        k, v = cache.k, cache.v
        if new[False]:
            at = (0, 0, index, 0, 0)
            k = jax.lax.dynamic_update_slice(
                k, jnp.stack([x for x, _ in new[False]]).astype(k.dtype), at
            )
            v = jax.lax.dynamic_update_slice(
                v, jnp.stack([y for _, y in new[False]]).astype(v.dtype), at
            )
        # The new tokens' last min(S, W) go to their ring positions (distinct: fewer than W).
        kept = min(s, w)
        ring_W = jnp.mod(index + s - kept + jnp.arange(kept), w)
        local_k, local_v = cache.local_k, cache.local_v
        new_k = jnp.stack([x[:, s - kept :] for x, _ in new[True]]).astype(local_k.dtype)
        new_v = jnp.stack([y[:, s - kept :] for _, y in new[True]]).astype(local_v.dtype)
        local_k = local_k.at[:, :, ring_W].set(new_k)
        local_v = local_v.at[:, :, ring_W].set(new_v)
        cache = KVCache(k, v, segment_ids_BT, index + s, local_k, local_v)
        return self.final_norm(x_BSD), self.constrain_cache(cache)

    def head_weight(self, dtype=None) -> jax.Array:
        """LM head [D, V] (the embedding transposed when tied) in `dtype` (None: logits dtype)."""
        head_DV = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
        return head_DV.astype(logits_dtype(self.cfg) if dtype is None else dtype)

    def logits(self, hidden_BSD: jax.Array) -> jax.Array:
        """Logits [..., V] in float32 from hidden [..., D]; cap * tanh(logits / cap) if capped."""
        logits = head_logits(hidden_BSD, self.head_weight(), softcap=self.cfg.logit_softcap)
        if logits.ndim == 3:
            logits = constrain(logits, ("batch", "length", "act_vocab"))
        return logits

    def diagnostics(self) -> dict[str, jax.Array]:
        """The LM head's Frobenius norm and the final norm's mean scale, in float32."""
        return {
            "learning/lm_head_norm": jnp.linalg.norm(self.head_weight(jnp.float32)),
            "learning/final_norm_scale": jnp.mean(self.final_norm.multiplier()),
        }

    def update_balance(self, aux: dict[str, jax.Array]) -> None:
        """Nothing: this family has no parameters moved outside the gradient."""

    @staticmethod
    def aux_metrics(cfg: ModelConfig, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """No statistics beyond the scalar aux sums (this family has none)."""
        return {}

    @staticmethod
    def predicts_ahead(cfg: ModelConfig) -> tuple[int, float]:
        """No multi-token prediction modules."""
        return 0, 0.0

    def auxiliary_params(self) -> int:
        """Parameters beside the decoder (none)."""
        return 0

    def inactive_params(self) -> int:
        """Parameters a token does not use (none in a dense model)."""
        return 0

    def matmul_params(self) -> int:
        """Parameters that multiply activations: all blocks' projections plus the LM head."""
        m = self.cfg
        d, f, h, n, k = m.d_model, m.d_ff, m.resolved_head_dim, m.num_heads, m.kv_heads
        per_layer = d * (n + 2 * k) * h + n * h * d + 3 * d * f
        return m.num_layers * per_layer + d * m.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N_matmul + causal attention 6 L S N H (MaxText accounting).

        Forward + backward = 3x the forward's 2 N FLOPs per token for matmul parameters N; the
        attention scores and values cost 4 K N H per token per layer forward for K keys per
        query, times 3 for training: K = S/2 under the causal mask, and in a sliding_attention
        layer of window W < S, W - W^2 / 2S (each query's min(i+1, W) keys, as S/2 is i+1's).
        """
        m = self.cfg
        keys = [
            seq_len / 2 if not local or m.sliding_window >= seq_len
            else m.sliding_window - m.sliding_window**2 / (2 * seq_len)
            for local in m.local_layers()
        ]  # fmt: skip
        attention = 12.0 * sum(keys) * m.num_heads * m.resolved_head_dim
        return 6.0 * self.matmul_params() + attention
