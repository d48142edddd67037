"""What the trainer needs of a language model, whichever family implements it.

Einsum letters: B batch, S positions, D d_model, V vocab, P collected layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

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


@jax.custom_vjp
def _head_matmul(hidden: jax.Array, head_DV: jax.Array) -> jax.Array:
    return jnp.einsum("...D,DV->...V", hidden, head_DV, preferred_element_type=jnp.float32)


def _head_matmul_fwd(hidden, head_DV):
    return _head_matmul(hidden, head_DV), (hidden, head_DV)


def _head_matmul_bwd(res, g):
    # Both backward products take the float32 logit gradient in the head's dtype, as the
    # forward takes the hidden states: in bfloat16 the head's three matmuls all run at bf16
    # speed, with float32 accumulation.
    # The products (operand order, output shardings) are autodiff's own, so float32 results
    # are unchanged and explicit-axis meshes know where the gradients go.
    hidden, head_DV = res
    g = g.astype(head_DV.dtype)
    d_head_VD = jnp.einsum(
        "...V,...D->VD",
        g,
        hidden,
        preferred_element_type=jnp.float32,
        out_sharding=_sharding_of(head_DV, transpose=True),
    )
    d_hidden = jnp.einsum(
        "...V,DV->...D",
        g,
        head_DV,
        preferred_element_type=jnp.float32,
        out_sharding=_sharding_of(hidden),
    )
    return d_hidden.astype(hidden.dtype), d_head_VD.T.astype(head_DV.dtype)


def _sharding_of(x: jax.Array, *, transpose: bool = False):
    """x's sharding in its type (dimensions reversed if `transpose`); None without a mesh."""
    sharding = jax.typeof(x).sharding
    if sharding.mesh.empty:
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return sharding.update(spec=P(*(spec[::-1] if transpose else spec)))


_head_matmul.defvjp(_head_matmul_fwd, _head_matmul_bwd)


def _head_logits(hidden: jax.Array, head_DV: jax.Array, softcap: float | None) -> jax.Array:
    """float32 logits [..., V] = hidden [..., D] @ head [D, V] in the head's dtype; cap * tanh(x / cap).

    The matmul runs in the head's dtype with float32 accumulation, forward and backward.
    """
    logits = _head_matmul(hidden.astype(head_DV.dtype), head_DV)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    return logits
