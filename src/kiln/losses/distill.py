"""Distillation losses: soft-loss sums, hard + soft in one pass, feature distances, their combination."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kiln.config import DEFAULT_MAX_KD_SCALE
from kiln.losses import engine
from kiln.losses import tiling as tl
from kiln.losses.core import (
    TopK,
    as_number,
    check_cap,
    check_smoothing,
    check_targets,
    check_temperature,
    check_z,
    checked,
    f32,
    finite_non_negative,
    weighted_sum,
)
from kiln.losses.cross_entropy import CrossEntropy, weighted_cross_entropy
from kiln.losses.kl import SoftKL, _soft_loss
from kiln.losses.schedule import CpuBlocked, ScheduleName
from kiln.losses.top_k import TopKKL, teacher_stats

sg = jax.lax.stop_gradient


def _prepare(losses, sets, hs, ws, ht, wt, targets, weights, temperature, settings, **kw):
    """Checked `Tiling` and `Inputs` of a two-model call; teacher and temperature are constants."""
    if ws.shape[1] != wt.shape[1]:
        raise ValueError(f"vocabularies differ: student head {ws.shape}, teacher head {wt.shape}")
    if ht.shape[:2] != hs.shape[:2]:
        raise ValueError(f"token shapes differ: student {hs.shape}, teacher {ht.shape}")
    temperature = check_temperature(temperature)
    tiling = tl.make_tiling(
        losses,
        sets,
        hs,
        ws,
        student_cap=check_cap("student_softcap", settings["student_softcap"]),
        teacher_cap=check_cap("teacher_softcap", settings["teacher_softcap"]),
        **kw,
    )
    weights = check_targets(targets, weights, tiling.vocab)
    temperature = sg(jnp.asarray(temperature, f32))
    return tiling, tl.Inputs(hs, ws, targets, weights, sg(ht), sg(wt), temperature)


def _untiled(tiling: tl.Tiling, inputs: tl.Inputs, hard: CrossEntropy | None) -> dict:
    """Each model's logits made once, whole; the losses on them; gradients by autodiff."""
    hs, ws, y, w, ht, wt, t, _ = inputs
    x_s = tl.whole_logits(hs, ws, tiling.student_cap, tiling.mesh, tiling.axes)
    x_t = tl.whole_logits(ht, wt, tiling.teacher_cap, tiling.mesh, tiling.axes)
    wf = w.astype(f32)
    sums = {
        "soft_sum": weighted_sum(_soft_loss(x_s, x_t, t), wf),
        "teacher_loss_sum": weighted_sum(weighted_cross_entropy(x_t, y, w, z=0.0, eps=0.0)[0], wf),
        "weight_sum": jnp.sum(wf),
    }
    if hard is not None:
        loss, z_loss = weighted_cross_entropy(x_s, y, w, z=hard.z, eps=hard.eps)
        sums.update(loss_sum=weighted_sum(loss, wf), z_loss_sum=weighted_sum(z_loss, wf))
    return sums


def _teacher_ce(vocab: int) -> CrossEntropy:
    return CrossEntropy(0.0, 0.0, vocab, source="teacher", loss_name="teacher_loss", z_name=None)


def soft_loss_sums(
    student_hidden_BSD: jax.Array,
    student_head_DV: jax.Array,
    teacher_hidden_BSE: jax.Array,
    teacher_head_EV: jax.Array,
    targets_BS: jax.Array,
    weights_BS: jax.Array,
    *,
    temperature: float | jax.Array,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    num_vocab_tiling: int = 1,
    mesh: Mesh | None = None,
    rules: dict[str, list[str]] | None = None,
    vocab_chunk_size: int | None = None,
    schedule: ScheduleName | CpuBlocked = "auto",
) -> dict[str, jax.Array]:
    """Weighted sums of the soft loss and of the teacher's cross-entropy, float32 scalars.

    Logits are `kiln.losses.logits` of each model (soft-capped as each model is), `soft_sum =
    sum(w * soft_loss(student, teacher, T))` and `teacher_loss_sum = sum(w * CE(teacher))`
    (no z-loss, no smoothing). Only the student receives gradients: teacher inputs and the
    temperature are constants. `num_vocab_tiling`, `vocab_chunk_size` and `schedule` tile the
    loss exactly as `lm_loss`'s, with the same values and gradients.
    """
    vocab = student_head_DV.shape[-1]
    tiling, inputs = _prepare(
        (SoftKL(), _teacher_ce(vocab)),
        (("soft",),),
        student_hidden_BSD,
        student_head_DV,
        teacher_hidden_BSE,
        teacher_head_EV,
        targets_BS,
        weights_BS,
        temperature,
        {"student_softcap": student_softcap, "teacher_softcap": teacher_softcap},
        num_vocab_tiling=num_vocab_tiling,
        vocab_chunk_size=vocab_chunk_size,
        mesh=mesh,
        rules=rules,
        schedule=schedule,
    )
    if tiling.tiled:
        out = engine.run(tiling, inputs, jnp.ones((1,), f32))
    else:
        out = _untiled(tiling, inputs, None)
    return {k: out[k] for k in ("soft_sum", "teacher_loss_sum")}


