"""kiln's whole distillation step against the step as it was before the redesign of issue 14; JSON.

The reference ("pre_redesign") is the distillation step of kiln at commit e6dbc3a, before the
losses shared one pass over the student's logits: two tiled loss passes, each of which makes
the student's chunk logits (the hard pass: cross-entropy with z-loss; the soft pass: the
teacher's chunk logits too, the soft loss in that commit's form `sum p (a - b) - log-ratio`
and the teacher's cross-entropy) and its gradients w.r.t. hidden states and head, combined by
the balancing coefficients that one `jax.value_and_grad` differentiates through
stop-gradients. Those passes are restated below from `git show e6dbc3a:src/kiln/losses.py`
(`_tiled`, `_local`, `_soft_tiled`, `_soft_local`, `_kl`) for one device without soft-caps,
the benchmark's shape; everything else in the reference step (models, feature loss, the
balancing formula, AdamW) is today's code. kiln's `DistillObjective` makes both losses in one
pass (`distill_loss_sums`). Both run the same jitted, donated step (teacher forward, student
forward and backward, AdamW) from the same state on the same batches; the losses of every
step are compared.

Both sides get the same chunk schedule (`loss.schedule`, `kiln.losses.schedule`), measured
separately: `whole` (the headline: `num_vocab_tiling`'s chunks, each chunk's element-wise work
left to the compiler, the schedule GPU and TPU run) and `cpu_blocked` (chunks of about 32 MiB
of logits, their element-wise work in row blocks of about 1 MiB; a CPU-only schedule). For
`cpu_blocked` the reference's passes are cut the same way: the chunk and block rows of kiln's
plan, each block's logit gradients written into a chunk buffer carried from chunk to chunk, the
products per chunk. So within each schedule the two steps differ only in how the hard and soft
losses are computed.

Shapes: `configs/distill_tiny.yaml` (teacher = `configs/tiny.yaml`'s model, student half as
wide and deep, dynamic balancing, feature loss on two layer pairs), with the vocabulary
scaled to 32768 so the head matters, `loss.num_vocab_tiling=4`, float32, one device (CPU).
Steps are timed in interleaved rounds; medians of wall-clock seconds and of the process's
CPU seconds per step (the second is less sensitive to other work on a shared machine).

One run measures three variants (keys `whole` / `cpu_blocked`, then `dynamic_`, `none_`,
`ga2_`): the shape as shipped (dynamic balancing, one micro-batch),
`distillation.balance=none`, and `train.gradient_accumulation_steps=2`. `losses_alone` times the hard and soft losses without
the models (gradient w.r.t. the student's hidden states and head, dynamic coefficients) for
both ways, with XLA's FLOP, transcendental and byte counts per step, and the head matmuls of
each in units of one student product, so the step's time splits into losses and the rest.

    nice python benchmarks/distill_step.py [--steps 4] [--rounds 3] [--variants ...]
        [--schedules whole cpu_blocked] [--no-split] [key=value overrides]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln import losses
from kiln.config import load_config
from kiln.distill import online as distill
from kiln.losses import schedule as sched
from kiln.parallel.mesh import make_mesh, traced_platform
from kiln.training import train
from kiln.training.batches import place_batch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHAPE = ["model.vocab_size=32768", "loss.num_vocab_tiling=4", "mesh.fsdp=1"]


# ------------------------------------------------------------------ the pre-redesign loss passes
# The loss computations of kiln at e6dbc3a (`git show e6dbc3a:src/kiln/losses.py`: `_tiled`,
# `_local`, `_soft_tiled`, `_soft_local`, `_kl`), restated for one device without logit
# soft-caps (the benchmark's shape): each pass makes its chunk's student logits, its per-token
# values and its gradients w.r.t. hidden states and head in the forward pass; the backward
# pass scales them by the cotangent. `cut = (chunk, block)` rows: the chunks of kiln's plan
# for the same schedule, with the element-wise work in blocks of `block` rows when smaller. (The hard pass's recomputation for a differentiated
# z-loss sits behind a `lax.cond` that the step never takes: z_loss_sum is only logged.)

F32 = jnp.float32


def _old_partials(x_NV, hit_NV):
    m_N = jnp.max(x_NV, axis=-1)
    m_N = jnp.where(jnp.isfinite(m_N), m_N, 0.0)
    s_N = jnp.sum(jnp.exp(x_NV - m_N[..., None]), axis=-1)
    x_y = jnp.sum(jnp.where(hit_NV, x_NV, 0.0), axis=-1)
    return m_N, s_N, x_y, jnp.sum(x_NV, axis=-1)


def _old_token_terms(partials, *, z, eps, vocab):
    m_N, s_N, x_y, sum_x = partials
    lse_N = jnp.log(s_N) + m_N
    ce_N = lse_N - x_y
    if eps:
        ce_N = (1.0 - eps) * ce_N + eps * (lse_N - sum_x / vocab)
    if not z:
        return m_N, s_N, lse_N, ce_N, jnp.zeros_like(ce_N)
    z_N = z * jnp.square(lse_N)
    return m_N, s_N, lse_N, ce_N + z_N, z_N


def _old_logit_grads(x_NV, hit_NV, m_N, s_N, lse_N, ct_loss_N, *, z, eps, vocab):
    coef_N = ct_loss_N * (1.0 + 2.0 * z * lse_N) if z else ct_loss_N
    g_NV = (coef_N / s_N)[..., None] * jnp.exp(x_NV - m_N[..., None])
    g_NV = g_NV - jnp.where(hit_NV, (1.0 - eps) * ct_loss_N[..., None], 0.0)
    if eps:
        g_NV = g_NV - (eps / vocab) * ct_loss_N[..., None]
    return g_NV


def _old_kl(a_NV, b_NV):
    m_a = jnp.max(a_NV, axis=-1)
    m_b = jnp.max(b_NV, axis=-1)
    e_a, e_b = jnp.exp(a_NV - m_a[..., None]), jnp.exp(b_NV - m_b[..., None])
    s_a, s_b = jnp.sum(e_a, axis=-1), jnp.sum(e_b, axis=-1)
    cross = jnp.sum(e_a * (a_NV - b_NV), axis=-1) / s_a
    kl = cross - (m_a - m_b) - jnp.log(s_a / s_b)
    return kl, e_a / s_a[..., None], e_b / s_b[..., None]


def _old_chunks(x, chunk):
    return x.reshape(x.shape[0] * x.shape[1] // chunk, chunk, *x.shape[2:])


def _in_blocks(rows_fn, arrays, block, buf):
    """`rows_fn(*rows) -> (logit gradient [b, V], per-row terms)` over a chunk's rows: at once,
    or in blocks of `block` rows whose gradients are written into `buf` [chunk, V]."""
    chunk = arrays[0].shape[0]
    if block >= chunk:
        return rows_fn(*arrays)

    def one(buf, i):
        rows = [jax.lax.dynamic_slice_in_dim(a, i * block, block) for a in arrays]
        g, terms = rows_fn(*rows)
        return jax.lax.dynamic_update_slice_in_dim(buf, g, i * block, 0), terms

    buf, terms = jax.lax.scan(one, buf, jnp.arange(chunk // block), unroll=2)
    return buf, tuple(x.reshape(chunk) for x in terms)


def _buffer(cut, vocab):
    chunk, block = cut
    return jnp.zeros((chunk, vocab) if block < chunk else (0,), F32)


def _old_hard_local(spec, hs, ws, y, w):
    """Per-token hard loss and z-term; d loss_sum / d (hidden, head)."""
    cut, z, eps = spec
    chunk, block = cut
    batch, seq, d = hs.shape
    vocab = ws.shape[1]
    columns = jnp.arange(vocab)

    def rows(x_nV, y_n, w_n):
        hit_nV = columns == y_n[:, None]
        terms = _old_token_terms(_old_partials(x_nV, hit_nV), z=z, eps=eps, vocab=vocab)
        m_n, s_n, lse_n = terms[:3]
        g_nV = _old_logit_grads(x_nV, hit_nV, m_n, s_n, lse_n, w_n, z=z, eps=eps, vocab=vocab)
        return g_nV, (terms[3], terms[4])

    def step(carry, xs):
        dw, buf = carry
        h_nD, y_n, w_n = xs
        x_nV = jnp.dot(h_nD, ws, preferred_element_type=F32)
        g_nV, (loss_n, z_n) = _in_blocks(rows, (x_nV, y_n, w_n), block, buf)
        dh_nD = jnp.dot(g_nV, ws.T, preferred_element_type=F32)
        dw = dw + jnp.dot(h_nD.T, g_nV, preferred_element_type=F32)
        return (dw, g_nV if block < chunk else buf), (loss_n, z_n, dh_nD)

    xs = (_old_chunks(hs, chunk), _old_chunks(y, chunk), _old_chunks(w.astype(F32), chunk))
    carry = (jnp.zeros(ws.shape, F32), _buffer(cut, vocab))
    (dw, _), (loss_tok, z_tok, dh) = jax.lax.scan(step, carry, xs)
    wf = w.astype(F32)
    sums = (jnp.sum(loss_tok.reshape(batch, seq) * wf), jnp.sum(z_tok.reshape(batch, seq) * wf))
    return sums, dh.reshape(batch, seq, d), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def old_hard_sums(spec, hs, ws, y, w):
    return _old_hard_local(spec, hs, ws, y, w)[0]


def _old_hard_fwd(spec, hs, ws, y, w):
    sums, dh, dw = _old_hard_local(spec, hs, ws, y, w)
    return sums, (dh, dw, y, w)


def _old_hard_bwd(spec, res, cts):
    dh, dw, y, w = res
    ct_loss = cts[0].astype(F32)
    no_int = np.zeros(y.shape, jax.dtypes.float0)
    return ct_loss * dh, ct_loss * dw, no_int, jnp.zeros_like(w)


old_hard_sums.defvjp(_old_hard_fwd, _old_hard_bwd)


def _old_soft_local(cut, hs, ws, ht, wt, y, w, t):
    """Per-token soft loss and teacher CE; d soft_sum / d (hidden, head)."""
    chunk, block = cut
    batch, seq, d = hs.shape
    vocab = ws.shape[1]
    columns = jnp.arange(vocab)

    def rows(xs_nV, xt_nV, y_n, w_n):
        partials = _old_partials(xt_nV, columns == y_n[:, None])
        teacher_n = _old_token_terms(partials, z=0.0, eps=0.0, vocab=vocab)[3]
        kl_n, p_t, p_s = _old_kl(xt_nV / t, xs_nV / t)
        return (w_n * t)[:, None] * (p_s - p_t), (t * t * kl_n, teacher_n)

    def step(carry, xs):
        dw, buf = carry
        h_nD, g_nE, y_n, w_n = xs
        xs_nV = jnp.dot(h_nD, ws, preferred_element_type=F32)
        xt_nV = jnp.dot(g_nE, wt, preferred_element_type=F32)
        g_nV, (soft_n, teacher_n) = _in_blocks(rows, (xs_nV, xt_nV, y_n, w_n), block, buf)
        dh_nD = jnp.dot(g_nV, ws.T, preferred_element_type=F32)
        dw = dw + jnp.dot(h_nD.T, g_nV, preferred_element_type=F32)
        return (dw, g_nV if block < chunk else buf), (soft_n, teacher_n, dh_nD)

    xs = tuple(_old_chunks(x, chunk) for x in (hs, ht, y, w.astype(F32)))
    carry = (jnp.zeros(ws.shape, F32), _buffer(cut, vocab))
    (dw, _), (soft_tok, teacher_tok, dh) = jax.lax.scan(step, carry, xs)
    wf = w.astype(F32)
    sums = (
        jnp.sum(soft_tok.reshape(batch, seq) * wf),
        jnp.sum(teacher_tok.reshape(batch, seq) * wf),
    )
    return sums, dh.reshape(batch, seq, d), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def old_soft_sums(cut, hs, ws, ht, wt, y, w, t):
    return _old_soft_local(cut, hs, ws, ht, wt, y, w, t)[0]


def _old_soft_fwd(cut, hs, ws, ht, wt, y, w, t):
    sums, dh, dw = _old_soft_local(cut, hs, ws, ht, wt, y, w, t)
    return sums, (dh, dw, ht, wt, y, w, t)


def _old_soft_bwd(cut, res, cts):
    dh, dw, ht, wt, y, w, t = res
    ct_soft = cts[0].astype(F32)
    no_int = np.zeros(y.shape, jax.dtypes.float0)
    zeros = (jnp.zeros_like(ht), jnp.zeros_like(wt), no_int, jnp.zeros_like(w), jnp.zeros_like(t))
    return (ct_soft * dh, ct_soft * dw, *zeros)


old_soft_sums.defvjp(_old_soft_fwd, _old_soft_bwd)


def reference_cut(schedule: str, num_chunks: int, rows: int, vocab: int, platform: str):
    """(chunk, block) rows of the reference's passes: those of kiln's plan for `schedule` on
    `rows` tokens (one micro-batch) in `num_chunks` chunks."""
    plan = sched.choose(schedule, platform, rows, num_chunks, vocab, None)
    if plan.padding:
        raise SystemExit(f"the reference is restated for chunks that divide the rows: {plan}")
    return plan.chunk, plan.block


class PreRedesign(distill.DistillObjective):
    """The reference: the hard and soft losses as e6dbc3a computed them, `c . sums` differentiated."""

    def sums(self, model, out, batch, coefficients):
        config, dist = self.config, self.config.distillation
        if config.model.logit_softcap or self.teacher_config.model.logit_softcap:
            raise SystemExit("the pre-redesign reference is restated without logit soft-caps")
        if config.loss.vocab_chunk_size or jax.device_count() != 1:
            raise SystemExit(
                "the pre-redesign reference is restated for one device, whole vocabulary"
            )
        t_hidden, t_feats, t_head = self._teacher_outputs(batch)
        layers = [s for s, _ in dist.layer_map]
        head = model.head_weight()
        y, w = batch["targets"], batch["weights"]
        loss, platform = config.loss, traced_platform(self.mesh)
        cut = reference_cut(loss.schedule, loss.num_vocab_tiling, y.size, head.shape[1], platform)
        spec = (cut, config.loss.z_loss_multiplier, config.loss.label_smoothing)
        hard_sum, z_loss_sum = old_hard_sums(spec, out.hidden, head, y, w)
        t = jax.lax.stop_gradient(jnp.asarray(self.knobs["temperature"], F32))
        soft_sum, teacher_sum = old_soft_sums(cut, out.hidden, head, t_hidden, t_head, y, w, t)
        feature_sum = jnp.zeros((), jnp.float32)
        if layers:
            per_token = losses.feature_loss(model.project(out.features), t_feats, dist.feature_loss)
            feature_sum = jnp.sum(per_token * w.astype(jnp.float32))
        sums = {
            "hard_sum": hard_sum,
            "z_loss_sum": z_loss_sum,
            "weight_sum": jnp.sum(w.astype(F32)),
            "soft_sum": soft_sum,
            "teacher_loss_sum": teacher_sum,
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


VARIANTS = {
    "dynamic": [],  # the shape of configs/distill_tiny.yaml: dynamic balancing, one micro-batch
    "none": ["distillation.balance=none"],
    "ga2": ["train.gradient_accumulation_steps=2"],
}


def _timed(fn, args, rounds: int):
    """Median (wall, CPU) seconds of `fn(*args)` over `rounds` calls after one warm-up."""
    jax.block_until_ready(fn(*args))
    wall, cpu = [], []
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def head_split(config, teacher_cfg, rounds: int) -> dict:
    """The two ways of computing the hard and soft losses alone: time and XLA's counts.

    Gradient w.r.t. the student's hidden states and head of `hard + c soft` with c from the
    batch's own sums under stop_gradient (dynamic balancing on one micro-batch), on random
    states of the benchmark's shapes, both in the config's `loss.schedule`. XLA's counts come
    from the `whole` schedule (its cost analysis counts one iteration of a loop, so a chunk's
    figures are multiplied by the number of chunks; blocks change where bytes go, not FLOPs).
    """
    g, s, n = config.train.global_batch_size, config.data.seq_len, config.loss.num_vocab_tiling
    d, e, v = config.model.d_model, teacher_cfg.model.d_model, config.model.vocab_size
    z, eps = config.loss.z_loss_multiplier, config.loss.label_smoothing
    k = jax.random.split(jax.random.key(0), 5)
    hs, ht = jax.random.normal(k[0], (g, s, d)), jax.random.normal(k[1], (g, s, e))
    ws, wt = 0.05 * jax.random.normal(k[2], (d, v)), 0.05 * jax.random.normal(k[3], (e, v))
    y, w = jax.random.randint(k[4], (g, s), 0, v), jnp.ones((g, s), F32)
    sg = jax.lax.stop_gradient

    def kiln_head(schedule, hs, ws, ht, wt, t):
        out = losses.distill_loss_sums(
            hs, ws, ht, wt, y, w, temperature=t, z_loss_multiplier=z, label_smoothing=eps,
            num_vocab_tiling=n, schedule=schedule,
        )  # fmt: skip
        hard, soft = out["loss_sum"], out["soft_sum"]
        return hard + 0.5 * sg(hard) / sg(soft) * soft

    def old_head(schedule, hs, ws, ht, wt, t):
        cut = reference_cut(schedule, n, g * s, v, jax.default_backend())
        hard, _ = old_hard_sums((cut, z, eps), hs, ws, y, w)
        soft, _ = old_soft_sums(cut, hs, ws, ht, wt, y, w, t)
        return hard + 0.5 * sg(hard) / sg(soft) * soft

    args = (hs, ws, ht, wt, jnp.float32(config.distillation.temperature))
    out = {}
    for name, fn in (("kiln", kiln_head), ("pre_redesign", old_head)):
        timed = jax.jit(jax.grad(functools.partial(fn, config.loss.schedule), argnums=(0, 1)))
        wall, cpu = _timed(timed, args, rounds)
        counted = jax.jit(jax.grad(functools.partial(fn, "whole"), argnums=(0, 1)))
        cost = counted.lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out[name] = {
            "cpu_seconds": round(cpu, 4),
            "seconds": round(wall, 4),
            **{
                key.replace(" ", "_"): float(n * cost[key])
                for key in ("flops", "transcendentals", "bytes accessed")
            },
        }
    # Head products per step in units of one student product (tokens x d_model x vocab);
    # the teacher's head is e / d units.
    unit = 2.0 * g * s * d * v
    out["student_head_product_units"] = {
        "kiln": {"logits": 1, "teacher_logits": e / d, "gradient_products": 4},
        "pre_redesign": {"logits": 2, "teacher_logits": e / d, "gradient_products": 4},
        "flops_per_unit": unit,
    }
    return out


def measure(teacher_cfg, overrides: list[str], steps_per_round: int, rounds: int) -> dict:
    """kiln's step and the pre-redesign step on one config: step times, losses, their ratio."""
    config = load_config(CONFIGS / "distill_tiny.yaml", [*SHAPE, *overrides])
    mesh = make_mesh(config)
    t_state = train.init_state(teacher_cfg, mesh)
    teacher = distill.Teacher(
        teacher_cfg, Path("."), 0, t_state.graphdef, t_state.params, t_state.rest
    )
    student = distill.init_student(config, mesh, teacher_cfg)
    shardings = train.shardings_of(student)
    objectives = {
        "kiln": distill.DistillObjective.create(config, mesh, teacher),
        "pre_redesign": PreRedesign.create(config, mesh, teacher),
    }
    steps = {name: train.make_step(obj, shardings) for name, obj in objectives.items()}
    data = [place_batch(b, mesh, config) for b in batches(config, steps_per_round)]

    def copy(state):
        return jax.tree.map(jnp.copy, state)

    losses_of = {}
    wall, cpu = ({name: [] for name in steps} for _ in range(2))
    for round_ in range(rounds + 1):
        for name, step in steps.items():
            state = copy(student)
            jax.block_until_ready(state)
            start, start_cpu = time.perf_counter(), time.process_time()
            trace = []
            for batch in data:
                state, metrics = step(state, batch)
                trace.append(metrics["learning/loss"])
            jax.block_until_ready(state)
            if round_:  # round 0 compiles and warms up
                wall[name].append((time.perf_counter() - start) / steps_per_round)
                cpu[name].append((time.process_time() - start_cpu) / steps_per_round)
            losses_of[name] = [float(x) for x in trace]

    ref, got = np.array(losses_of["pre_redesign"]), np.array(losses_of["kiln"])
    med = {
        k: {n: statistics.median(v[n]) for n in steps} for k, v in (("wall", wall), ("cpu", cpu))
    }
    return {
        "config": "configs/distill_tiny.yaml " + " ".join([*SHAPE, *overrides]),
        "kiln_step_seconds": round(med["wall"]["kiln"], 4),
        "pre_redesign_step_seconds": round(med["wall"]["pre_redesign"], 4),
        "time_ratio": round(med["wall"]["kiln"] / med["wall"]["pre_redesign"], 4),
        "kiln_step_cpu_seconds": round(med["cpu"]["kiln"], 4),
        "pre_redesign_step_cpu_seconds": round(med["cpu"]["pre_redesign"], 4),
        "cpu_time_ratio": round(med["cpu"]["kiln"] / med["cpu"]["pre_redesign"], 4),
        "time_ratios_per_round": [
            round(k / r, 4) for k, r in zip(wall["kiln"], wall["pre_redesign"])
        ],
        "cpu_time_ratios_per_round": [
            round(k / r, 4) for k, r in zip(cpu["kiln"], cpu["pre_redesign"])
        ],
        "losses_kiln": got.tolist(),
        "losses_pre_redesign": ref.tolist(),
        "loss_max_rel_diff": float(np.max(np.abs(got - ref) / np.abs(ref))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="shapes to measure: dynamic (distill_tiny's), balance none, 2 micro-batches",
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=["whole", "cpu_blocked"],
        default=["whole", "cpu_blocked"],
        help="loss.schedule of both steps: whole (the GPU/TPU schedule, the headline) and "
        "cpu_blocked (CPU only)",
    )
    parser.add_argument(
        "--no-split", action="store_true", help="skip timing the hard and soft losses alone"
    )
    parser.add_argument("overrides", nargs="*", help="student config overrides (a.b=c)")
    a = parser.parse_args()

    teacher_cfg = load_config(CONFIGS / "tiny.yaml", SHAPE)
    report = {
        "teacher": "configs/tiny.yaml " + " ".join(SHAPE),
        "steps_per_round": a.steps,
        "rounds": a.rounds,
    }
    for schedule in a.schedules:
        overrides = [f"loss.schedule={schedule}", *a.overrides]
        results = {
            name: measure(teacher_cfg, [*VARIANTS[name], *overrides], a.steps, a.rounds)
            for name in a.variants
        }
        report[schedule] = {f"{name}_{k}": v for name, r in results.items() for k, v in r.items()}
        config = load_config(CONFIGS / "distill_tiny.yaml", [*SHAPE, *overrides])
        if not a.no_split:
            report[schedule]["losses_alone"] = head_split(config, teacher_cfg, a.rounds + 1)
    report["tokens_per_step"] = config.train.global_batch_size * config.data.seq_len
    report.update(
        {
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "device": str(jax.devices()[0]),
            "device_count": jax.device_count(),
            "jax": jax.__version__,
            "machine": platform.machine(),
        }
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
