"""What each `model.remat` policy costs: temporary bytes of the compiled train step (XLA's
`memory_analysis()`), against no remat in the same process, and optionally the step time.
Prints JSON.

    python benchmarks/remat_memory.py [--layers 4,16] [--seq 64] [--d-model 64] [--steps 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import typing

import jax
import numpy as np
from flax import nnx

from kiln.config import MESH_AXES, config_from_dict
from kiln.config.schema import ModelConfig
from kiln.model.llama import Transformer
from kiln.training import train
from kiln.training.batches import place_batch

POLICIES = typing.get_args(ModelConfig.model_fields["remat"].annotation)
BATCH, VOCAB = 8, 128


def make_config(remat: str, layers: int, seq: int, d_model: int):
    model = {
        "vocab_size": VOCAB, "d_model": d_model, "num_layers": layers, "num_heads": 4,
        "num_kv_heads": 2, "d_ff": 4 * d_model, "max_seq_len": seq, "remat": remat,
    }  # fmt: skip
    return config_from_dict(
        {
            "model": model,
            "mesh": {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1},
            "data": {"seq_len": seq},
            "train": {"global_batch_size": BATCH},
        }
    )


def measure(remat, state, mesh, layers, seq, d_model, steps):
    """(temp bytes, host temp bytes, compile seconds, median step seconds or None)."""
    config = make_config(remat, layers, seq, d_model)
    model = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
    state = state.replace(graphdef=nnx.split(model, nnx.Param, ...)[0])  # remat is in it
    step = train.make_train_step(config, mesh, train.shardings_of(state))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, seq + 1), dtype=np.int32)
    batch = place_batch(
        {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (BATCH, seq)),
            "segment_ids": np.ones((BATCH, seq), np.int32),
            "weights": np.ones((BATCH, seq), np.float32),
        },
        mesh,
        config,
    )
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    stats = compiled.memory_analysis()
    times = []
    if steps:
        state = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
        for _ in range(steps + 1):  # the first call also warms the caches
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[1:]) if steps else None
    return stats.temp_size_in_bytes, stats.host_temp_size_in_bytes, compile_s, step_s


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", default="4,16", help="comma-separated layer counts")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--steps", type=int, default=0, help="timed steps per policy; 0 = none")
    args = parser.parse_args()
    mesh = jax.make_mesh(
        (1,) * len(MESH_AXES),
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
        devices=jax.devices()[:1],
    )
    out = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "batch": BATCH,
        "seq": args.seq,
        "d_model": args.d_model,
        "d_ff": 4 * args.d_model,
        "results": {},
    }
    for layers in (int(x) for x in args.layers.split(",")):
        state = train.init_state(make_config("none", layers, args.seq, args.d_model), mesh)
        rows = {}
        for remat in POLICIES:
            temp, host, compile_s, step_s = measure(
                remat, state, mesh, layers, args.seq, args.d_model, args.steps
            )
            rows[remat] = {"temp_bytes": temp, "host_temp_bytes": host}
            rows[remat]["compile_seconds"] = round(compile_s, 2)
            if step_s is not None:
                rows[remat]["step_seconds"] = round(step_s, 4)
        for row in rows.values():
            row["temp_over_none"] = round(row["temp_bytes"] / rows["none"]["temp_bytes"], 3)
        out["results"][f"layers_{layers}"] = rows
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