@jax.custom_vjp
def _value_only(x):
    return x


def _value_only_fwd(x):
    return x, None


def _value_only_bwd(_, ct):
    # A nonzero cotangent means the caller differentiates a value the call did not make the
    # gradient of: poison the gradients rather than return a silently wrong one.
    return (jnp.where(ct != 0, jnp.nan, 0.0).astype(ct.dtype),)


_value_only.defvjp(_value_only_fwd, _value_only_bwd)


def _coefficients(coefficients) -> jax.Array:
    """(c_hard, c_soft), each finite and >= 0 (`checked`), as a constant float32 [2]."""
    c = [
        checked(f"coefficients[{i}]", c, "finite and >= 0", finite_non_negative)
        for i, c in enumerate(coefficients)
    ]
    return sg(jnp.stack([jnp.asarray(x, f32) for x in c]))


def distill_loss_sums(
    student_hidden_BSD: jax.Array,
    student_head_DV: jax.Array,
    teacher_hidden_BSE: jax.Array,
    teacher_head_EV: jax.Array,
    targets_BS: jax.Array,
    weights_BS: jax.Array,
    *,
    temperature: float | jax.Array,
    z_loss_multiplier: float = 0.0,
    label_smoothing: float = 0.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    num_vocab_tiling: int = 1,
    vocab_chunk_size: int | None = None,
    mesh: Mesh | None = None,
    rules: dict[str, list[str]] | None = None,
    coefficients: tuple[jax.Array, jax.Array] | None = None,
    schedule: ScheduleName | CpuBlocked = "auto",
) -> dict[str, jax.Array]:
    """The hard and soft distillation sums from one pass over the student's logits.

    Returns float32 scalars `loss_sum`, `z_loss_sum`, `weight_sum` (as `lm_loss` with the
    student's settings), `soft_sum` and `teacher_loss_sum` (as `soft_loss_sums`). Untiled, each
    model's logits are made once; tiled, each chunk's student logits are made once and feed
    both losses. Teacher inputs, the temperature and the coefficients are constants.

    Gradients (w.r.t. student hidden, student head and floating weights):
    - `coefficients=None`: exact for any cotangents of `loss_sum`, `z_loss_sum` and
      `soft_sum`. Tiled, the forward pass makes the gradients of `loss_sum` and of `soft_sum`
      (two sets of head and hidden gradients) and the backward pass combines them; a nonzero
      `z_loss_sum` cotangent recomputes its own.
    - `coefficients=(c_hard, c_soft)` (float32 scalars, finite and >= 0): the result gains
      `objective_sum = c_hard * loss_sum + c_soft * soft_sum`, the ONLY differentiable output.
      Tiled, each chunk's logit gradient is the one combination `c_hard g_hard + c_soft g_soft`,
      so one hidden and one head gradient matmul per chunk. Differentiating `loss_sum`,
      `z_loss_sum` or `soft_sum` in this mode makes every gradient NaN (loud, never wrong).
    """
    z, eps = check_z(z_loss_multiplier), check_smoothing(label_smoothing)
    vocab = student_head_DV.shape[-1]
    hard = CrossEntropy(z=z, eps=eps, vocab=vocab)
    if coefficients is None:
        sets, coefs = (("loss",), ("soft",)), jnp.ones((2,), f32)
    else:
        sets, coefs = (("loss", "soft"),), _coefficients(coefficients)
    tiling, inputs = _prepare(
        (hard, SoftKL(), _teacher_ce(vocab)),
        sets,
        student_hidden_BSD,
        student_head_DV,
        teacher_hidden_BSE,
        teacher_head_EV,
        targets_BS,
        weights_BS,
        temperature,
        {"student_softcap": student_softcap, "teacher_softcap": teacher_softcap},
        num_vocab_tiling=num_vocab_tiling,
        vocab_chunk_size=vocab_chunk_size,
        mesh=mesh,
        rules=rules,
        schedule=schedule,
        objective=coefficients is not None,
    )
    if tiling.tiled:
        return engine.run(tiling, inputs, coefs)
    sums = _untiled(tiling, inputs, hard)
    if coefficients is not None:
        objective = coefs[0] * sums["loss_sum"] + coefs[1] * sums["soft_sum"]
        sums = {k: _value_only(v) if k != "weight_sum" else v for k, v in sums.items()}
        sums["objective_sum"] = objective
    return sums


