"""What every loss shares: the head logits, a mergeable log-normaliser, and argument checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kiln.parallel.mesh import current_reduce_dtype

f32 = jnp.float32


def _f32_matmul(hidden: jax.Array, head_DV: jax.Array) -> jax.Array:
    return jnp.einsum("...D,DV->...V", hidden, head_DV, preferred_element_type=f32)


@jax.custom_vjp
def _low_precision_matmul(hidden: jax.Array, head_DV: jax.Array) -> jax.Array:
    return _f32_matmul(hidden, head_DV)


def _low_precision_matmul_fwd(hidden, head_DV):
    return _f32_matmul(hidden, head_DV), (hidden, head_DV)


def _low_precision_matmul_bwd(res, g):
    # Autodiff would multiply the float32 logit gradient with the bf16 operands, i.e. run
    # both backward products in float32; cast it to the head's dtype first, as the forward
    # casts the hidden states, so all three products run in bf16 with float32 accumulation.
    # d head is contracted straight into [D, V] (no transpose after the product: XLA's CPU
    # backend cannot run the bf16 x bf16 -> f32 dot it folds that transpose into), in the
    # output shardings autodiff would give, so explicit-axis meshes know where they go.
    # d head leaves the product, and so is summed across devices, in float32, or in the head's
    # dtype where the step asks for weight gradients in the compute dtype (as `kiln.model.project`).
    hidden, head_DV = res
    g = g.astype(head_DV.dtype)
    reduce = current_reduce_dtype(f32) or head_DV.dtype
    d_head = jnp.einsum(
        "...D,...V->DV", hidden, g, preferred_element_type=reduce, out_sharding=_sharding(head_DV)
    )
    d_hidden = jnp.einsum(
        "...V,DV->...D", g, head_DV, preferred_element_type=f32, out_sharding=_sharding(hidden)
    )
    return d_hidden.astype(hidden.dtype), d_head.astype(head_DV.dtype)


def _sharding(x: jax.Array):
    """x's sharding as its type carries it (None without a mesh)."""
    sharding = jax.typeof(x).sharding
    return None if sharding.mesh.empty else sharding


_low_precision_matmul.defvjp(_low_precision_matmul_fwd, _low_precision_matmul_bwd)


def logits(hidden_ND: jax.Array, head_DV: jax.Array, *, softcap: float | None = None) -> jax.Array:
    """Float32 logits [..., V] of hidden [..., D] through a head [D, V]; `cap tanh(x / cap)` if capped.

    The one head matmul of kiln (the model's logits, the untiled and tiled losses, the soft
    loss): it runs in the head's dtype (`LanguageModel.head_weight`, i.e. `model.logits_dtype`)
    with float32 accumulation, forward and backward. A float32 head is plain autodiff.
    """
    softcap = check_cap("softcap", softcap)
    hidden_ND = hidden_ND.astype(head_DV.dtype)
    if head_DV.dtype == f32:
        x = _f32_matmul(hidden_ND, head_DV)
    else:
        x = _low_precision_matmul(hidden_ND, head_DV)
    return softcap * jnp.tanh(x / softcap) if softcap else x


def softcap_grad(g_nV: jax.Array, capped_nV: jax.Array, cap: float | None) -> jax.Array:
    """Chain rule of `cap tanh(x / cap)` from its output: d/dx = 1 - (output / cap)^2."""
    return g_nV * (1.0 - jnp.square(capped_nV / cap)) if cap else g_nV


class TopK(NamedTuple):
    """A teacher's stored top-k logits per token (offline distillation)."""

    values: jax.Array  # [..., K] float32: the teacher's logits after its soft-cap, not over T
    ids: jax.Array  # [..., K] int32: their vocabulary ids, distinct per token
    lse: jax.Array  # [...] float32: logsumexp(teacher logits / T) over the whole vocabulary


class ChunkLogits(NamedTuple):
    """The float32 logits of a block of tokens x vocabulary entries, as the loss callbacks see them."""

    student: jax.Array  # [n, c], soft-capped as the student is
    teacher: jax.Array | None  # [n, c], soft-capped as the teacher is; None without a teacher
    hit: jax.Array | None  # [n, c] bool: the entry is the token's target
    temperature: jax.Array | None  # scalar T of the soft loss
    # [n] int: the target's column when the block holds each row's whole vocabulary, so target
    # logits are gathered instead of summed from `hit` over an [n, c] array; else None.
    target: jax.Array | None = None
    top: TopK | None = None  # the rows' stored teacher top-k ([n, K], [n, K], [n])
    top_col: jax.Array | None = None  # [n, K] int: each top-k id's column in the block, else c


class Normaliser(NamedTuple):
    """log sum_v exp(x_v) of (a piece of) a row, mergeable across vocabulary pieces.

    m = max, s = sum exp(x - m), c = sum (x - m) (only with label smoothing, else 0),
    n = entries. Shifted sums keep float32 relative precision at any common logit offset.
    """

    m: jax.Array
    s: jax.Array
    c: jax.Array
    n: jax.Array


def axis_size(axes: tuple[str, ...]) -> int:
    """Devices along mesh `axes` (inside shard_map); 1 for none."""
    return math.prod(jax.lax.axis_size(a) for a in axes)


def psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def pmax(x, axes):
    return jax.lax.pmax(x, axes) if axes else x


