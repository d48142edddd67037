"""The router: each token's top-k experts and their gates, from float32 scores.

Einsum letters as in `kiln.model.moe`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(x_BSD, router_DE, bias_E, moe, router_bias_E=None):
    """(experts [B,S,K] int32, gates [B,S,K], probabilities [B,S,E], logits [B,S,E]), float32.

    logits = x W_router, plus `router_bias_E` (a learned bias, GPT-OSS's) when given; scores =
    softmax(logits), or sigmoid(logits) with `moe.score: sigmoid`; the top
    `moe.experts_per_token` of scores + bias choose the experts (`bias_E` None = no bias),
    within the `moe.topk_group` best of `moe.n_group` groups (a group's worth: the sum of its
    two best biased scores), and the unbiased scores of the chosen ones are their gates (how
    much each expert's output counts), divided by their sum if `moe.norm_topk_prob`, times
    `moe.routed_scaling_factor`. probabilities: the scores (sigmoid ones normalised over the
    experts), for the load-balance loss.
    """
    logits_BSE = jnp.einsum("BSD,DE->BSE", x_BSD.astype(jnp.float32), router_DE.astype(jnp.float32))
    if router_bias_E is not None:
        logits_BSE = logits_BSE + router_bias_E.astype(jnp.float32)
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
    gates_BSK = jnp.take_along_axis(scores_BSE, experts_BSK, axis=-1)
    if moe.norm_topk_prob:
        total_BS1 = jnp.sum(gates_BSK, axis=-1, keepdims=True)
        gates_BSK = gates_BSK / (total_BS1 + 1e-20 if sigmoid else total_BS1)
    if moe.routed_scaling_factor != 1.0:
        gates_BSK = gates_BSK * moe.routed_scaling_factor
    return experts_BSK.astype(jnp.int32), gates_BSK, probs_BSE, logits_BSE


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
