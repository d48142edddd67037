"""Wall time of the tiled distillation loss + gradients: two separate calls vs one fused pass; JSON.

The objective differentiates `c_hard * loss_sum + c_soft * soft_sum` w.r.t. the student's hidden
states and head. The reference makes it as the distillation objective did before the fused
call: `lm_loss` and `soft_loss_sums`, two tiled calls that each make the student's chunk
logits (coefficients unknown to either). `distill_loss_sums` makes them once, in two modes:
`coefficients=None` (exact for any cotangent: two gradient sets per chunk) and
`coefficients=(c_hard, c_soft)` (one combined logit gradient, one pair of gradient matmuls).
Shapes follow `configs/distill_tiny.yaml` (student d_model 64, teacher 128) with the
vocabulary scaled so the head matters. Variants are timed in interleaved rounds; medians. Every
variant runs in the same `loss.schedule` (`--schedule`, default `whole`: the GPU/TPU schedule).

    nice python benchmarks/distill_loss.py [--schedule whole|cpu_blocked]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kiln.losses import distill_loss_sums, lm_loss, soft_loss_sums


def inputs(batch: int, seq: int, d_student: int, d_teacher: int, vocab: int):
    ks = jax.random.split(jax.random.key(0), 6)
    hs = jax.random.normal(ks[0], (batch, seq, d_student), jnp.float32)
    ws = jax.random.normal(ks[1], (d_student, vocab), jnp.float32) / d_student**0.5
    ht = jax.random.normal(ks[2], (batch, seq, d_teacher), jnp.float32)
    wt = jax.random.normal(ks[3], (d_teacher, vocab), jnp.float32) * 2 / d_teacher**0.5
    targets = jax.random.randint(ks[4], (batch, seq), 0, vocab)
    weights = (jax.random.uniform(ks[5], (batch, seq)) > 0.1).astype(jnp.float32)
    return hs, ws, ht, wt, targets, weights


def variants(a, teacher, targets, weights, coefs):
    """name -> f(hidden, head) = (objective, sums): the reference and the fused call's two modes."""
    settings = {
        "num_vocab_tiling": a.tiling,
        "vocab_chunk_size": a.vocab_chunk or None,
        "schedule": a.schedule,
    }
    ht, wt = teacher
    c_hard, c_soft = coefs

    def separate(hs, ws):
        hard = lm_loss(hs, ws, targets, weights, z_loss_multiplier=a.z_loss, **settings)
        soft = soft_loss_sums(hs, ws, ht, wt, targets, weights, temperature=a.temperature, **settings)  # fmt: skip
        return c_hard * hard["loss_sum"] + c_soft * soft["soft_sum"], {**hard, **soft}

    def fused(coefficients):
        def f(hs, ws):
            sums = distill_loss_sums(
                hs,
                ws,
                ht,
                wt,
                targets,
                weights,
                temperature=a.temperature,
                z_loss_multiplier=a.z_loss,
                coefficients=coefficients,
                **settings,
            )
            if coefficients is None:
                return c_hard * sums["loss_sum"] + c_soft * sums["soft_sum"], sums
            return sums["objective_sum"], sums

        return f

    return {"separate": separate, "fused_exact": fused(None), "fused_coefficients": fused(coefs)}


def rel_diff(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-student", type=int, default=64)
    parser.add_argument("--d-teacher", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tiling", type=int, default=4, help="num_vocab_tiling")
    parser.add_argument("--vocab-chunk", type=int, default=0, help="vocab_chunk_size (0 = none)")
    parser.add_argument(
        "--schedule",
        choices=["whole", "cpu_blocked"],
        default="whole",
        help="loss.schedule of every variant: whole (the GPU/TPU schedule) or cpu_blocked",
    )
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--z-loss", type=float, default=1e-4)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up")
    a = parser.parse_args()

    hs, ws, ht, wt, targets, weights = inputs(a.batch, a.seq, a.d_student, a.d_teacher, a.vocab)
    coefs = (jnp.float32(1.0), jnp.float32(0.7))  # e.g. c_hard = 1, c_soft = alpha k
    compiled, outputs, times = {}, {}, {}
    for name, f in variants(a, (ht, wt), targets, weights, coefs).items():
        grad_fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
        compiled[name] = grad_fn.lower(hs, ws).compile()
        outputs[name] = jax.device_get(compiled[name](hs, ws))
        times[name] = []
    for round_ in range(a.rounds + 1):
        for name, c in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(hs, ws))
            if round_:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
    (ref_value, ref_sums), ref_grads = outputs["separate"]
    base = statistics.median(times["separate"])
    results = []
    for name in compiled:
        (value, sums), grads = outputs[name]
        median = statistics.median(times[name])
        keys = ("loss_sum", "z_loss_sum", "weight_sum", "soft_sum", "teacher_loss_sum")
        results.append(
            {
                "variant": name,
                "median_seconds": round(median, 4),
                "time_vs_separate": round(median / base, 4),
                "objective_rel_diff": rel_diff(value, ref_value),
                "sums_max_rel_diff": max(rel_diff(sums[k], ref_sums[k]) for k in keys),
                "grad_hidden_rel_diff": rel_diff(grads[0], ref_grads[0]),
                "grad_head_rel_diff": rel_diff(grads[1], ref_grads[1]),
            }
        )
    print(
        json.dumps(
            {
                "tokens": a.batch * a.seq,
                "d_student": a.d_student,
                "d_teacher": a.d_teacher,
                "vocab": a.vocab,
                "num_vocab_tiling": a.tiling,
                "vocab_chunk_size": a.vocab_chunk or None,
                "schedule": a.schedule,
                "temperature": a.temperature,
                "z_loss_multiplier": a.z_loss,
                "dtype": "float32",
                "rounds": a.rounds,
                "device": str(jax.devices()[0]),
                "device_count": jax.device_count(),
                "jax": jax.__version__,
                "machine": platform.machine(),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
