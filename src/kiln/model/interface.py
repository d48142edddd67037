"""What the trainer needs of a language model, whichever family implements it.

Einsum letters: B batch, S positions, D d_model, V vocab, P collected layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from kiln.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# What a parameter is, declared by the model as the metadata `role` of its `nnx.Param`, so
# optimizers decide per parameter (weight decay, Muon or AdamW) without reading its name.
# A `matrix` also declares `fan_in`: the logical names of the axes it contracts with its input
# (the rest, but the stacked `layers` axis, are its outputs).
ROLES = {
    "matrix": "a hidden weight matrix: attention and MLP projections",
    "embedding": "the token embedding table",
    "head": "the LM head (when not tied to the embedding)",
    "norm": "a normalisation scale",
    "bias": "an additive bias",
    "router": "a Mixture-of-Experts router's weight (AdamW under Muon; decayed like a matrix)",
    "buffer": "a value moved outside the gradient (the aux_free routing bias); its gradient is 0",
    "projection": "a learned map outside the model proper (the distillation feature projection)",
}


class ModelOutput(NamedTuple):
    """hidden [B,S,D] after the final norm (compute dtype); features [P,B,S,D] or None; aux;
    ahead: the multi-token prediction modules' hidden states (after their norms), module d's
    at position i predicting the token d further ahead than `hidden`'s (targets[i + d]) through
    the same LM head; () for a model without them.

    aux: float32 sums over the call's tokens (segment id > 0), keyed by metric tag, which add
    across micro-batches. A scalar is divided by the global count of those tokens (not by the
    loss weights) and logged under its tag;
    one whose tag ends in `_loss` (e.g. `learning/router_z_loss`, already times its weight)
    is also added to the loss, so it gets gradients. An array (e.g. per-layer counts) is a
    statistic that the family's `aux_metrics` turns into scalars, and `update_balance` reads.
    """

    hidden: jax.Array
    features: jax.Array | None
    aux: dict[str, jax.Array]
    ahead: tuple[jax.Array, ...] = ()


class KVCache(NamedTuple):
    """Keys and values of every layer for T slots, filled left to right.

    k, v: [L,B,T,K,H] in the compute dtype; segment_ids [B,T] int32 (0 = empty slot or
    padding, which real tokens never attend to); index: int32 scalar, the next slot to write.
    With sliding-window layers whose window W is shorter than T, `k` and `v` hold the other
    layers only and `local_k`, `local_v` [L_local,B,W,K,H] the sliding layers' last W slots,
    slot t at t mod W (a rolling cache); None otherwise.
    """

    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array
    index: jax.Array
    local_k: jax.Array | None = None
    local_v: jax.Array | None = None


class RollingLayer(NamedTuple):
    """A sliding-window layer's rolling cache as its attention reads it: keys and values
    [B,W,K,H] of the W slots before `index`, ring position j holding slot `slots[j]` (negative:
    never written), with those slots' segment ids [B,W] (0 where never written)."""

    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array
    slots: jax.Array
    index: jax.Array


# The logical names of a KVCache's k and v [L,B,T,K,H], whichever family fills it: rows split
# like the batch, heads like the keys'.
CACHE_LBTKH = (None, "batch", None, "act_kv_heads", None)


class LanguageModel(Protocol):
    """A decoder that ends at hidden states; losses own the head (`head_weight`)."""

    cfg: ModelConfig

    def hidden_states(
        self,
        inputs_BS: jax.Array,
        positions_BS: jax.Array,
        segment_ids_BS: jax.Array,
        *,
        collect: Sequence[int] = (),
    ) -> ModelOutput:
        """Hidden states, plus the residual stream after each block in `collect` (0-based)."""
        ...

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache of `length` slots per row (zeros; index 0)."""
        ...

    def constrain_cache(self, cache: KVCache) -> KVCache:
        """`cache` pinned to the family's layout on the mesh (rows split like the batch), so
        each decode step keeps one sharding."""
        ...

    def cache_bytes_per_token(self) -> tuple[int, str]:
        """(bytes one token's entry of the cache holds, what they are), for `kiln config
        --summary`."""
        ...

    def extend(
        self,
        inputs_BS: jax.Array,
        positions_BS: jax.Array,
        segment_ids_BS: jax.Array,
        cache: KVCache,
        *,
        fresh: bool = False,
    ) -> tuple[jax.Array, KVCache]:
        """Hidden states [B,S,D] of S new tokens written at `cache.index`, and the cache after.

        The new tokens attend to the cache's earlier slots and to each other (causal, same
        segment id). `fresh` (static): the cache is empty, so the tokens attend only to each
        other through the training attention (a prompt's prefill).
        """
        ...

    def head_weight(self, dtype=None) -> jax.Array:
        """LM head [D, V] cast to `dtype` (None = the logits dtype, `model.logits_dtype`)."""
        ...

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] of hidden states [..., D] (soft-capped if configured)."""
        ...

    def diagnostics(self) -> dict[str, jax.Array]:
        """float32 scalars logged every step (`learning/lm_head_norm`, ...)."""
        ...

    def update_balance(self, aux: dict[str, jax.Array]) -> None:
        """After an applied step, move the parameters the optimizer leaves alone (role
        `buffer`) from the step's global aux sums, in place."""
        ...

    @staticmethod
    def aux_metrics(cfg: ModelConfig, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """float32 scalars to log from the global aux sums that are arrays."""
        ...

    @staticmethod
    def predicts_ahead(cfg: ModelConfig) -> tuple[int, float]:
        """(multi-token prediction modules, the weight of the mean of their losses in the
        loss); (0, 0.0) without them."""
        ...

    def auxiliary_params(self) -> int:
        """Parameters trained beside the decoder but not run by generate (multi-token
        prediction modules; 0 if none)."""
        ...

    def matmul_params(self) -> int:
        """Parameters that multiply activations and that one token uses (the 6 N of FLOPs)."""
        ...

    def inactive_params(self) -> int:
        """Parameters one token does not use (routed experts beyond its top-k; 0 if dense)."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at this sequence length."""
        ...


def logits_dtype(cfg: ModelConfig):
    """dtype of the LM head matmul's inputs: `model.logits_dtype`, or the compute dtype."""
    return DTYPES[cfg.logits_dtype or cfg.dtype]
