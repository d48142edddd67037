"""The `deepseek` family's model: latent-attention blocks, routed experts, multi-token prediction.

The blocks are the `moe` family's (`first_dense_layers` dense, then routed experts as
model.moe routes: DeepSeek-V3's sigmoid, group-limited, bias-corrected top-k) with
`LatentAttention` in place of grouped-query attention. With model.deepseek.mtp_num_layers =
M, M multi-token prediction modules follow the decoder (DeepSeek-V3 report, section 2.2):
module d (1-based) takes the previous depth's residual stream h^{d-1} (h^0: the decoder's, before its
final norm) and the embedding of the token d positions ahead, RMS-normed each, projects their
concatenation [embedding; hidden] back to d_model, runs one routed block and a final RMSNorm;
its hidden states predict the token d+1 ahead through the shared embedding and LM head
(`ModelOutput.ahead`; the objective computes their losses). generate never runs them.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from kiln.config import ModelConfig
from kiln.losses import ahead
from kiln.model.deepseek.mla import LatentAttention, attention_params
from kiln.model.interface import DTYPES, KVCache
from kiln.model.llama import (
    ACT_BSD,
    REMAT_POLICIES,
    Block,
    RMSNorm,
    stacked_blocks,
)
from kiln.model.llama.layers import param
from kiln.model.moe import MoeBlock, MoeTransformer
from kiln.model.project import project
from kiln.parallel.mesh import constrain

# The latent cache [L,B,T,1,R] and the rotary keys [L,B,T,1,P]: rows split like the batch;
# the one shared "head" is never split.
CACHE_LBT1C = (None, "batch", None, None, None)


class LatentBlock(Block):
    """llama's block with latent attention (a dense MLP: the first_dense_layers)."""

    def _make_attention(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return LatentAttention(cfg, rngs=rngs)


class LatentMoeBlock(MoeBlock):
    """The `moe` family's routed block with latent attention."""

    def _make_attention(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return LatentAttention(cfg, rngs=rngs)


class MtpModule(nnx.Module):
    """One multi-token prediction depth: norms of the embedding and the previous hidden
    state, their projection `proj` [2D, D] (embedding rows first), a routed block, a final
    norm."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.embed_norm = RMSNorm(d, "norm", cfg)
        self.hidden_norm = RMSNorm(d, "norm", cfg)
        self.proj = param(rngs, cfg, (2 * d, d), ("embed", None), "matrix", ("embed",))
        self.block = LatentMoeBlock(cfg, rngs=rngs)
        self.final_norm = RMSNorm(d, "norm", cfg)
        self.dtype = DTYPES[cfg.dtype]

    def __call__(self, h_BSD, e_BSD, positions_BS, segment_ids_BS):
        """(the block's output residual stream, its aux) from the previous depth's residual
        stream h and the embeddings e of the tokens this depth reads."""
        both_BSE = jnp.concatenate([self.embed_norm(e_BSD), self.hidden_norm(h_BSD)], axis=-1)
        x_BSD = constrain(
            project("BSE,ED->BSD", both_BSE, self.proj[...].astype(self.dtype)), ACT_BSD
        )
        return self.block(x_BSD, positions_BS, segment_ids_BS)


class DeepseekTransformer(MoeTransformer):
    """The `deepseek` family (implements `kiln.model.LanguageModel`): the `moe` family's two
    stacks with latent attention, and `mtp` (M stacked `MtpModule`s, or None).

    aux as the `moe` family's, the modules' routed blocks included: their router losses join
    the sums, and their rows follow the decoder's in `moe/expert_tokens` (logged as layers
    num_layers.., Hugging Face's numbering of DeepSeek's modules).
    """

    dense_block: ClassVar[type[Block]] = LatentBlock
    moe_block: ClassVar[type[Block]] = LatentMoeBlock

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        m = cfg.deepseek.mtp_num_layers
        self.mtp = stacked_blocks(cfg, rngs, MtpModule, m, "unstaged_layers") if m else None

    def _routed(self) -> list[nnx.Module]:
        return [self.blocks.mlp] + ([] if self.mtp is None else [self.mtp.block.mlp])

    def _ahead(self, h_BSD, inputs_BS, positions_BS, segment_ids_BS):
        """The modules in order, scanned: (their final-normed hidden states, one [B,S,D] per
        module; their blocks' aux stacked along [M], as one more routed stack's)."""
        m = self.cfg.deepseek.mtp_num_layers
        if not m:
            return (), []
        e_MBSD = jnp.stack([self.embed(ahead(inputs_BS, d)) for d in range(1, m + 1)])
        graphdef, params = nnx.split(self.mtp)

        def body(h_BSD, xs):
            layer_params, e_BSD = xs
            module = nnx.merge(graphdef, layer_params)
            h_BSD, aux = module(h_BSD, e_BSD, positions_BS, segment_ids_BS)
            return h_BSD, (module.final_norm(h_BSD), aux)

        remat = self.cfg.remat
        if remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
        _, (ahead_MBSD, aux) = jax.lax.scan(body, h_BSD, (params, e_MBSD))
        return tuple(ahead_MBSD), [aux]

    @staticmethod
    def predicts_ahead(cfg: ModelConfig) -> tuple[int, float]:
        ds = cfg.deepseek
        return ds.mtp_num_layers, ds.mtp_loss_weight

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache in the compute dtype: latents [L,B,length,1,R] in `k`, rotary keys
        [L,B,length,1,P] in `v` (zeros; index 0)."""
        c, ds = self.cfg, self.cfg.deepseek
        dtype = DTYPES[c.dtype]
        latents = jnp.zeros((c.num_layers, batch, length, 1, ds.kv_lora_rank), dtype)
        keys = jnp.zeros((c.num_layers, batch, length, 1, ds.qk_rope_head_dim), dtype)
        segment_ids_BT = jnp.zeros((batch, length), jnp.int32)
        return self.constrain_cache(
            KVCache(latents, keys, segment_ids_BT, jnp.zeros((), jnp.int32))
        )

    def constrain_cache(self, cache: KVCache) -> KVCache:
        return KVCache(
            constrain(cache.k, CACHE_LBT1C),
            constrain(cache.v, CACHE_LBT1C),
            constrain(cache.segment_ids, ("batch", None)),
            cache.index,
        )

    def cache_bytes_per_token(self) -> tuple[int, str]:
        """The compressed latent and the rotary key of every layer: (R + P) x layers values."""
        c, ds = self.cfg, self.cfg.deepseek
        itemsize = jnp.dtype(DTYPES[c.dtype]).itemsize
        width = ds.kv_lora_rank + ds.qk_rope_head_dim
        what = (
            f"latent and rotary key, {c.num_layers} layers x ({ds.kv_lora_rank} + "
            f"{ds.qk_rope_head_dim}), {c.dtype}"
        )
        return width * c.num_layers * itemsize, what

    def _attention_params(self) -> int:
        return attention_params(self.cfg)

    def matmul_params(self) -> int:
        """The `moe` family's count with latent attention, plus each multi-token prediction
        module: its projection, latent attention, routed block and pass through the LM head."""
        m = self.cfg
        d = m.d_model
        module = 2 * d * d + attention_params(m) + self._routed_layer_params() + d * m.vocab_size
        return super().matmul_params() + m.deepseek.mtp_num_layers * module

    def auxiliary_params(self) -> int:
        """The multi-token prediction modules' parameters (they share the embedding and head)."""
        if self.mtp is None:
            return 0
        return sum(x.size for x in jax.tree.leaves(nnx.state(self.mtp, nnx.Param)))

    def flops_per_token(self, seq_len: int) -> float:
        """6 N_matmul + causal attention: scores over H = A + P and values over V per head,
        3 x (2 S N H + 2 S N V) / 2 per layer, the modules' included."""
        m, ds = self.cfg, self.cfg.deepseek
        h = ds.qk_nope_head_dim + ds.qk_rope_head_dim
        layers = m.num_layers + ds.mtp_num_layers
        attention = 3.0 * layers * seq_len * m.num_heads * (h + ds.v_head_dim)
        return 6.0 * self.matmul_params() + attention
