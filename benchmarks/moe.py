"""kiln's MoE in one process: the layer's dropless grouped matmuls against a dense one-hot
dispatch of the same layer, and `configs/moe_tiny.yaml`'s train step against
`configs/tiny.yaml`'s (equal active parameters). Prints JSON.

Layer (`layer`): moe_tiny's MoE MLP (d 128, 8 experts, top-2, d_ff_expert 176,
norm_topk_prob) on moe_tiny's batch (32 x 128 tokens), float32, forward and backward
(`value_and_grad` of sum(output * cotangent) with respect to the input, the router and the
three expert weights). kiln's side is `kiln.model.moe.route` + `routed` with
`grouped_matmul` `blocked` (what `auto` runs on CPU) and `ragged_dot` (what it runs on TPU
and GPU); the reference is GShard's dense dispatch written here: one-hot dispatch and combine
tensors [groups, tokens, experts, capacity] (a group = a row of the batch) with capacity =
the group's tokens, so nothing is dropped, and every expert multiplies its whole capacity,
used or not. Same inputs and weights; the largest difference of the output and the five
gradients relative to the reference's largest value; XLA's FLOPs (`cost_analysis()`) and
temporary bytes (`memory_analysis()`) of each compiled program; median wall and CPU seconds
per call over interleaved rounds. With libtpu installed, the three are also compiled ahead of
time for one chip of `--tpu-topology` (no TPU needed): temporary bytes and whether the
ragged dots became TPU kernels. Nothing is timed on a TPU.

Step (`step`): kiln's jitted train step of each config on the same random batch, compiled
and warmed up, timed in alternating rounds; median wall and CPU seconds, tokens/s and the
compiled step's temporary bytes. Target (kiln issue 34): the MoE step at most 1.5x the dense
step on CPU.

    nice python benchmarks/moe.py [--steps 5] [--rounds 3] [--calls 5] [--tpu-topology v5p-8]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln.config import MESH_AXES, load_config
from kiln.model import abstract_model, state_size
from kiln.model.moe import route, routed
from kiln.parallel.mesh import use_mesh
from kiln.training import train
from kiln.training.batches import place_batch
from step_throughput import make_batch  # benchmarks/, the script's own directory

# A ragged dot lowered for TPU: `%ragged-dot... = ... custom-call(...)` in the compiled HLO
# (Mosaic kernels and their metadata call).
RAGGED_KERNEL = re.compile(r"^\s*%ragged-dot\S* = .*custom-call\(", re.M)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TARGET = 1.5  # issue 34: MoE step / dense step of equal active parameters, CPU


# ---------------------------------------------------------------------------------------------
# The layer


def layer_inputs(d: int, e: int, f: int, batch: int, seq: int):
    """x [B,S,D], router [D,E] (unit-scale logits, so routing varies), w_gate/w_up [E,D,F],
    w_down [E,F,D], cotangent [B,S,D]; float32."""
    ks = jax.random.split(jax.random.key(0), 6)
    n = jax.random.normal
    return (
        n(ks[0], (batch, seq, d), jnp.float32),
        n(ks[1], (d, e), jnp.float32) / np.sqrt(d),
        n(ks[2], (e, d, f), jnp.float32) / np.sqrt(d),
        n(ks[3], (e, d, f), jnp.float32) / np.sqrt(d),
        n(ks[4], (e, f, d), jnp.float32) / np.sqrt(f),
        n(ks[5], (batch, seq, d), jnp.float32),
    )


def kiln_layer(moe):
    """kiln's MoE MLP without shared experts: route, then the dropless grouped matmuls."""

    def layer(x, router, w_gate, w_up, w_down):
        experts, gates, _, _ = route(x, router, None, moe)
        real = jnp.ones(x.shape[:2], jnp.bool_)
        y, _ = routed(x, experts, gates, real, (w_gate, w_up, w_down), moe, jnp.float32)
        return y

    return layer


