"""kiln's whole train step against a hand-written pure-JAX step of the same model, in one process.

Same model (Llama-style, 4 layers, d 512, 8 heads, SwiGLU 1408, vocab 8192), same batch
(8 x 512 tokens, one document per row), float32, AdamW + global-norm clipping, both jitted
with donated state. Prints JSON: median step time and tokens/s of each, and kiln/reference.

    python benchmarks/step_throughput.py [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kiln.config import config_from_dict
from kiln.training import train
from kiln.training.batches import place_batch

LAYERS, D, HEADS, FF, VOCAB, SEQ, BATCH = 4, 512, 8, 1408, 8192, 512, 8
LR, B1, B2, EPS, WD, CLIP = 3e-4, 0.9, 0.95, 1e-8, 0.1, 1.0


def kiln_config():
    return config_from_dict(
        {
            "model": {
                "vocab_size": VOCAB, "d_model": D, "num_layers": LAYERS, "num_heads": HEADS,
                "d_ff": FF, "max_seq_len": SEQ, "dtype": "float32", "param_dtype": "float32",
            },
            "data": {"seq_len": SEQ},
            "mesh": {"data": 1, "fsdp": -1, "tensor": 1, "sequence": 1},
            "optim": {
                "learning_rate": LR, "schedule": "constant", "warmup_steps": 0, "b1": B1,
                "b2": B2, "eps": EPS, "weight_decay": WD, "grad_clip": CLIP,
            },
            "train": {"global_batch_size": BATCH, "steps": 1000},
        }
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The reference: the same network written directly against jax.numpy.


def ref_init(key):
    ks = jax.random.split(key, 8)
    h = D // HEADS

    def normal(k, shape):
        return 0.02 * jax.random.normal(k, shape, jnp.float32)

    return {
        "embed": normal(ks[0], (VOCAB, D)),
        "wq": normal(ks[1], (LAYERS, D, HEADS, h)),
        "wk": normal(ks[2], (LAYERS, D, HEADS, h)),
        "wv": normal(ks[3], (LAYERS, D, HEADS, h)),
        "wo": normal(ks[4], (LAYERS, HEADS, h, D)),
        "w_gate": normal(ks[5], (LAYERS, D, FF)),
        "w_up": normal(ks[6], (LAYERS, D, FF)),
        "w_down": normal(ks[7], (LAYERS, FF, D)),
        "norm1": jnp.ones((LAYERS, D)),
        "norm2": jnp.ones((LAYERS, D)),
        "final_norm": jnp.ones((D,)),
        "head": normal(ks[0], (D, VOCAB)),
    }


def rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale


def rotary(x, pos):
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half) / half)
    ang = pos[..., None] * freq
    sin, cos = jnp.sin(ang)[:, :, None], jnp.cos(ang)[:, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def ref_loss(params, batch):
    x = params["embed"][batch["inputs"]]
    pos, seg = batch["positions"].astype(jnp.float32), batch["segment_ids"]
    s = x.shape[1]
    mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((s, s), bool))[None]

    def layer(x, p):
        y = rms(x, p["norm1"])
        q = rotary(jnp.einsum("bsd,dnh->bsnh", y, p["wq"]), pos)
        k = rotary(jnp.einsum("bsd,dnh->bsnh", y, p["wk"]), pos)
        v = jnp.einsum("bsd,dnh->bsnh", y, p["wv"])
        att = jnp.einsum("bsnh,btnh->bnst", q, k) / jnp.sqrt(q.shape[-1])
        att = jax.nn.softmax(jnp.where(mask[:, None], att, -1e30), axis=-1)
        x = x + jnp.einsum("bnst,btnh,nhd->bsd", att, v, p["wo"])
        y = rms(x, p["norm2"])
        x = x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]
        return x, None

    stacked = {
        k: params[k] for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "norm1", "norm2")
    }
    x, _ = jax.lax.scan(layer, x, stacked)
    logits = rms(x, params["final_norm"]) @ params["head"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch["weights"]) / jnp.sum(batch["weights"])


def ref_tx():
    """AdamW with global-norm clipping, decay on every matrix (embedding and head too), none on norms."""
    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1 and x.shape != (LAYERS, D), p)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=decay),
    )


def ref_step_fn():
    tx = ref_tx()

    @jax.jit
    def init(key):
        params = ref_init(key)
        return params, tx.init(params)

    def step(state, batch):
        params, opt = state
        loss, grads = jax.value_and_grad(ref_loss)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    return init, jax.jit(step, donate_argnums=0)


# ---------------------------------------------------------------------------------------------


def make_batch(batch=BATCH, seq=SEQ, vocab=VOCAB):
    """Random tokens, one document per row, no padding."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq + 1))
    return {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
        "segment_ids": np.ones((batch, seq), np.int32),
        "weights": np.ones((batch, seq), np.float32),
    }


def time_steps(step, state, batch, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return state, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()

    config = kiln_config()
    state = train.init_state(config)
    mesh = jax.tree.leaves(state.params)[0].sharding.mesh
    kiln_step = train.make_train_step(config, mesh, train.shardings_of(state))
    kiln_batch = place_batch(make_batch(), mesh, config)

    ref_init_fn, ref_step = ref_step_fn()
    ref_state = ref_init_fn(jax.random.key(0))
    ref_batch = jax.device_put(make_batch())

    # Compile and warm up both, then alternate timed rounds so both see the same machine.
    state, _ = time_steps(kiln_step, state, kiln_batch, 2)
    ref_state, _ = time_steps(ref_step, ref_state, ref_batch, 2)
    kiln_times, ref_times = [], []
    for _ in range(args.rounds):
        state, t = time_steps(kiln_step, state, kiln_batch, args.steps)
        kiln_times += t
        ref_state, t = time_steps(ref_step, ref_state, ref_batch, args.steps)
        ref_times += t

    tokens = BATCH * SEQ
    kiln_s, ref_s = statistics.median(kiln_times), statistics.median(ref_times)
    print(
        json.dumps(
            {
                "benchmark": "step_throughput",
                "model": {
                    "layers": LAYERS,
                    "d_model": D,
                    "heads": HEADS,
                    "d_ff": FF,
                    "vocab": VOCAB,
                },
                "batch": {"global_batch_size": BATCH, "seq_len": SEQ, "dtype": "float32"},
                "devices": jax.device_count(),
                "kiln_step_seconds": round(kiln_s, 4),
                "reference_step_seconds": round(ref_s, 4),
                "kiln_tokens_per_sec": round(tokens / kiln_s, 1),
                "reference_tokens_per_sec": round(tokens / ref_s, 1),
                "kiln_over_reference": round(ref_s / kiln_s, 4),
                "timed_steps_each": len(kiln_times),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
