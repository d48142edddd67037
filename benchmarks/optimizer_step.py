"""kiln's train step with each optimizer (optim.name) against the same step with AdamW, in one
process: step time and the optimizer state's bytes.

The model, batch and everything else are `configs/tiny.yaml`'s (4 layers, d 128, vocab 384,
32 x 128 tokens, float32, global-norm clipping, weight decay; the mesh is fsdp over this
machine's devices); only `optim.name` differs. The steps are compiled and warmed up, then timed
in alternating rounds, so every optimizer sees the same machine. Memory is XLA's
`memory_analysis()` of each compiled step (arguments: parameters and optimizer state, donated)
and the optimizer state's bytes per device from its shapes and shardings
(`kiln.model.optimizer_state_bytes`, what `kiln config --summary` prints). Prints JSON.

    python benchmarks/optimizer_step.py [--steps 10] [--rounds 3] [override ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax

from kiln.config import load_config
from kiln.model import optimizer_state_bytes
from kiln.training import train
from kiln.training.batches import place_batch
from kiln.training.optim import make_optimizer
from step_throughput import make_batch  # benchmarks/, the script's own directory

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
OPTIMIZERS = ("adamw", "muon", "adafactor", "lion")


class Arm:
    """One optimizer's compiled train step, its state and batch."""

    def __init__(self, name: str, overrides: list[str]):
        self.config = load_config(CONFIG, [f"optim.name={name}", *overrides])
        c = self.config
        self.state = train.init_state(c)
        mesh = jax.tree.leaves(self.state.params)[0].sharding.mesh
        self.step = train.make_train_step(c, mesh, train.shardings_of(self.state))
        raw = make_batch(c.train.global_batch_size, c.data.seq_len, c.model.vocab_size)
        self.batch = place_batch(raw, mesh, c)
        compiled = self.step.lower(self.state, self.batch).compile()
        self.memory = compiled.memory_analysis()
        self.state_bytes = optimizer_state_bytes(c, make_optimizer(c.optim).init, dict(mesh.shape))

    def run(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and arm")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("overrides", nargs="*", help="a.b=c overrides of configs/tiny.yaml")
    args = parser.parse_args()

    arms = {name: Arm(name, args.overrides) for name in OPTIMIZERS}
    for arm in arms.values():
        arm.run(2)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            times[name] += arm.run(args.steps)

    adamw = statistics.median(times["adamw"])
    c = arms["adamw"].config
    results = {}
    for name, arm in arms.items():
        seconds = statistics.median(times[name])
        m = arm.memory
        results[name] = {
            "step_seconds": round(seconds, 5),
            "step_time_over_adamw": round(seconds / adamw, 4),
            "optimizer_state_bytes_per_device": arm.state_bytes,
            "compiled_argument_bytes": m.argument_size_in_bytes,
            "compiled_temp_bytes": m.temp_size_in_bytes,
        }
    print(
        json.dumps(
            {
                "benchmark": "optimizer_step",
                "config": "configs/tiny.yaml",
                "overrides": args.overrides,
                "batch": {
                    "global_batch_size": c.train.global_batch_size,
                    "seq_len": c.data.seq_len,
                },
                "devices": jax.device_count(),
                "timed_steps_each": args.steps * args.rounds,
                "optimizers": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