def dense_dispatch_layer(k: int, norm_topk_prob: bool):
    """GShard's einsum dispatch with one-hot dispatch/combine tensors, capacity = all tokens of
    a group (a batch row): every token reaches its experts, every expert computes S rows."""

    def layer(x_GSD, router_DE, w_gate, w_up, w_down):
        g, s, _ = x_GSD.shape
        e = router_DE.shape[-1]
        probs = jax.nn.softmax(jnp.einsum("GSD,DE->GSE", x_GSD, router_DE), axis=-1)
        _, experts_GSK = jax.lax.top_k(probs, k)
        weights_GSK = jnp.take_along_axis(probs, experts_GSK, axis=-1)
        if norm_topk_prob:
            weights_GSK = weights_GSK / jnp.sum(weights_GSK, axis=-1, keepdims=True)
        mask_GSKE = jax.nn.one_hot(experts_GSK, e, dtype=jnp.float32)
        # Position in the expert's buffer: first choices before second ones, then token order.
        mask_GKSE = mask_GSKE.transpose(0, 2, 1, 3).reshape(g, k * s, e)
        slot_GKSE = (jnp.cumsum(mask_GKSE, axis=1) - 1).reshape(g, k, s, e)
        slot_GSKE = slot_GKSE.transpose(0, 2, 1, 3).astype(jnp.int32)
        slot_GSKEC = jax.nn.one_hot(slot_GSKE, s, dtype=jnp.float32) * mask_GSKE[..., None]
        dispatch_GSEC = jnp.sum(slot_GSKEC, axis=2)
        combine_GSEC = jnp.einsum("GSKEC,GSK->GSEC", slot_GSKEC, weights_GSK)
        x_EGCD = jnp.einsum("GSEC,GSD->EGCD", dispatch_GSEC, x_GSD)
        gate = jnp.einsum("EGCD,EDF->EGCF", x_EGCD, w_gate)
        up = jnp.einsum("EGCD,EDF->EGCF", x_EGCD, w_up)
        y_EGCD = jnp.einsum("EGCF,EFD->EGCD", jax.nn.silu(gate) * up, w_down)
        return jnp.einsum("GSEC,EGCD->GSD", combine_GSEC, y_EGCD)

    return layer


def compile_grad(layer, args, cot):
    def loss(*params):
        return jnp.sum(layer(*params) * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=range(len(args)))).lower(*args).compile()


