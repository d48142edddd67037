"""Causal block skipping vs kiln's dense attention: fwd+bwd time, compiled FLOPs, equality; JSON.

For each sequence length, both paths (`kiln.model.attention.causal_attention`, which
`model.attention: xla` runs, and `dense_attention`, kiln's attention before skipping) are
compiled as value and gradients of sum(attention * cotangent) with respect to q, k and v,
float32, grouped-query, two packed documents per row. FLOPs are XLA's `cost_analysis()` of the
compiled programs. XLA counts a loop body once, and both paths loop over their query blocks
(`lax.map`), so FLOPs are taken from a second compile of each function with that map unrolled
(`*_flops`; `*_flops_loop_counted_once` are the looped programs' own figures). Temporary
bytes are `memory_analysis()` of the programs that are timed. Times are medians of
interleaved rounds.

    nice python benchmarks/attention.py [--seq 4096 8192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from kiln.model.attention import causal_attention, dense_attention


def _unrolled_map(f, xs):
    """`lax.map` as a Python loop, so that XLA's cost analysis sees every iteration."""
    n = jax.tree.leaves(xs)[0].shape[0]
    outs = [f(jax.tree.map(lambda x, i=i: x[i], xs)) for i in range(n)]
    return jax.tree.map(lambda *ys: jnp.stack(ys), *outs)


def inputs(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int):
    """q, k, v, segment ids (two documents per row, the second at 40%) and a cotangent."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.float32)
    seg = jnp.where(jnp.arange(seq) < int(0.4 * seq), 1, 2).astype(jnp.int32)
    cot = jax.random.normal(kc, (batch, seq, heads, head_dim), jnp.float32)
    return q, k, v, jnp.broadcast_to(seg, (batch, seq)), cot


def compile_grad(fn, q, k, v, seg, cot):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, seg) * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def run(compiled, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def measure(seq: int, a) -> dict:
    q, k, v, seg, cot = inputs(a.batch, seq, a.heads, a.kv_heads, a.head_dim)
    dense = compile_grad(dense_attention, q, k, v, seg, cot)
    skip = compile_grad(causal_attention, q, k, v, seg, cot)
    with mock.patch.object(jax.lax, "map", _unrolled_map):
        dense_unrolled = compile_grad(dense_attention, q, k, v, seg, cot)
        skip_unrolled = compile_grad(causal_attention, q, k, v, seg, cot)
    args = (q, k, v)
    # Outputs and gradients compared (the scalar loss is a sum with cancellation).
    out_want = jax.jit(dense_attention)(q, k, v, seg)
    out_got = jax.jit(causal_attention)(q, k, v, seg)
    (_, want), (_, got) = dense(*args), skip(*args)
    errors = [rel_err(g, w) for g, w in zip((out_got, *got), (out_want, *want))]
    for compiled in (dense, skip):  # warm-up
        run(compiled, args)
    times = {"dense": [], "xla": []}
    for _ in range(a.rounds):
        times["dense"].append(run(dense, args))
        times["xla"].append(run(skip, args))
    dense_s, skip_s = (statistics.median(times[n]) for n in ("dense", "xla"))
    dense_flops = dense_unrolled.cost_analysis()["flops"]
    skip_flops = skip_unrolled.cost_analysis()["flops"]
    return {
        "seq": seq,
        "dense_seconds": round(dense_s, 4),
        "xla_seconds": round(skip_s, 4),
        "speedup": round(dense_s / skip_s, 3),
        "dense_flops": dense_flops,
        "dense_flops_loop_counted_once": dense.cost_analysis()["flops"],
        "xla_flops": skip_flops,
        "xla_flops_loop_counted_once": skip.cost_analysis()["flops"],
        "flops_ratio": round(skip_flops / dense_flops, 4),
        "dense_temp_bytes": dense.memory_analysis().temp_size_in_bytes,
        "xla_temp_bytes": skip.memory_analysis().temp_size_in_bytes,
        "max_rel_err_output_and_grads": max(errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    a = parser.parse_args()
    results = [measure(seq, a) for seq in a.seq]
    print(
        json.dumps(
            {
                "benchmark": "attention",
                "device": jax.devices()[0].device_kind,
                "machine": platform.machine(),
                "jax": jax.__version__,
                "settings": {
                    "batch": a.batch,
                    "heads": a.heads,
                    "kv_heads": a.kv_heads,
                    "head_dim": a.head_dim,
                    "dtype": "float32",
                    "rounds": a.rounds,
                },
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
