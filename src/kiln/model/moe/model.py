"""The `moe` family's `LanguageModel`: dense llama blocks, then MoE blocks, and the routing
statistics it logs and balances by."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from kiln.config import ModelConfig
from kiln.errors import KilnError
from kiln.model.llama import Block, Transformer, stacked_blocks
from kiln.model.llama.model import join_layers
from kiln.model.moe.layer import MoeBlock


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

    def _build_stacks(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        """`first_dense_layers` dense blocks (`self.dense_blocks`, None if 0), then the MoE
        blocks (`self.blocks`). The dense stack runs outside pipeline stages (docs/pipeline.md),
        so its layers are never split over them."""
        dense = cfg.moe.first_dense_layers
        self.dense_blocks = (
            stacked_blocks(cfg, rngs, self.dense_block, dense, "unstaged_layers") if dense else None
        )
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
        aux = {k: join_layers([a[k] for a in routed]) for k in (routed[0] if routed else ())}
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
