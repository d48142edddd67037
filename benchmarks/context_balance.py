"""Context load balancing: attention work per sequence shard, in order against zigzag; JSON.

For each mesh, `kiln.model.attention.causal_attention` (what `model.attention: xla` runs) is
compiled as value and gradients of sum(attention) with respect to q, k and v, on 8 simulated
CPU devices, with the rows in order and placed zigzag (`balanced_order`, what the train step
does with `model.context_load_balance` on). Two figures per placement:

- `useful_max_over_mean`: the tile products each shard needs (on or below the diagonal, of its
  own queries), max over mean across shards; every shard computes as many as the busiest
  (the rest are masked padding), so this is the work lost to imbalance.
- `flops_per_device`: XLA's `cost_analysis()` of the compiled program per device, with the
  attention's loop unrolled (XLA counts a loop body once).

    nice python benchmarks/context_balance.py [--seq 4096]
"""

from __future__ import annotations

import argparse
import json
import os
from unittest import mock

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
)

import jax
import jax.numpy as jnp

from attention import _unrolled_map, inputs
from kiln.config import config_from_dict
from kiln.model.attention import QUERY_BLOCK, causal_attention, load_balanced
from kiln.model.attention.xla import _fold_tables
from kiln.parallel.mesh import batch_sharding, logical_sharding, make_mesh, use_mesh

MESHES = ({"fsdp": 4, "sequence": 2}, {"fsdp": 2, "sequence": 4}, {"fsdp": 1, "sequence": 8})


def useful(shards: int, seq: int, balanced: bool) -> float:
    """Max over mean of the unmasked tile products per shard."""
    c = QUERY_BLOCK // (2 * shards)
    _, owner = _fold_tables(shards, seq // shards // c, c, None, balanced)
    per_shard = (owner < 2).sum(axis=(0, 2))
    return float(per_shard.max() / per_shard.mean())


def flops_per_device(mesh_sizes: dict[str, int], seq: int, balanced: bool) -> float:
    config = config_from_dict(
        {"mesh": mesh_sizes, "data": {"seq_len": seq}, "model": {"max_seq_len": seq}}
    )
    mesh, rules = make_mesh(config), config.mesh.rules
    q, k, v, seg, _ = inputs(mesh_sizes["fsdp"], seq, 8, 4, 64)
    q = jax.device_put(q, logical_sharding(mesh, rules, ("batch", "length", "act_heads", None)))
    kv = logical_sharding(mesh, rules, ("batch", "length", "act_kv_heads", None))
    k, v = jax.device_put(k, kv), jax.device_put(v, kv)
    seg = jax.device_put(seg, batch_sharding(mesh, rules))

    def loss(q, k, v):
        return jnp.sum(causal_attention(q, k, v, seg))

    with (
        use_mesh(mesh, rules),
        load_balanced(balanced),
        mock.patch.object(jax.lax, "map", _unrolled_map),
    ):
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return float(grad.lower(q, k, v).compile().cost_analysis()["flops"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    results = []
    for sizes in MESHES:
        p = sizes["sequence"]
        row = {"mesh": sizes, "seq_len": args.seq}
        for name, balanced in (("in_order", False), ("zigzag", True)):
            row[name] = {
                "useful_max_over_mean": round(useful(p, args.seq, balanced), 4),
                "flops_per_device": flops_per_device(sizes, args.seq, balanced),
            }
        row["zigzag_flops_over_in_order"] = round(
            row["zigzag"]["flops_per_device"] / row["in_order"]["flops_per_device"], 4
        )
        results.append(row)
    print(json.dumps({"platform": jax.devices()[0].platform, "results": results}, indent=1))


if __name__ == "__main__":
    main()