# --------------------------------------------------------------------------- offline: stored top-k


def _check_top_k(top: TopK, hidden_BSD, vocab: int) -> None:
    batch, seq = hidden_BSD.shape[:2]
    k = top.ids.shape[-1]
    want = {"values": (batch, seq, k), "ids": (batch, seq, k), "lse": (batch, seq)}
    for name, shape in want.items():
        got = getattr(top, name).shape
        if got != shape:
            raise ValueError(f"teacher top-k {name}: shape {got}, expected {shape}")
    if not 1 <= k <= vocab:
        raise ValueError(f"teacher top-k: K={k} ids per token, allowed 1..{vocab} (the vocabulary)")
    if not jnp.issubdtype(top.ids.dtype, jnp.integer):
        raise ValueError(f"teacher top-k ids: dtype {top.ids.dtype}, expected an integer dtype")


def top_k_distill_loss_sums(
    student_hidden_BSD: jax.Array,
    student_head_DV: jax.Array,
    teacher_top_k: TopK,
    targets_BS: jax.Array,
    weights_BS: jax.Array,
    *,
    temperature: float | jax.Array,
    renormalize: bool = False,
    z_loss_multiplier: float = 0.0,
    label_smoothing: float = 0.0,
    student_softcap: float | None = None,
    num_vocab_tiling: int = 1,
    vocab_chunk_size: int | None = None,
    mesh: Mesh | None = None,
    rules: dict[str, list[str]] | None = None,
    coefficients: tuple[jax.Array, jax.Array] | None = None,
    schedule: ScheduleName | CpuBlocked = "auto",
) -> dict[str, jax.Array]:
    """`distill_loss_sums` against a teacher's stored top-k (`TopK` of [B,S,K], [B,S,K], [B,S]).

    `soft_sum = sum(w * top_k_soft_loss(student, top_k, T))` (tail bucket, or renormalised), at
    the temperature T the stored lse was computed at. The teacher's cross-entropy needs its
    whole distribution at T = 1, which the store does not hold; instead the result has
    `teacher_top_k_hit_sum` (weight of the tokens whose target is among the stored ids) and
    `teacher_tail_mass_sum` (sum of w * p_tail). `loss_sum`, `z_loss_sum`, `weight_sum`,
    `objective_sum` and both gradient modes are those of `distill_loss_sums`. The top-k targets
    are matched to each block of the student's logits: tiled, those are never whole; untiled,
    each device makes its tokens' logits once, in one chunk of the same engine.
    """
    z, eps = check_z(z_loss_multiplier), check_smoothing(label_smoothing)
    temperature = check_temperature(temperature)
    vocab = student_head_DV.shape[-1]
    _check_top_k(teacher_top_k, student_hidden_BSD, vocab)
    hard = CrossEntropy(z=z, eps=eps, vocab=vocab)
    if coefficients is None:
        sets, coefs = (("loss",), ("soft",)), jnp.ones((2,), f32)
    else:
        coefs = _coefficients(coefficients)
        sets = (("loss", "soft"),)
    tiling = tl.make_tiling(
        (hard, TopKKL(vocab, bool(renormalize))),
        sets,
        student_hidden_BSD,
        student_head_DV,
        num_vocab_tiling=num_vocab_tiling,
        vocab_chunk_size=vocab_chunk_size,
        mesh=mesh,
        rules=rules,
        schedule=schedule,
        student_cap=check_cap("student_softcap", student_softcap),
        objective=coefficients is not None,
    )
    weights_BS = check_targets(targets_BS, weights_BS, vocab)
    t = sg(jnp.asarray(temperature, f32))
    top = TopK(*(sg(x) for x in teacher_top_k))
    hit, tail = teacher_stats(top, targets_BS, t, vocab)
    wf = weights_BS.astype(f32)
    # Untiled too, the loss runs in the engine (one chunk: each device's whole logits, once):
    # matching the top-k ids to a vocabulary sharded over the mesh needs its explicit collectives.
    tl.check_tiling(tiling, student_hidden_BSD.shape, student_head_DV.shape)
    inputs = tl.Inputs(student_hidden_BSD, student_head_DV, targets_BS, weights_BS)
    inputs = inputs._replace(temperature=t, teacher_top_k=top)
    return {
        **engine.run(tiling, inputs, coefs),
        "teacher_top_k_hit_sum": weighted_sum(hit, wf),
        "teacher_tail_mass_sum": weighted_sum(tail, wf),
    }


