"""Offline distillation (the teacher's stored top-k logits) against online (the teacher's forward
pass in every step): the student's step time and compiled memory, and the store's cost; JSON.

Student: `configs/distill_tiny.yaml`'s model (width 64, 2 blocks) without the feature loss
(offline has no teacher hidden states), vocabulary 16384, `loss.num_vocab_tiling=4`, float32.
Teacher: 4x the student's width (256, 4 blocks, d_ff 704), randomly initialised (the step's cost
does not depend on what it learned). Both steps are kiln's jitted, donated `make_step` of the
`DistillObjective` (online with the teacher's parameters as arguments; offline with
`distillation.teacher_logits_dir` set and the teacher's top-k, made once by the teacher outside
the timed steps, in each batch), from the same student state on the same token batches.
Steps are timed in interleaved rounds; medians of wall-clock and of the process's CPU seconds.
Memory is XLA's `memory_analysis()` of each compiled step (per device; on CPU the peak is
arguments + outputs + temporaries - aliased, as `kiln compile` reports it).

Storage per token of a store: K values (bf16: 2 bytes, f32: 4) + K int32 ids + one f32 lse.

    nice python benchmarks/distill_offline.py [--steps 3] [--rounds 2] [--top-k 64] [a.b=c ...]
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

# Run as a script from benchmarks/: its sibling's random batches serve this benchmark too.
from distill_step import batches
from kiln import losses
from kiln.commands.compile import memory_figures
from kiln.config import load_config
from kiln.distill import online as distill
from kiln.parallel.mesh import make_mesh
from kiln.training import train
from kiln.training.batches import place_batch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHAPE = [
    "model.vocab_size=16384",
    "loss.num_vocab_tiling=4",
    "mesh.fsdp=1",
    "train.global_batch_size=16",
    "distillation.layer_map=[]",
    "distillation.beta=0.0",
]
TEACHER = ["model.d_model=256", "model.num_heads=8", "model.num_layers=4", "model.d_ff=704"]


def stored_top_k(teacher: distill.Teacher, batch, k: int, temperature: float):
    """The batch keys `kiln teacher-logits` provides: the teacher's top-k and lse(logits / T)."""

    @jax.jit
    def run(params, inputs, positions, segment_ids):
        model = teacher.model(params)
        out = model.hidden_states(inputs, positions, segment_ids)
        x = losses.logits(
            out.hidden, model.head_weight(), softcap=teacher.config.model.logit_softcap
        )
        values, ids = jax.lax.top_k(x, k)
        return values, ids, jax.nn.logsumexp(x / temperature, axis=-1)

    values, ids, lse = run(
        teacher.params, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    keys = dict(zip(distill.TOP_K_KEYS, (values, ids.astype(jnp.int32), lse)))
    return {**batch, **{k: np.asarray(v) for k, v in keys.items()}}


def storage(k: int, vocab: int) -> dict:
    """Bytes per token of a store with K values, and of the whole float32 logits for scale."""
    return {
        "bf16_values": 2 * k + 4 * k + 4,
        "f32_values": 4 * k + 4 * k + 4,
        "full_f32_logits": 4 * vocab,
    }


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after one warm-up")
    parser.add_argument("--top-k", type=int, default=64, help="K of the offline store")
    parser.add_argument("overrides", nargs="*", help="student config overrides (a.b=c)")
    a = parser.parse_args()

    online_cfg = load_config(CONFIGS / "distill_tiny.yaml", [*SHAPE, *a.overrides])
    offline_cfg = load_config(
        CONFIGS / "distill_tiny.yaml",
        [*SHAPE, *a.overrides, "distillation.teacher_logits_dir=stored"],
    )
    teacher_cfg = load_config(CONFIGS / "tiny.yaml", [*SHAPE[:3], *TEACHER])
    mesh = make_mesh(online_cfg)
    t_state = train.init_state(teacher_cfg, mesh)
    teacher = distill.Teacher(
        teacher_cfg, Path("."), 0, t_state.graphdef, t_state.params, t_state.rest
    )
    student = distill.init_student(online_cfg, mesh, teacher_cfg)
    shardings = train.shardings_of(student)
    objectives = {
        "online": distill.DistillObjective.create(online_cfg, mesh, teacher),
        "offline": distill.DistillObjective.create(offline_cfg, mesh, None),
    }
    steps = {name: train.make_step(obj, shardings) for name, obj in objectives.items()}
    raw = batches(online_cfg, a.steps)
    temperature = online_cfg.distillation.temperature
    data = {
        "online": [place_batch(b, mesh, online_cfg) for b in raw],
        "offline": [
            place_batch(stored_top_k(teacher, b, a.top_k, temperature), mesh, offline_cfg)
            for b in raw
        ],
    }

    def copy(state):
        return jax.tree.map(jnp.copy, state)

    memory = {}
    for name, step in steps.items():
        compiled = step.lower(student, data[name][0]).compile()
        memory[name] = memory_figures(compiled.memory_analysis(), jax.devices()[0].platform)[0]

    metrics_of = {}
    wall, cpu = ({name: [] for name in steps} for _ in range(2))
    for round_ in range(a.rounds + 1):
        for name, step in steps.items():
            state = copy(student)
            jax.block_until_ready(state)
            start, start_cpu = time.perf_counter(), time.process_time()
            trace = []
            for batch in data[name]:
                state, metrics = step(state, batch)
                trace.append(metrics)
            jax.block_until_ready(state)
            if round_:  # round 0 compiles and warms up
                wall[name].append((time.perf_counter() - start) / a.steps)
                cpu[name].append((time.process_time() - start_cpu) / a.steps)
            metrics_of[name] = jax.device_get(trace)

    med = {
        k: {n: statistics.median(v[n]) for n in steps} for k, v in (("wall", wall), ("cpu", cpu))
    }

    def series(name, tag):
        return [round(float(m[tag]), 5) for m in metrics_of[name]]

    vocab = online_cfg.model.vocab_size
    print(
        json.dumps(
            {
                "student": "configs/distill_tiny.yaml " + " ".join([*SHAPE, *a.overrides]),
                "teacher": "configs/tiny.yaml " + " ".join([*SHAPE[:3], *TEACHER]),
                "top_k": a.top_k,
                "tokens_per_step": online_cfg.train.global_batch_size * online_cfg.data.seq_len,
                "steps_per_round": a.steps,
                "rounds": a.rounds,
                "online_step_seconds": round(med["wall"]["online"], 4),
                "offline_step_seconds": round(med["wall"]["offline"], 4),
                "time_ratio": round(med["wall"]["offline"] / med["wall"]["online"], 4),
                "online_step_cpu_seconds": round(med["cpu"]["online"], 4),
                "offline_step_cpu_seconds": round(med["cpu"]["offline"], 4),
                "cpu_time_ratio": round(med["cpu"]["offline"] / med["cpu"]["online"], 4),
                "teacher_parameter_bytes": nbytes(teacher.params),
                "student_state_bytes": nbytes(student),
                "online_memory_bytes": memory["online"],
                "offline_memory_bytes": memory["offline"],
                "peak_ratio": round(memory["offline"]["peak"] / memory["online"]["peak"], 4),
                "offline_batch_top_k_bytes": nbytes(
                    [data["offline"][0][k] for k in distill.TOP_K_KEYS]
                ),
                "hard_loss_online": series("online", "distill/hard_loss"),
                "hard_loss_offline": series("offline", "distill/hard_loss"),
                "soft_loss_online": series("online", "distill/soft_loss"),
                "soft_loss_offline": series("offline", "distill/soft_loss"),
                "teacher_tail_mass": series("offline", "distill/teacher_tail_mass"),
                "storage_bytes_per_token": {k: storage(k, vocab) for k in (16, 64, 256)},
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
