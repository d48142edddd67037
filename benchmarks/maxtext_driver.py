"""MaxText's own jitted train step, compiled once and timed on request (run under MaxText's venv).

Started by `benchmarks/vs_maxtext.py` as a persistent subprocess, from MaxText's source tree:

    python maxtext_driver.py BATCH.npz BASE_YML key=value ...

It builds the state, mesh and `p_train_step` as MaxText's `train.py` does (`train.initialize`,
`train_utils.setup_train_loop`, `train_utils.jit_train_and_eval_step`), compiles the step on
the batch in BATCH.npz (kiln's keys, renamed to MaxText's), runs step 1, then prints one JSON
line. After that, each stdin line `K` runs K more steps and prints one JSON line of their
times and losses; EOF ends it. Only JSON goes to stdout: everything MaxText prints goes to
stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

# MaxText and absl print to stdout; keep the real stdout for the JSON replies alone.
_REPLY = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def reply(obj) -> None:
    _REPLY.write(json.dumps(obj) + "\n")
    _REPLY.flush()


def plain(value):
    """A config value as JSON: numbers, strings and lists as they are, anything else as text."""
    return value if isinstance(value, bool | int | float | str | list) else str(value)


def count_checkpoints(jaxpr) -> int:
    """`checkpoint` (jax.checkpoint / remat) equations in a jaxpr, nested ones included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in ("checkpoint", "remat2")
        for p in eqn.params.values():
            for q in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(q, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    n += count_checkpoints(inner)
                elif hasattr(q, "eqns"):
                    n += count_checkpoints(q)
    return n


def main() -> None:
    batch_path, base_yml, *overrides = sys.argv[1:]

    import jax
    import numpy as np
    from flax import linen as nn
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    from maxtext.trainers.pre_train import train
    from maxtext.utils import sharding, train_utils

    config, recorder = train.initialize(["maxtext_driver", base_yml, *overrides])
    (init_rng, _, state_mesh_shardings, model, mesh, _, _, _, _, _, state) = (
        train_utils.setup_train_loop(config, recorder)
    )
    # As train.train_loop: the NNX state is split into the graphdef the step closes over.
    if isinstance(model, nn.Module):
        jit_model = model
    else:
        jit_model, state = nnx.split(state)
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_mesh_shardings
    )
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, jit_model, mesh, state, state_mesh_shardings, train.train_step,
        params_shardings=params_shardings,
    )  # fmt: skip

    raw = np.load(batch_path)
    names = {
        "inputs": "inputs",
        "targets": "targets",
        "inputs_position": "positions",
        "inputs_segmentation": "segment_ids",
        "targets_segmentation": "segment_ids",
    }
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    batch = jax.device_put({k: raw[v] for k, v in names.items()}, data_sharding)
    rng_args = (init_rng,) if isinstance(model, nn.Module) else ()

    def run(state, n):
        times, losses = [], []
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
            for _ in range(n):
                t0 = time.perf_counter()
                state, metrics = p_train_step(state, batch, *rng_args)
                loss = float(jax.block_until_ready(metrics["scalar"]["learning/loss"]))
                times.append(time.perf_counter() - t0)
                losses.append(loss)
        return state, times, losses

    with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
        checkpoints = count_checkpoints(jax.make_jaxpr(p_train_step)(state, batch, *rng_args).jaxpr)
    start = time.perf_counter()
    state, _, losses = run(state, 1)  # compiles, then step 1
    reply(
        {
            "ready": True,
            "compile_and_step1_seconds": round(time.perf_counter() - start, 3),
            "step1_loss": losses[0],
            "jax": jax.__version__,
            "devices": jax.device_count(),
            "settings": {
                k: plain(getattr(config, k))
                for k in (
                    "remat_policy", "scan_layers", "num_vocab_tiling", "z_loss_multiplier",
                    "dtype", "weight_dtype", "attention", "pure_nnx", "learning_rate",
                    "warmup_steps_fraction", "learning_rate_final_fraction", "adam_b1",
                    "adam_b2", "adam_eps", "adam_weight_decay", "gradient_clipping_threshold",
                    "adamw_mask", "per_device_batch_size", "max_target_length",
                )
            },
            "checkpoint_ops_in_step_jaxpr": checkpoints,
        },
    )  # fmt: skip
    for line in sys.stdin:
        if not line.strip():
            continue
        state, times, losses = run(state, int(line))
        reply({"times": times, "losses": losses})


if __name__ == "__main__":
    main()