# --------------------------------------------------------------------------- features, balance

# Norms below this are clamped in the cosine distance: its gradient is at most 1 / COSINE_EPS
# (the true gradient grows as 1 / |x| near 0). Residual streams have norms ~ sqrt(d_model).
COSINE_EPS = 1e-3


def feature_loss(student_PBSD: jax.Array, teacher_PBSD: jax.Array, kind: str) -> jax.Array:
    """Per-token distance of hidden states, averaged over the P layer pairs: [P,B,S,D] -> [B,S].

    cosine: `1 - <s, t> / (max(|s|, 1e-3) max(|t|, 1e-3))`, exact for norms >= 1e-3 and with a
    gradient bounded by 1e3 everywhere (a zero vector included); mse: `mean_d (s_d - t_d)^2`.
    Float32. Student states come already projected to the teacher's width.
    """
    if student_PBSD.shape != teacher_PBSD.shape:
        raise ValueError(f"feature shapes differ: {student_PBSD.shape} vs {teacher_PBSD.shape}")
    s, t = student_PBSD.astype(f32), teacher_PBSD.astype(f32)
    if kind == "mse":
        d_PBS = jnp.mean(jnp.square(s - t), axis=-1)
    elif kind == "cosine":
        floor = COSINE_EPS * COSINE_EPS
        norm_s = jnp.sqrt(jnp.maximum(jnp.sum(s * s, axis=-1), floor))
        norm_t = jnp.sqrt(jnp.maximum(jnp.sum(t * t, axis=-1), floor))
        d_PBS = 1.0 - jnp.sum(s * t, axis=-1) / (norm_s * norm_t)
    else:
        raise ValueError(f"feature loss kind must be 'cosine' or 'mse', got {kind!r}")
    return jnp.mean(d_PBS, axis=0)


def _ratio(num, den):
    """num / den, and 0 where den is 0 (no feature pairs, or nothing left to distil)."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def distillation_loss(
    hard: jax.Array,
    soft: jax.Array,
    feature: jax.Array,
    *,
    alpha: float | jax.Array,
    beta: float | jax.Array,
    balance: str,
    max_kd_scale: float = DEFAULT_MAX_KD_SCALE,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total loss from per-token means of the hard, soft and feature losses; and the scales.

    balance "none":    total = (1 - alpha) hard + alpha soft + beta feature
    balance "dynamic": feature_mag_scale = sg(soft) / sg(feature)
                       kd = soft + beta feature_mag_scale feature
                       kd_mag_scale = min(sg(hard) / sg(kd), max_kd_scale)
                       total = hard + alpha kd_mag_scale kd
    sg = stop_gradient; a ratio with a zero denominator is 0. `total` is linear in (hard, soft,
    feature) with stop-gradient coefficients, so its gradient under "dynamic" is
    d hard + alpha k (d soft + beta (soft / feature) d feature), k = min(hard / kd, max_kd_scale):
    the cap bounds the amplification of the distillation gradient as kd -> 0 (a student near
    its teacher). beta = 0 switches the feature term off; with "none" the two scales are
    returned for reference only. alpha in [0, 1] and beta finite and >= 0: a ValueError when
    known, a NaN total when traced out of range (`kiln.losses.core.checked`).
    """
    if balance not in ("none", "dynamic"):
        raise ValueError(f"balance must be 'none' or 'dynamic', got {balance!r}")
    alpha = checked("alpha", alpha, "a number in [0, 1]", lambda a: (a >= 0) & (a <= 1))
    beta = checked("beta", beta, "finite and >= 0", finite_non_negative)
    cap = as_number(max_kd_scale)
    if cap is None or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"max_kd_scale must be a static finite number > 0, got {max_kd_scale!r}")
    feature_mag_scale = _ratio(sg(soft), sg(feature))
    kd = soft + beta * feature_mag_scale * feature
    kd_mag_scale = jnp.minimum(_ratio(sg(hard), sg(kd)), cap)
    if balance == "none":
        total = (1.0 - alpha) * hard + alpha * soft + beta * feature
    else:
        total = hard + alpha * kd_mag_scale * kd
    return total, {"feature_mag_scale": feature_mag_scale, "kd_mag_scale": kd_mag_scale}
