"""kiln's whole distillation step against the same step with separate hard and soft loss passes; JSON.

The reference is the distillation objective as it was before the losses shared one pass over
the student's logits: `lm_loss` and `soft_loss_sums`, two tiled calls that each make the
student's chunk logits and their gradients, combined by the balancing coefficients. kiln's
`DistillObjective` makes the hard and soft losses in one pass (`distill_loss_sums`) with one
combined logit gradient per chunk. Both run the same jitted, donated step (teacher forward,
student forward and backward, AdamW) from the same state on the same batches; the losses of
every step are compared.

Shapes: `configs/distill_tiny.yaml` (teacher = `configs/tiny.yaml`'s model, student half as
wide and deep, dynamic balancing, feature loss on two layer pairs), with the vocabulary
scaled to 32768 so the head matters, `loss.num_vocab_tiling=4`, float32, one device (CPU).
Steps are timed in interleaved rounds; medians.

    nice python benchmarks/distill_step.py [--steps 4] [--rounds 3] [key=value overrides]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln import distill, losses, train
from kiln.config import load_config
from kiln.mesh import make_mesh

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHAPE = ["model.vocab_size=32768", "loss.num_vocab_tiling=4", "mesh.fsdp=1"]


class SeparatePasses(distill.DistillObjective):
    """The reference: hard and soft losses as two tiled calls, `c . sums` differentiated."""

    def loss_sums(self, model, batch, coefficients):
        config, dist = self.config, self.config.distillation
        t_hidden, t_feats, t_head = self._teacher_outputs(batch)
        layers = [s for s, _ in dist.layer_map]
        args = (batch["inputs"], batch["positions"], batch["segment_ids"])
        out = model.hidden_states(*args, collect=layers)
        head = model.head_weight()
        hard = train.lm_loss_sums(config, out.hidden, head, batch, self.mesh)
        soft = losses.soft_loss_sums(
            out.hidden,
            head,
            t_hidden,
            t_head,
            batch["targets"],
            batch["weights"],
            temperature=self.knobs["temperature"],
            student_softcap=config.model.logit_softcap,
            teacher_softcap=self.teacher_config.model.logit_softcap,
            num_vocab_tiling=config.loss.num_vocab_tiling,
            vocab_chunk_size=config.loss.vocab_chunk_size,
            mesh=self.mesh,
            rules=config.mesh.rules,
        )
        feature_sum = jnp.zeros((), jnp.float32)
        if layers:
            per_token = losses.feature_loss(model.project(out.features), t_feats, dist.feature_loss)
            feature_sum = jnp.sum(per_token * batch["weights"].astype(jnp.float32))
        sums = {
            "hard_sum": hard["loss_sum"],
            "z_loss_sum": hard["z_loss_sum"],
            "weight_sum": hard["weight_sum"],
            "soft_sum": soft["soft_sum"],
            "teacher_loss_sum": soft["teacher_loss_sum"],
            "feature_sum": feature_sum,
        }
        c = self.coefficients(sums) if coefficients is None else coefficients
        value = c[0] * sums["hard_sum"] + c[1] * sums["soft_sum"] + c[2] * feature_sum
        return value, sums


def batches(config, count: int):
    """`count` global batches of random tokens, one document per row, all weights 1."""
    rng = np.random.default_rng(0)
    g, s = config.train.global_batch_size, config.data.seq_len
    out = []
    for _ in range(count):
        tokens = rng.integers(0, config.model.vocab_size, (g, s + 1), dtype=np.int32)
        out.append(
            {
                "inputs": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (g, s)).copy(),
                "segment_ids": np.ones((g, s), np.int32),
                "weights": np.ones((g, s), np.float32),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    parser.add_argument("overrides", nargs="*", help="student config overrides (a.b=c)")
    a = parser.parse_args()

    teacher_cfg = load_config(CONFIGS / "tiny.yaml", SHAPE)
    config = load_config(CONFIGS / "distill_tiny.yaml", [*SHAPE, *a.overrides])
    mesh = make_mesh(config)
    t_state = train.init_state(teacher_cfg, mesh)
    teacher = distill.Teacher(
        teacher_cfg, Path("."), 0, t_state.graphdef, t_state.params, t_state.rest
    )
    student = distill.init_student(config, mesh, teacher_cfg)
    shardings = train.shardings_of(student)
    objectives = {
        "kiln": distill.DistillObjective.create(config, mesh, teacher),
        "separate_passes": SeparatePasses.create(config, mesh, teacher),
    }
    steps = {name: train.make_step(obj, shardings) for name, obj in objectives.items()}
    data = [train.place_batch(b, mesh, config) for b in batches(config, a.steps)]

    def copy(state):
        return jax.tree.map(jnp.copy, state)

    losses_of, times = {}, {name: [] for name in steps}
    for round_ in range(a.rounds + 1):
        for name, step in steps.items():
            state = copy(student)
            jax.block_until_ready(state)
            start = time.perf_counter()
            trace = []
            for batch in data:
                state, metrics = step(state, batch)
                trace.append(metrics["learning/loss"])
            jax.block_until_ready(state)
            elapsed = time.perf_counter() - start
            if round_:  # round 0 compiles and warms up
                times[name].append(elapsed / a.steps)
            losses_of[name] = [float(x) for x in trace]

    ref, got = np.array(losses_of["separate_passes"]), np.array(losses_of["kiln"])
    kiln_s, ref_s = statistics.median(times["kiln"]), statistics.median(times["separate_passes"])
    print(
        json.dumps(
            {
                "config": "configs/distill_tiny.yaml " + " ".join([*SHAPE, *a.overrides]),
                "teacher": "configs/tiny.yaml " + " ".join(SHAPE),
                "tokens_per_step": config.train.global_batch_size * config.data.seq_len,
                "steps_per_round": a.steps,
                "rounds": a.rounds,
                "kiln_step_seconds": round(kiln_s, 4),
                "separate_passes_step_seconds": round(ref_s, 4),
                "time_ratio": round(kiln_s / ref_s, 4),
                "losses_kiln": got.tolist(),
                "losses_separate_passes": ref.tolist(),
                "loss_max_rel_diff": float(np.max(np.abs(got - ref) / np.abs(ref))),
                "device": str(jax.devices()[0]),
                "device_count": jax.device_count(),
                "jax": jax.__version__,
                "machine": platform.machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
