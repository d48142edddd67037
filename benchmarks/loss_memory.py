"""Temp memory and wall time of LM loss + gradients, untiled vs vocab-tiled; prints JSON.

For each vocabulary size, every variant is compiled (XLA's `memory_analysis()` gives the
temporary bytes), then the variants are timed in interleaved rounds so that load from other
processes hits them alike; the median of the rounds is reported. Runs on the default
device set (one CPU device unless the environment says otherwise), float32.

`results` are the tiled loss in `num_vocab_tiling`'s whole chunks (`loss.schedule: whole`,
what GPU and TPU run): the table of docs/losses.md. `cpu_blocked_results` are the same
settings in the CPU-only `cpu_blocked` schedule (chunks of about 32 MiB of logits, row blocks
of about 1 MiB); their untiled reference is the same plain XLA loss, which is not blocked.

    nice python benchmarks/loss_memory.py [--vocab 65536] [--schedules whole cpu_blocked]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from kiln.losses import lm_loss


def build(tokens, d_model, vocab, chunks, vocab_chunk, z, schedule):
    """Compiled value_and_grad of the mean loss w.r.t. hidden and head, and its inputs."""
    k_h, k_w, k_y = jax.random.split(jax.random.key(0), 3)
    seq = 2048 if tokens % 2048 == 0 else tokens  # otherwise one row of all the tokens
    hidden = jax.random.normal(k_h, (tokens // seq, seq, d_model), jnp.float32)
    head = jax.random.normal(k_w, (d_model, vocab), jnp.float32) / d_model**0.5
    targets = jax.random.randint(k_y, (tokens // seq, seq), 0, vocab)
    weights = jnp.ones((tokens // seq, seq), jnp.float32)

    def mean_loss(hidden, head):
        out = lm_loss(
            hidden,
            head,
            targets,
            weights,
            z_loss_multiplier=z,
            num_vocab_tiling=chunks,
            vocab_chunk_size=vocab_chunk,
            schedule=schedule,
        )
        return out["loss_sum"] / out["weight_sum"]

    compiled = jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1))).lower(hidden, head).compile()
    return compiled, (hidden, head)


def run(compiled, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument(
        "--vocab-chunk",
        type=int,
        default=4096,
        help="also time tiled(8) with this vocab_chunk_size (0 = skip)",
    )
    parser.add_argument("--z-loss", type=float, default=1e-4)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=["whole", "cpu_blocked"],
        default=["whole", "cpu_blocked"],
        help="loss.schedule of the tiled variants (whole: the headline table)",
    )
    a = parser.parse_args()

    results = {s: [] for s in a.schedules}
    for vocab in a.vocab:
        variants = {}
        settings = [(1, None, "whole")]
        for schedule in a.schedules:
            settings += [(c, None, schedule) for c in a.chunks]
            if a.vocab_chunk and a.vocab_chunk < vocab and schedule == "whole":
                settings.append((8, a.vocab_chunk, schedule))
        for chunks, vocab_chunk, schedule in settings:
            compiled, args = build(
                a.tokens, a.d_model, vocab, chunks, vocab_chunk, a.z_loss, schedule
            )
            temp = compiled.memory_analysis().temp_size_in_bytes
            key = (chunks, vocab_chunk, schedule)
            variants[key] = {"compiled": compiled, "args": args, "temp": temp, "times": []}
        for round_ in range(a.rounds + 1):
            for v in variants.values():
                seconds = run(v["compiled"], v["args"])
                if round_:  # round 0 warms up
                    v["times"].append(seconds)
        base = variants[1, None, "whole"]
        base_time = statistics.median(base["times"])
        for (chunks, vocab_chunk, schedule), v in variants.items():
            median = statistics.median(v["times"])
            row = {
                "vocab": vocab,
                "num_vocab_tiling": chunks,
                "vocab_chunk_size": vocab_chunk,
                "temp_bytes": v["temp"],
                "temp_vs_untiled": round(v["temp"] / base["temp"], 4),
                "median_seconds": round(median, 4),
                "time_vs_untiled": round(median / base_time, 4),
            }
            for s in results if chunks == 1 else [schedule]:
                results[s].append(row)
        del variants, base
    print(
        json.dumps(
            {
                "tokens": a.tokens,
                "d_model": a.d_model,
                "dtype": "float32",
                "z_loss_multiplier": a.z_loss,
                "rounds": a.rounds,
                "device": str(jax.devices()[0]),
                "device_count": jax.device_count(),
                "jax": jax.__version__,
                "machine": platform.machine(),
                "results": results.get("whole", []),
                "cpu_blocked_results": results.get("cpu_blocked", []),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