def normaliser(x_nV: jax.Array, axes: tuple[str, ...] = (), *, shifted_sum: bool) -> Normaliser:
    """`Normaliser` of rows x [n, V]; with `axes`, the row's vocabulary is sharded over them.

    The maximum is combined over `axes` before the exponentials, so the `exp(x - m)` here is
    the same array later gradients need (XLA computes it once).
    """
    m_n = pmax(jnp.max(x_nV, axis=-1), axes)
    m_n = jnp.where(jnp.isfinite(m_n), m_n, 0.0)
    s_n = psum(jnp.sum(jnp.exp(x_nV - m_n[..., None]), axis=-1), axes)
    zero = jnp.zeros_like(m_n)
    c_n = psum(jnp.sum(x_nV - m_n[..., None], axis=-1), axes) if shifted_sum else zero
    return Normaliser(m_n, s_n, c_n, jnp.full((), x_nV.shape[-1] * axis_size(axes), f32))


def merge(a: Normaliser, b: Normaliser) -> Normaliser:
    """Normaliser of two disjoint pieces of the same rows (an online logsumexp)."""
    m = jnp.maximum(a.m, b.m)
    s = a.s * jnp.exp(a.m - m) + b.s * jnp.exp(b.m - m)
    c = (a.c + a.n * (a.m - m)) + (b.c + b.n * (b.m - m))
    return Normaliser(m, s, c, a.n + b.n)


def reduce(a: Normaliser, axes: tuple[str, ...]) -> Normaliser:
    """Merge the pieces of a vocabulary sharded over mesh `axes` (inside shard_map)."""
    if not axes:
        return a
    m = jax.lax.pmax(a.m, axes)
    s, c = jax.lax.psum((a.s * jnp.exp(a.m - m), a.c + a.n * (a.m - m)), axes)
    return Normaliser(m, s, c, a.n * axis_size(axes))


def weighted_sum(x_BS: jax.Array, w_BS: jax.Array) -> jax.Array:
    return jnp.sum(x_BS * w_BS)


def scored(targets: jax.Array, weights: jax.Array | None, vocab: int) -> jax.Array:
    """Tokens whose loss is defined: target in [0, vocab), or weight 0 (padding, ignore-index)."""
    ok = (targets >= 0) & (targets < vocab)
    return ok if weights is None else ok | (weights == 0)


# --------------------------------------------------------------------------- argument checks


def known(value) -> np.ndarray | None:
    """`value` as a NumPy array when its value is known now (a Python or NumPy number or array,
    or a concrete JAX array); None while it is traced (inside `jit`, `grad` or `vmap`)."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return None  # spread over several processes: each checks its own part under jit
    return np.asarray(value)


def as_number(value) -> float | None:
    """A real scalar known now (Python, NumPy or a concrete JAX array) as float; None for
    arrays and traced values."""
    if isinstance(value, bool) or value is None:
        return None
    v = known(value)
    if v is None or v.ndim != 0 or v.dtype.kind not in "iuf":
        return None
    return float(v)


def checked(name: str, value, allowed: str, ok: Callable[[Any], Any]):
    """`value` (a number or an array) where `ok(value)` holds everywhere.

    Known now, a value out of range is a ValueError naming `name` (and the first bad entry of
    an array). Traced, its values are unknown, so each entry out of range becomes NaN: the
    result is `value * where(ok, 1, NaN)`, bit for bit `value` (and its gradient) when in range,
    so a loss computed from it is NaN, never a plausible number. `ok` uses only comparison
    operators, which NumPy and traced arrays share.
    """
    v = known(value)
    if v is None:
        return value * jnp.where(ok(value), 1.0, jnp.nan)
    good = np.asarray(ok(v)) if v.dtype.kind in "biuf" else np.zeros(v.shape, bool)
    if not good.all():
        if v.ndim == 0:
            raise ValueError(f"{name} must be {allowed}, got {v.item()!r}")
        where = tuple(int(i) for i in np.argwhere(~good)[0])
        raise ValueError(f"{name} must be {allowed}, got {v[where]} at position {where}")
    return value


def finite_positive(x):
    return (x > 0) & (x < math.inf)


def finite_non_negative(x):
    return (x >= 0) & (x < math.inf)


def check_z(z_loss_multiplier) -> float:
    z = as_number(z_loss_multiplier)
    if z is None or not math.isfinite(z) or z < 0:
        raise ValueError(
            f"z_loss_multiplier must be a static finite number >= 0, got {z_loss_multiplier!r}"
        )
    return z


def check_smoothing(label_smoothing) -> float:
    eps = as_number(label_smoothing)
    if eps is None or not 0.0 <= eps < 1.0:
        raise ValueError(
            f"label_smoothing must be a static number in [0, 1), got {label_smoothing!r}"
        )
    return eps


def check_cap(name: str, cap) -> float | None:
    if cap is None:
        return None
    value = as_number(cap)
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be None or a static finite number > 0, got {cap!r}")
    return value


def check_temperature(temperature):
    """The temperature, finite and > 0 (`checked`: a ValueError, or NaN when traced)."""
    return checked("temperature", temperature, "finite and > 0", finite_positive)


def check_positive_int(name: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        allowed = "an integer >= 1 or None" if optional else "an integer >= 1"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_targets(targets, weights, vocab: int, name: str = "targets_BS"):
    """The weights, finite and >= 0 (`checked`); and, when targets and weights are concrete, a
    ValueError for a target outside [0, vocab) with nonzero weight.

    Under `jit` the values are unknown here: a negative or non-finite weight becomes NaN, and
    the loss of an out-of-range target is NaN (see `CrossEntropy.values`); either makes the
    step non-finite, so the trainer skips it.
    """
    weights = checked("weights_BS", weights, "finite and >= 0", finite_non_negative)
    y, w = known(targets), known(weights)
    if y is None or w is None:
        return weights
    bad = ((y < 0) | (y >= vocab)) & (w != 0)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}: target id {int(y[where])} at position {where} has weight {w[where]} but is "
            f"outside the vocabulary [0, {vocab}); give such tokens weight 0"
        )
    return weights