def tpu_compiles(layers, args, cot, topology: str) -> dict:
    """Each layer's fwd+bwd compiled ahead of time for one chip of a TPU slice (libtpu's
    compiler, no TPU): temporary bytes and the custom calls named ragged-dot in
    the compiled HLO. Empty without libtpu."""
    if importlib.util.find_spec("libtpu") is None:
        return {}
    from kiln.commands.compile import topology_devices

    device = topology_devices(topology)[0]
    mesh = jax.sharding.Mesh(np.array([device]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args]
    cot_shape = jax.ShapeDtypeStruct(cot.shape, cot.dtype, sharding=replicated)
    out = {}
    for name, layer in layers.items():

        def loss(*params, layer=layer):
            return jnp.sum(layer(*params[:-1]) * params[-1])

        with use_mesh(mesh):
            grad = jax.jit(jax.value_and_grad(loss, argnums=range(len(args))))
            compiled = grad.lower(*shapes, cot_shape).compile()
        out[name] = {
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "ragged_dot_custom_calls": len(RAGGED_KERNEL.findall(compiled.as_text())),
        }
    return {"topology": topology, "device": device.device_kind, "results": out}


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call, waited for."""
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - wall, time.process_time() - cpu


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def run_layer(moe, batch: int, seq: int, d: int, a) -> dict:
    *args, cot = layer_inputs(d, moe.num_experts, moe.d_ff_expert, batch, seq)
    layers = {
        "dense_dispatch": dense_dispatch_layer(moe.experts_per_token, moe.norm_topk_prob),
        "blocked": kiln_layer(moe.model_copy(update={"grouped_matmul": "blocked"})),
        "ragged_dot": kiln_layer(moe.model_copy(update={"grouped_matmul": "ragged_dot"})),
    }
    compiled = {name: compile_grad(layer, args, cot) for name, layer in layers.items()}
    outputs = {name: jax.jit(layer)(*args) for name, layer in layers.items()}
    grads = {name: c(*args)[1] for name, c in compiled.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in compiled}
    for _ in range(a.rounds):
        for name, c in compiled.items():
            for _ in range(a.calls):
                times[name].append(timed(lambda c=c: c(*args)))
    ref = "dense_dispatch"
    results = {}
    for name, c in compiled.items():
        errors = [rel_err(outputs[name], outputs[ref])]
        errors += [rel_err(g, w) for g, w in zip(grads[name], grads[ref], strict=True)]
        results[name] = {
            "fwd_bwd_seconds": round(statistics.median(t for t, _ in times[name]), 5),
            "fwd_bwd_cpu_seconds": round(statistics.median(c for _, c in times[name]), 5),
            "flops": c.cost_analysis()["flops"],
            "temp_bytes": c.memory_analysis().temp_size_in_bytes,
            "max_rel_diff_output_and_grads_vs_dense_dispatch": float(f"{max(errors):.3g}"),
        }
    for r in results.values():
        for key in ("fwd_bwd_seconds", "fwd_bwd_cpu_seconds"):
            r[f"{key}_over_dense_dispatch"] = round(r[key] / results[ref][key], 4)
    tpu = tpu_compiles(layers, args, cot, a.tpu_topology) if a.tpu_topology else {}
    return results, tpu


# ---------------------------------------------------------------------------------------------
# The train step


class Arm:
    """One config's compiled train step, its state and the shared batch."""

    def __init__(self, config_name: str, raw_batch):
        self.config = c = load_config(CONFIGS / config_name, [])
        self.state = train.init_state(c)
        mesh = jax.tree.leaves(self.state.params)[0].sharding.mesh
        self.step = train.make_train_step(c, mesh, train.shardings_of(self.state))
        self.batch = place_batch(raw_batch, mesh, c)
        self.memory = self.step.lower(self.state, self.batch).compile().memory_analysis()

    def run(self, n: int) -> list[tuple[float, float]]:
        return [timed(self._step) for _ in range(n)]

    def _step(self):
        self.state, metrics = self.step(self.state, self.batch)
        return metrics


def run_step(steps: int, rounds: int) -> dict:
    dense_cfg = load_config(CONFIGS / "tiny.yaml", [])
    c = dense_cfg
    raw = make_batch(c.train.global_batch_size, c.data.seq_len, c.model.vocab_size)
    arms = {"moe_tiny": Arm("moe_tiny.yaml", raw), "tiny": Arm("tiny.yaml", raw)}
    for arm in arms.values():
        arm.run(2)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            times[name] += arm.run(steps)
    tokens = c.train.global_batch_size * c.data.seq_len
    out = {}
    for name, arm in arms.items():
        seconds = statistics.median(t for t, _ in times[name])
        m = arm.config.model
        out[name] = {
            "config": f"configs/{name}.yaml",
            "parameters": state_size(arm.config, arm.config.mesh.sizes(1))[0],
            "active_matmul_parameters": abstract_model(m).matmul_params(),
            "step_seconds": round(seconds, 5),
            "tokens_per_sec": round(tokens / seconds, 1),
            "step_cpu_seconds": round(statistics.median(c for _, c in times[name]), 5),
            "compiled_temp_bytes": arm.memory.temp_size_in_bytes,
        }
    ratio = out["moe_tiny"]["step_seconds"] / out["tiny"]["step_seconds"]
    out["moe_over_dense_step_time"] = round(ratio, 4)
    cpu_ratio = out["moe_tiny"]["step_cpu_seconds"] / out["tiny"]["step_cpu_seconds"]
    out["moe_over_dense_step_cpu_time"] = round(cpu_ratio, 4)
    out["target_moe_over_dense_at_most"] = TARGET
    out["target_met"] = ratio <= TARGET
    out["timed_steps_each"] = steps * rounds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed train steps per round and arm")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--calls", type=int, default=5, help="timed layer calls per round")
    parser.add_argument(
        "--tpu-topology",
        default="v5p-8",
        help="also compile the layers for one chip of this TPU slice (libtpu; '' = skip)",
    )
    args = parser.parse_args()

    moe_cfg = load_config(CONFIGS / "moe_tiny.yaml", [])
    m, moe = moe_cfg.model, moe_cfg.model.moe
    batch, seq = moe_cfg.train.global_batch_size, moe_cfg.data.seq_len
    layer, tpu = run_layer(moe, batch, seq, m.d_model, args)
    step = run_step(args.steps, args.rounds)
    print(
        json.dumps(
            {
                "benchmark": "moe",
                "platform": jax.default_backend(),
                "device": jax.devices()[0].device_kind,
                "devices": jax.device_count(),
                "machine": platform.machine(),
                "jax": jax.__version__,
                "dtype": "float32",
                "layer": {
                    "shape": {
                        "tokens": f"{batch} x {seq}",
                        "d_model": m.d_model,
                        "num_experts": moe.num_experts,
                        "experts_per_token": moe.experts_per_token,
                        "d_ff_expert": moe.d_ff_expert,
                    },
                    "timed_calls_each": args.rounds * args.calls,
                    "results": layer,
                    "tpu_aot_compile": tpu or None,
                },
                "step": step,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
