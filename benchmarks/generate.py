"""Decode tokens/s with the KV cache (`kiln.commands.generate.generate`) vs re-running the full forward
pass for every new token, on the same model in one process; JSON.

The model is `configs/tiny.yaml`'s (4 layers, d 128, vocab 384, float32) with
`model.max_seq_len` raised to hold the prompt and the new tokens, random weights. Both paths
decode greedily from the same left-padded batch of prompts; the reference keeps one
[batch, prompt + new] buffer of tokens and runs the whole model over it (one compiled
program, the logits read at the last filled slot) for each token, as a decoder without a
cache does. Both are compiled by a warm-up run first; times are medians of interleaved
rounds, and the greedy tokens of both must agree.

    nice python benchmarks/generate.py [--new-tokens 256] [--prompt-len 32] [--batch 4]
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

from kiln.commands.generate import PROMPT_BUCKET, generate
from kiln.config import load_config
from kiln.model import create_model

REPO = Path(__file__).resolve().parents[1]


def full_forward_decoder(model, prompts, new_tokens):
    """Greedy decoding by the full forward pass over a [B, P + N] buffer per token."""
    b, p = len(prompts), -(-max(len(x) for x in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
    tokens = np.zeros((b, p + new_tokens), np.int32)
    positions = np.zeros_like(tokens)
    segments = np.zeros_like(tokens)
    for r, x in enumerate(prompts):  # the same left-padded layout as kiln.commands.generate
        tokens[r, p - len(x) : p] = x
        positions[r, p - len(x) :] = np.arange(len(x) + new_tokens)
        segments[r, p - len(x) :] = 1

    @jax.jit
    def step(tokens_BT, t):
        hidden = model.hidden_states(tokens_BT, positions, segments).hidden
        last_BD = jax.lax.dynamic_index_in_dim(hidden, p - 1 + t, axis=1, keepdims=False)
        next_B = jnp.argmax(model.logits(last_BD), axis=-1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice(tokens_BT, next_B[:, None], (0, p + t))

    def decode():
        buffer = jnp.asarray(tokens)
        for t in range(new_tokens):
            buffer = step(buffer, t)
        return np.asarray(buffer[:, p:])

    return decode


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    max_seq_len = -(-a.prompt_len // PROMPT_BUCKET) * PROMPT_BUCKET + a.new_tokens
    config = load_config(
        REPO / "configs" / "tiny.yaml", [f"model.max_seq_len={max_seq_len}", "mesh.fsdp=1"]
    )
    model = create_model(config, None, seed=0)
    rng = np.random.default_rng(0)
    # Prompts of different lengths (the longest is --prompt-len), one batch.
    lengths = np.linspace(a.prompt_len // 2, a.prompt_len, a.batch).astype(int)
    prompts = [rng.integers(0, 256, n).tolist() for n in lengths]

    def cached():
        return np.asarray(generate(model, prompts, max_new_tokens=a.new_tokens).tokens)

    full = full_forward_decoder(model, prompts, a.new_tokens)
    want, got = full(), cached()  # warm-up: compiles both
    times = {"cache": [], "full_forward": []}
    for _ in range(a.rounds):
        times["cache"].append(timed(cached)[0])
        times["full_forward"].append(timed(full)[0])
    tokens = a.batch * a.new_tokens
    cache_tps = tokens / statistics.median(times["cache"])
    full_tps = tokens / statistics.median(times["full_forward"])
    print(
        json.dumps(
            {
                "benchmark": "generate",
                "model": "configs/tiny.yaml (4 layers, d 128, vocab 384, float32)",
                "batch": a.batch,
                "prompt_lengths": lengths.tolist(),
                "new_tokens": a.new_tokens,
                "cache_tokens_per_sec": round(cache_tps, 1),
                "full_forward_tokens_per_sec": round(full_tps, 1),
                "speedup": round(cache_tps / full_tps, 2),
                "greedy_tokens_equal": bool((want == got).all()),
                "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
                "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
                "cpu": platform.processor() or platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
