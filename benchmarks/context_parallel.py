"""Context parallelism: keys and values gathered (`all_gather`) against passed around a ring
(`ring`), on 8 simulated CPU devices; JSON.

For each mesh, the attention's value and gradients with respect to q, k and v (sum of
attention x a cotangent) are compiled as `model.attention: xla` runs them: `all_gather` is
`causal_attention` (keys and values gathered once, its tiles skipped under the mask), `ring`
is `ring_attention` (`model.context_parallel: ring`), rows placed for load balance unless
named `in_order`. Per variant:

- `peak_gb` / `temporaries_gb`: the compiled program's `memory_analysis()` per device;
- `collectives`: static bytes and op counts from the compiled HLO (kiln compile's parser);
- `work_max_over_mean` and `critical_path_tile_products` (ring): the (query tile x key half)
  products per shard, max over mean, and those of the busiest shard summed over the hops
  (every hop waits for its slowest shard), by the predicate the ring evaluates (`ring_work`);
- `cpu_seconds`: median wall time of a value-and-gradient call. CPU-only, and not what a
  TPU or GPU would show: the 8 simulated devices share this machine's cores, so a ring hop's
  waiting for its slowest shard does not appear and the collectives are memory copies.

    nice python benchmarks/context_parallel.py [--seq 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
)

import jax
import jax.numpy as jnp

from attention import inputs
from kiln.commands.hlo import collectives
from kiln.config import config_from_dict
from kiln.model.attention import causal_attention, load_balanced, ring_attention, ring_work
from kiln.parallel.mesh import batch_sharding, logical_sharding, make_mesh, use_mesh

MESHES = ({"fsdp": 4, "sequence": 2}, {"fsdp": 2, "sequence": 4}, {"fsdp": 1, "sequence": 8})
VARIANTS = {
    "all_gather": (causal_attention, True),
    "ring": (ring_attention, True),
    "ring_in_order": (ring_attention, False),
}
GB = 1e9


def measure(sizes: dict[str, int], seq: int, fn, balanced: bool, repeats: int) -> dict:
    config = config_from_dict(
        {"mesh": sizes, "data": {"seq_len": seq}, "model": {"max_seq_len": seq}}
    )
    mesh, rules = make_mesh(config), config.mesh.rules
    q, k, v, seg, cot = inputs(sizes["fsdp"], seq, 8, 4, 64)
    heads = logical_sharding(mesh, rules, ("batch", "length", "act_heads", None))
    kv = logical_sharding(mesh, rules, ("batch", "length", "act_kv_heads", None))
    q, cot = jax.device_put(q, heads), jax.device_put(cot, heads)
    k, v = jax.device_put(k, kv), jax.device_put(v, kv)
    seg = jax.device_put(seg, batch_sharding(mesh, rules))

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, seg) * cot)

    with use_mesh(mesh, rules), load_balanced(balanced):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    memory = compiled.memory_analysis()
    times = []
    for _ in range(repeats + 1):  # the first call is a warm-up
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - start)
    coll = collectives(compiled.as_text())
    return {
        "peak_gb": round(memory.peak_memory_in_bytes / GB, 4),
        "temporaries_gb": round(memory.temp_size_in_bytes / GB, 4),
        "collectives": {
            kind: {"ops": c["ops"], "gb": round(c["bytes"] / GB, 4)}
            for kind, c in coll.items()
            if c["ops"]
        },
        "cpu_seconds": round(statistics.median(times[1:]), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = []
    for sizes in MESHES:
        p = sizes["sequence"]
        row = {"mesh": sizes, "seq_len": args.seq, "batch": sizes["fsdp"]}
        for name, (fn, balanced) in VARIANTS.items():
            row[name] = measure(sizes, args.seq, fn, balanced, args.repeats)
            if fn is ring_attention:
                work = ring_work(args.seq, p, balanced=balanced)
                per_shard = work.sum(axis=1)
                row[name]["work_max_over_mean"] = round(
                    float(per_shard.max() / per_shard.mean()), 4
                )
                row[name]["critical_path_tile_products"] = int(work.max(axis=0).sum())
        results.append(row)
    print(json.dumps({"platform": jax.devices()[0].platform, "results": results}, indent=1))


if __name__ == "__main__":
    main()
