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


class ModelOutput(NamedTuple):
    """hidden [B,S,D] after the final norm (compute dtype); features [P,B,S,D] or None; aux terms."""

    hidden: jax.Array
    features: jax.Array | None
    aux: dict[str, jax.Array]


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

    def head_weight(self, dtype=None) -> jax.Array:
        """LM head [D, V] cast to `dtype` (None = the logits dtype, `model.logits_dtype`)."""
        ...

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] of hidden states [..., D] (soft-capped if configured)."""
        ...

    def diagnostics(self) -> dict[str, jax.Array]:
        """float32 scalars logged every step (`learning/lm_head_norm`, ...)."""
        ...

    def matmul_params(self) -> int:
        """Parameters that multiply activations (what 6 N of the FLOPs counts)."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at this sequence length."""
        ...


def logits_dtype(cfg: ModelConfig):
    """dtype of the LM head matmul's inputs: `model.logits_dtype`, or the compute dtype."""
    return DTYPES[cfg.logits_dtype or cfg.dtype]


def _f32_matmul(hidden: jax.Array, head_DV: jax.Array) -> jax.Array:
    return jnp.einsum("...D,DV->...V", hidden, head_DV, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _low_precision_matmul(hidden: jax.Array, head_DV: jax.Array) -> jax.Array:
    return _f32_matmul(hidden, head_DV)


def _low_precision_matmul_fwd(hidden, head_DV):
    return _f32_matmul(hidden, head_DV), (hidden, head_DV)


def _low_precision_matmul_bwd(res, g):
    # Autodiff would multiply the float32 logit gradient with the bf16 operands, i.e. run
    # both backward products in float32; cast it to the head's dtype first, as the forward
    # casts the hidden states, so all three products run in bf16 with float32 accumulation.
    # d head is contracted straight into [D, V] (no transpose after the product: XLA's CPU
    # backend cannot run the bf16 x bf16 -> f32 dot it folds that transpose into), in the
    # output shardings autodiff would give, so explicit-axis meshes know where they go.
    hidden, head_DV = res
    g = g.astype(head_DV.dtype)
    f32 = jnp.float32
    d_head = jnp.einsum(
        "...D,...V->DV", hidden, g, preferred_element_type=f32, out_sharding=_sharding(head_DV)
    )
    d_hidden = jnp.einsum(
        "...V,DV->...D", g, head_DV, preferred_element_type=f32, out_sharding=_sharding(hidden)
    )
    return d_hidden.astype(hidden.dtype), d_head.astype(head_DV.dtype)


def _sharding(x: jax.Array):
    """x's sharding as its type carries it (None without a mesh)."""
    sharding = jax.typeof(x).sharding
    return None if sharding.mesh.empty else sharding


_low_precision_matmul.defvjp(_low_precision_matmul_fwd, _low_precision_matmul_bwd)


def _head_logits(hidden: jax.Array, head_DV: jax.Array, softcap: float | None) -> jax.Array:
    """float32 logits [..., V] = hidden [..., D] @ head [D, V]; cap * tanh(x / cap) if capped.

    The matmul runs in the head's dtype with float32 accumulation, forward and backward. A
    float32 head is plain autodiff (its backward products are float32 already).
    """
    hidden = hidden.astype(head_DV.dtype)
    if head_DV.dtype == jnp.float32:
        logits = _f32_matmul(hidden, head_DV)
    else:
        logits = _low_precision_matmul(hidden, head_DV)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    return logits
