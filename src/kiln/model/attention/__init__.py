"""Attention implementations behind one signature, picked by `model.attention` per platform.

Every implementation is `fn(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS) -> out_BSNH`: causal
self-attention that stays inside each packed document (equal segment ids; padding is segment
0 and attends only to padding), grouped-query (query head n reads key/value head n // G),
softmax(q k^T / sqrt(H)) v with float32 scores. Values may be narrower than queries and keys
(multi-head latent attention): the output has the values' width. Einsum letters as in
`kiln.model.llama`, plus R = C*G query rows of one key/value head and P sequence shards.

Two keyword arguments change the mask and the softmax, each None for plain attention:
`window` W (sliding-window attention, a static int): a query at position i sees the keys at
i-W+1..i only (Hugging Face's `sliding_window`); `sinks_N` [N] float32 (attention sinks, as
GPT-OSS): one learned logit per query head that joins every row's softmax denominator without
a value (exp(sink) / (sum + exp(sink)) of the weight goes nowhere).

Modules: `xla` (kiln's own: dense, cached and tile-skipping causal attention, context load
balance), `ring` (ring attention over the sequence shards), `kernels` (cuDNN and Pallas splash,
and the platform check). `IMPLEMENTATIONS` names them for `model.attention`; `attention` is
the one call the models make.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from kiln.errors import KilnError
from kiln.model.attention.kernels import (
    HALF,
    check,
    cudnn_arguments,
    cudnn_attention,
    splash_attention,
)
from kiln.model.attention.ring import ring_attention, ring_work
from kiln.model.attention.xla import (
    QUERY_BLOCK,
    balanced_order,
    cached_attention,
    causal_attention,
    dense_attention,
    load_balanced,
    rows_balanced,
    sequence_shards,
)
from kiln.parallel.mesh import traced_platform

IMPLEMENTATIONS = {
    "xla": causal_attention,
    "cudnn": cudnn_attention,
    "splash": splash_attention,
}
# What `auto` picks per platform; a GPU falls back to `xla` unless the compute dtype is
# bf16/fp16 (cuDNN's fused attention has no float32 kernel).
AUTO = {"tpu": "splash", "gpu": "cudnn", "cpu": "xla"}


def resolve(name: str, dtype) -> str:
    """The implementation `model.attention=name` runs for `dtype` activations on this platform."""
    if name != "auto":
        return name
    chosen = AUTO.get(traced_platform(), "xla")
    if chosen == "cudnn" and jnp.dtype(dtype) not in HALF:
        return "xla"
    return chosen


def attention(
    q_BSNH,
    k_BTKH,
    v_BTKH,
    segment_ids_BS,
    *,
    implementation: str = "auto",
    context: str = "all_gather",
    window: int | None = None,
    sinks_N=None,
):
    """Causal, same-document, grouped-query attention by `implementation` (a `model.attention`),
    within a sliding `window` and with attention sinks when given (module docstring). On a
    sequence-sharded mesh, `context` (`model.context_parallel`) says how every shard's queries
    reach all keys: `all_gather` (gathered once per layer, then `implementation`) or `ring`
    (`ring_attention`, kiln's own blocks whatever the platform).

    Values narrower than the queries go through `xla` as they are; the fused kernels (splash,
    cuDNN) take one head width, so they get the values zero-padded to it and the output is
    cut back (the padded columns of the output are exactly 0).
    """
    p = sequence_shards()
    if context == "ring" and p > 1:
        return ring_attention(
            q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, window=window, sinks_N=sinks_N
        )
    name = resolve(implementation, q_BSNH.dtype)
    h, hv = q_BSNH.shape[-1], v_BTKH.shape[-1]
    fn = functools.partial(IMPLEMENTATIONS[name], window=window, sinks_N=sinks_N)
    if name == "cudnn" and p > 1 and rows_balanced():
        # cuDNN sees the whole sequence in order: rows back in order for it (splash places
        # the rows of a balanced shard itself).
        order = balanced_order(q_BSNH.shape[1], p)
        back, kernel = np.argsort(order), fn

        def fn(q, k, v, seg):
            q, k, v, seg = (jnp.take(x, back, axis=1) for x in (q, k, v, seg))
            return jnp.take(kernel(q, k, v, seg), order, axis=1)

    if name == "xla" or hv == h:
        return fn(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS)
    if hv > h:
        raise KilnError(
            f"model.attention: {name!r} needs values no wider than queries, got {hv} > {h}; "
            "use 'xla'"
        )
    v_BTKH = jnp.pad(v_BTKH, ((0, 0), (0, 0), (0, 0), (0, h - hv)))
    return fn(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS)[..., :hv]


__all__ = [
    "AUTO",
    "IMPLEMENTATIONS",
    "QUERY_BLOCK",
    "attention",
    "balanced_order",
    "cached_attention",
    "causal_attention",
    "check",
    "cudnn_arguments",
    "cudnn_attention",
    "dense_attention",
    "load_balanced",
    "resolve",
    "ring_attention",
    "ring_work",
    "sequence_shards",
    "splash_attention",
]
