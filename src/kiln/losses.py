"""Language-model losses: cross-entropy with z-loss, and a vocabulary-tiled LM loss.

Per token, with logits x over a vocabulary of V, target y, z-loss weight z and label
smoothing eps (target distribution t = (1-eps) onehot(y) + eps/V):

    lse  = log sum_v exp(x_v)
    loss = sum_v t_v (lse - x_v) + z lse^2 = (1-eps)(lse - x_y) + eps (lse - mean(x)) + z lse^2
    d loss / d x = (1 + 2 z lse) softmax(x) - t

The LM loss returns weighted sums (`loss_sum`, `z_loss_sum`, `weight_sum`) so that callers
divide once, after summing over micro-batches.

Tiling (`num_vocab_tiling > 1`) cuts the tokens into chunks; a `lax.scan` over the chunks
computes each chunk's logits, loss and its gradients w.r.t. hidden states and head weight in
the forward pass, then drops the logits. The backward pass only multiplies those saved
gradients by the incoming cotangent, so the tiled loss costs the same matmul FLOPs as the
untiled one (no logits recomputation) and never holds more than one chunk's logits.
`vocab_chunk_size` also cuts the vocabulary: an online logsumexp over vocabulary chunks,
then a second pass that recomputes each chunk's logits for its gradients (4/3 FLOPs).

On a mesh, the tiled loss runs inside `jax.shard_map` rather than under resharding
constraints around a reshape: the chunks are cut from each device's local tokens, so no
token ever moves between devices; the vocabulary stays sharded over the head's `vocab`
mesh axes with the logsumexp combined by `pmax`/`psum` over those axes; head gradients are
`psum`-ed over the token axes once, after the scan. With explicit collectives the
communication is visible in the code and cannot be changed by the partitioner into a
gather of the full logits, which constraints around a reshape would only discourage.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.config import DEFAULT_AXIS_RULES
from kiln.model.interface import _head_logits

__all__ = [
    "cross_entropy",
    "distillation_loss",
    "feature_loss",
    "lm_loss",
    "soft_loss",
    "soft_loss_sums",
]

f32 = jnp.float32


# --------------------------------------------------------------------------- cross-entropy


def _partials(x_NV, hit_NV):
    """Mergeable per-token pieces of float32 logits: (max, sum exp(x - max), x_target, sum x).

    The target logit is a masked sum rather than a gather: it stays local to a vocabulary
    shard or chunk, and an out-of-range target (e.g. on padding) gives a finite loss.
    """
    m_N = jnp.max(x_NV, axis=-1)
    m_N = jnp.where(jnp.isfinite(m_N), m_N, 0.0)
    s_N = jnp.sum(jnp.exp(x_NV - m_N[..., None]), axis=-1)
    x_y = jnp.sum(jnp.where(hit_NV, x_NV, 0.0), axis=-1)
    return m_N, s_N, x_y, jnp.sum(x_NV, axis=-1)


def _merge(a, b):
    """Online logsumexp: combine the `_partials` of two disjoint pieces of the vocabulary."""
    m_N = jnp.maximum(a[0], b[0])
    s_N = a[1] * jnp.exp(a[0] - m_N) + b[1] * jnp.exp(b[0] - m_N)
    return m_N, s_N, a[2] + b[2], a[3] + b[3]


def _token_terms(partials, *, z, eps, vocab, axes=()):
    """(max, sum of exp, lse, loss, z-term) per token from `_partials` of the whole vocabulary.

    `axes` are mesh axes the vocabulary is sharded over (inside `shard_map`).
    """
    m_N, s_N, x_y, sum_x = partials
    if axes:
        m_global = jax.lax.pmax(m_N, axes)
        s_N, m_N = jax.lax.psum(s_N * jnp.exp(m_N - m_global), axes), m_global
        x_y, sum_x = jax.lax.psum((x_y, sum_x), axes) if eps else (jax.lax.psum(x_y, axes), sum_x)
    lse_N = jnp.log(s_N) + m_N  # the operations of jax.nn.logsumexp, so bitwise equal to it
    ce_N = lse_N - x_y
    if eps:
        ce_N = (1.0 - eps) * ce_N + eps * (lse_N - sum_x / vocab)
    if not z:
        return m_N, s_N, lse_N, ce_N, jnp.zeros_like(ce_N)
    z_N = z * jnp.square(lse_N)
    return m_N, s_N, lse_N, ce_N + z_N, z_N


def _logit_grads(x_NV, hit_NV, m_N, s_N, lse_N, ct_loss_N, ct_z_N, *, z, eps, vocab):
    """d(ct_loss * loss + ct_z * z-term)/dx = coef softmax - ct_loss target_dist, float32.

    coef = ct_loss (1 + 2 z lse) + ct_z 2 z lse: the z-gradient scales the pure softmax,
    before the smoothed target is subtracted. softmax = exp(x - max) / sum, not
    exp(x - lse): lse rounded to float32 would cost ~1e-4 relative at logits ~1e4.
    """
    coef_N = ct_loss_N * (1.0 + 2.0 * z * lse_N) + ct_z_N * (2.0 * z * lse_N) if z else ct_loss_N
    g_NV = (coef_N / s_N)[..., None] * jnp.exp(x_NV - m_N[..., None])
    g_NV = g_NV - jnp.where(hit_NV, (1.0 - eps) * ct_loss_N[..., None], 0.0)
    if eps:
        g_NV = g_NV - (eps / vocab) * ct_loss_N[..., None]
    return g_NV


def _targets_hit(vocab, targets):
    return jnp.arange(vocab) == targets[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cross_entropy(logits, targets, z, eps):
    return _cross_entropy_fwd(logits, targets, z, eps)[0]


def _cross_entropy_fwd(logits, targets, z, eps):
    vocab = logits.shape[-1]
    hit = _targets_hit(vocab, targets)
    x = logits.astype(f32)
    m, s, lse, loss, z_term = _token_terms(_partials(x, hit), z=z, eps=eps, vocab=vocab)
    # Logits are an input (already live); the rest is a few floats per token.
    return (loss, z_term), (logits, targets, m, s, lse)


def _cross_entropy_bwd(z, eps, res, cts):
    logits, targets, m, s, lse = res
    vocab = logits.shape[-1]
    ct_loss, ct_z = (c.astype(f32) for c in cts)
    grad = _logit_grads(
        logits.astype(f32),
        _targets_hit(vocab, targets),
        m,
        s,
        lse,
        ct_loss,
        ct_z,
        z=z,
        eps=eps,
        vocab=vocab,
    )
    return grad.astype(logits.dtype), np.zeros(targets.shape, jax.dtypes.float0)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    *,
    z_loss_multiplier: float = 0.0,
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy with z-loss, in float32: logits [..., V], targets [...] int.

    Returns `(loss, z_loss)`, both float32 [...]: `loss = (1-eps)(lse - x_y) +
    eps (lse - mean(x)) + z lse^2` and `z_loss = z lse^2`, lse = logsumexp(x). The gradient
    w.r.t. logits is exactly `(1 + 2 z lse) softmax(x) - ((1-eps) onehot(y) + eps/V)`.
    `z_loss_multiplier` and `label_smoothing` are static Python floats.
    """
    return _cross_entropy(logits, targets, float(z_loss_multiplier), float(label_smoothing))


# --------------------------------------------------------------------------- LM loss


def lm_loss(
    hidden_BSD: jax.Array,
    head_DV: jax.Array,
    targets_BS: jax.Array,
    weights_BS: jax.Array,
    *,
    z_loss_multiplier: float = 0.0,
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    num_vocab_tiling: int = 1,
    mesh: Mesh | None = None,
    rules: dict[str, list[str]] | None = None,
    vocab_chunk_size: int | None = None,
) -> dict[str, jax.Array]:
    """Weighted LM loss sums: hidden [B, S, D], head [D, V], targets [B, S] int, weights [B, S].

    logits = hidden @ head (float32 accumulation), then `cap * tanh(logits / cap)` if
    `logit_softcap`; per-token loss as in `cross_entropy`. Returns float32 scalars
    `loss_sum = sum(w * loss)` (z-term included), `z_loss_sum = sum(w * z lse^2)` and
    `weight_sum = sum(w)`. `num_vocab_tiling > 1` computes the same values and gradients in
    that many token chunks without materialising the logits; on a `mesh`, `rules` (default
    `kiln.config.DEFAULT_AXIS_RULES`) give the mesh axes of `batch`, `length` and `vocab`.
    `vocab_chunk_size` also cuts each shard's vocabulary into chunks of that many entries
    (online logsumexp, then a second pass that recomputes each chunk's logits for the
    gradients: 4/3 of the matmul FLOPs, for loss memory independent of the vocabulary).
    """
    if num_vocab_tiling < 1:
        raise ValueError(f"num_vocab_tiling must be >= 1, got {num_vocab_tiling}")
    if vocab_chunk_size is not None and vocab_chunk_size < 1:
        raise ValueError(f"vocab_chunk_size must be >= 1 or None, got {vocab_chunk_size}")
    if hidden_BSD.ndim != 3 or head_DV.ndim != 2 or hidden_BSD.shape[-1] != head_DV.shape[0]:
        raise ValueError(
            f"expected hidden [B, S, D] and head [D, V], got {hidden_BSD.shape} and {head_DV.shape}"
        )
    cfg = _LossSpec(
        num_chunks=num_vocab_tiling,
        z=float(z_loss_multiplier),
        eps=float(label_smoothing),
        cap=float(logit_softcap) if logit_softcap else None,
        vocab=head_DV.shape[1],
        mesh=mesh,
        vocab_chunk_size=vocab_chunk_size,
        **_mesh_axes(mesh, rules, head_DV.shape[0]),
    )
    if num_vocab_tiling == 1 and not vocab_chunk_size:
        return _untiled(cfg, hidden_BSD, head_DV, targets_BS, weights_BS)
    loss_sum, z_loss_sum, weight_sum = _tiled(cfg, hidden_BSD, head_DV, targets_BS, weights_BS)
    return {"loss_sum": loss_sum, "z_loss_sum": z_loss_sum, "weight_sum": weight_sum}


@dataclasses.dataclass(frozen=True)
class _LossSpec:
    """Static settings of one LM-loss call (hashable: a `nondiff_argnums` of the tiled VJP)."""

    num_chunks: int
    z: float
    eps: float
    cap: float | None
    vocab: int
    mesh: Mesh | None
    vocab_chunk_size: int | None = None
    batch_axes: tuple[str, ...] = ()
    length_axes: tuple[str, ...] = ()
    vocab_axes: tuple[str, ...] = ()
    # Token axes that also shard the head's embed dimension (FSDP): its gradient is
    # reduce-scattered over them instead of all-reduced, as the parameter is stored.
    scatter_axes: tuple[str, ...] = ()

    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.batch_axes + self.length_axes

    def spec(self, kind: str) -> P:
        b, s, v = (self.batch_axes or None), (self.length_axes or None), (self.vocab_axes or None)
        specs = {"BS": P(b, s), "BSD": P(b, s, None), "DV": P(None, v), "BSV": P(b, s, v)}
        return P(self.scatter_axes or None, v) if kind == "dDV" else specs[kind]


def _mesh_axes(mesh: Mesh | None, rules: dict[str, list[str]] | None, d_model: int) -> dict:
    """Mesh axes of the tokens and the vocabulary, resolved like `kiln.mesh.logical_spec`."""
    if mesh is None:
        return {}
    rules = DEFAULT_AXIS_RULES if rules is None else dict(rules)
    used: list[str] = []
    axes = {}
    # As for the logits [batch, length, vocab]: an axis claimed by an earlier dimension is
    # replicated along in a later one (vocab then stays whole on that axis).
    for name, logical in (
        ("batch_axes", "batch"),
        ("length_axes", "length"),
        ("vocab_axes", "vocab"),
    ):
        axes[name] = tuple(a for a in rules.get(logical, ()) if a in mesh.shape and a not in used)
        used += axes[name]
    token_axes = axes["batch_axes"] + axes["length_axes"]
    embed = [a for a in rules.get("embed", ()) if a in mesh.shape and a not in axes["vocab_axes"]]
    # Scatter over a prefix of the embed axes that are all token axes, in the embed order,
    # so the scattered gradient lands where the parameter's shards are.
    scatter: list[str] = []
    for a in embed:
        if a not in token_axes or d_model % math.prod(mesh.shape[b] for b in [*scatter, a]):
            break
        scatter.append(a)
    return {**axes, "scatter_axes": tuple(scatter)}


def _untiled(cfg: _LossSpec, hidden, head, targets, weights) -> dict[str, jax.Array]:
    """Materialised logits -> `cross_entropy`; gradients by autodiff."""
    logits = _promoted_logits(hidden, head)
    if cfg.mesh is not None and _all_auto(cfg.mesh):
        # Keep the vocabulary sharded like the head (explicit meshes propagate it themselves).
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(cfg.mesh, cfg.spec("BSV")))
    if cfg.cap:
        logits = cfg.cap * jnp.tanh(logits / cfg.cap)
    loss, z_loss = cross_entropy(logits, targets, z_loss_multiplier=cfg.z, label_smoothing=cfg.eps)
    w = weights.astype(f32)
    return {
        "loss_sum": _weighted_sum(loss, w),
        "z_loss_sum": _weighted_sum(z_loss, w),
        "weight_sum": jnp.sum(w),
    }


def _weighted_sum(x, w):
    return jnp.sum(x * w)


def _all_auto(mesh: Mesh) -> bool:
    return all(t == AxisType.Auto for t in mesh.axis_types)


def _all_explicit(mesh: Mesh) -> bool:
    return all(t == AxisType.Explicit for t in mesh.axis_types)


# --------------------------------------------------------------------------- tiled LM loss


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(cfg: _LossSpec, hidden, head, targets, weights):
    one, zero = jnp.ones((), f32), jnp.zeros((), f32)
    out = _sharded(cfg, with_grads=False)(hidden, head, targets, weights, one, zero)
    return out[:3]


def _tiled_fwd(cfg: _LossSpec, hidden, head, targets, weights):
    one, zero = jnp.ones((), f32), jnp.zeros((), f32)
    # Gradients of loss_sum (cotangent 1); the backward pass only scales them.
    loss_sum, z_sum, w_sum, loss_tok, z_tok, dh, dw = _sharded(cfg, with_grads=True)(
        hidden, head, targets, weights, one, zero
    )
    return (loss_sum, z_sum, w_sum), (hidden, head, targets, weights, loss_tok, z_tok, dh, dw)


def _tiled_bwd(cfg: _LossSpec, res, cts):
    hidden, head, targets, weights, loss_tok, z_tok, dh, dw = res
    ct_loss, ct_z, ct_w = (c.astype(f32) for c in cts)
    dh, dw = ct_loss * dh, ct_loss * dw
    if cfg.z:
        # z_loss_sum is usually only logged (cotangent 0); when it is differentiated, its
        # gradients need the chunk logits again, so recompute them only in that case.
        def add_z_grads(dh, dw):
            zero = jnp.zeros((), f32)
            out = _sharded(cfg, with_grads=True)(hidden, head, targets, weights, zero, ct_z)
            return dh + out[5], dw + out[6]

        dh, dw = jax.lax.cond(ct_z != 0, add_z_grads, lambda dh, dw: (dh, dw), dh, dw)
    if jnp.issubdtype(weights.dtype, jnp.floating):
        d_weights = (ct_loss * loss_tok + ct_z * z_tok + ct_w).astype(weights.dtype)
    else:
        d_weights = np.zeros(weights.shape, jax.dtypes.float0)
    d_targets = np.zeros(targets.shape, jax.dtypes.float0)
    dh, dw = _like(dh.astype(hidden.dtype), hidden, cfg), _like(dw.astype(head.dtype), head, cfg)
    return dh, dw, d_targets, d_weights


def _like(grad, primal, cfg: _LossSpec):
    """On an explicit mesh, give a gradient the sharding its primal has (a VJP requires it)."""
    if cfg.mesh is None or not _all_explicit(cfg.mesh):
        return grad
    return jax.reshard(grad, NamedSharding(cfg.mesh, jax.typeof(primal).sharding.spec))


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def _sharded(cfg: _LossSpec, with_grads: bool):
    """`_local` on each device's shard of tokens and vocabulary (or on everything)."""
    local = functools.partial(_local, cfg, with_grads)
    if cfg.mesh is None:
        return local
    in_specs = (cfg.spec("BSD"), cfg.spec("DV"), cfg.spec("BS"), cfg.spec("BS"), P(), P())
    out_specs = (P(), P(), P(), cfg.spec("BS"), cfg.spec("BS"))
    if with_grads:
        out_specs += (cfg.spec("BSD"), cfg.spec("dDV"))
    return _shard_mapped(cfg.mesh, local, in_specs, out_specs)


def _shard_mapped(mesh: Mesh, local, in_specs, out_specs):
    """`jax.shard_map` of `local`; on an Explicit mesh the arguments are first moved to the specs."""
    mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def call(*args):
        if _all_explicit(mesh):
            # Explicit meshes type arrays by their sharding: move them to the specs first
            # (for the head this is the FSDP all-gather of its embed dimension).
            args = [jax.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
        return mapped(*args)

    return call


def _shard_tokens(cfg: _LossSpec, batch: int, seq: int) -> int:
    """Tokens of one shard, checked to split into `cfg.num_chunks` equal chunks."""
    tokens = batch * seq
    if tokens % cfg.num_chunks:
        raise ValueError(
            f"num_vocab_tiling={cfg.num_chunks} does not divide the {tokens} tokens "
            f"({batch} x {seq}) of one shard"
        )
    return tokens


def _local(cfg: _LossSpec, with_grads: bool, hidden, head, targets, weights, ct_loss, ct_z):
    """Chunked loss on local tokens [B, S] and a local vocabulary slice of the head.

    Returns (loss_sum, z_sum, weight_sum, loss per token, z-term per token) and, with
    `with_grads`, the gradients w.r.t. hidden (float32 [B, S, D]) and head (float32 [D, V])
    of `ct_loss * loss_sum + ct_z * z_loss_sum`.
    """
    batch, seq, d_model = hidden.shape
    vocab_local = head.shape[1]
    tokens = _shard_tokens(cfg, batch, seq)
    vocab_chunk = cfg.vocab_chunk_size or vocab_local
    if vocab_local % vocab_chunk:
        raise ValueError(
            f"vocab_chunk_size={vocab_chunk} does not divide the {vocab_local} vocabulary "
            f"entries of one shard"
        )
    chunk = tokens // cfg.num_chunks
    z, eps, cap, vocab, axes = cfg.z, cfg.eps, cfg.cap, cfg.vocab, cfg.vocab_axes
    dtype = jnp.promote_types(hidden.dtype, head.dtype)
    varying = functools.partial(_varying, cfg)
    columns = jnp.arange(vocab_local)
    if axes:
        columns = columns + jax.lax.axis_index(axes) * vocab_local
    head = head.astype(dtype)
    n_vchunks = vocab_local // vocab_chunk

    def vocab_slice(x, k):
        """Vocabulary chunk k (of `vocab_chunk` entries) of x along its last axis."""
        return jax.lax.dynamic_slice_in_dim(x, k * vocab_chunk, vocab_chunk, axis=-1)

    def logits(h_nD, w_Dc):
        x_nc = jnp.dot(h_nD, w_Dc, preferred_element_type=f32)
        if not cap:
            return x_nc, None
        tanh_nc = jnp.tanh(x_nc / cap)
        return cap * tanh_nc, tanh_nc

    def grads(x_nc, tanh_nc, hit_nc, terms, w_n):
        m_n, s_n, lse_n = terms[:3]
        g_nc = _logit_grads(
            x_nc, hit_nc, m_n, s_n, lse_n, w_n * ct_loss, w_n * ct_z, z=z, eps=eps, vocab=vocab
        )
        if cap:
            g_nc = g_nc * (1.0 - jnp.square(tanh_nc))
        # Matmul operands in the compute dtype; accumulation in float32.
        return g_nc.astype(dtype)

    def step_whole_vocab(dw, h_nD, y_n, w_n):
        """One pass: logits of the whole local vocabulary, then their gradients."""
        x_nV, tanh_nV = logits(h_nD, head)
        hit_nV = columns == y_n[:, None]
        terms = _token_terms(_partials(x_nV, hit_nV), z=z, eps=eps, vocab=vocab, axes=axes)
        if not with_grads:
            return dw, terms, None
        g_nV = grads(x_nV, tanh_nV, hit_nV, terms, w_n)
        dh_nD = jnp.dot(g_nV, head.T, preferred_element_type=f32)
        dw = dw + jnp.dot(h_nD.T.astype(dtype), g_nV, preferred_element_type=f32)
        return dw, terms, dh_nD

    def step_vocab_chunks(dw, h_nD, y_n, w_n):
        """Two passes over vocabulary chunks: online logsumexp, then recomputed logits' grads."""

        def stats(acc, k):
            x_nc, _ = logits(h_nD, vocab_slice(head, k))
            return _merge(acc, _partials(x_nc, vocab_slice(columns, k) == y_n[:, None])), None

        zero_n = varying(jnp.zeros(y_n.shape, f32))
        acc = (zero_n - jnp.inf, zero_n, zero_n, zero_n)
        acc, _ = jax.lax.scan(stats, acc, jnp.arange(n_vchunks))
        terms = _token_terms(acc, z=z, eps=eps, vocab=vocab, axes=axes)
        if not with_grads:
            return dw, terms, None

        def backprop(carry, k):
            dh_nD, dw = carry
            w_Dc = vocab_slice(head, k)
            x_nc, tanh_nc = logits(h_nD, w_Dc)
            g_nc = grads(x_nc, tanh_nc, vocab_slice(columns, k) == y_n[:, None], terms, w_n)
            dh_nD = dh_nD + jnp.dot(g_nc, w_Dc.T, preferred_element_type=f32)
            dw_Dc = vocab_slice(dw, k) + jnp.dot(
                h_nD.T.astype(dtype), g_nc, preferred_element_type=f32
            )
            dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_Dc, k * vocab_chunk, axis=1)
            return (dh_nD, dw), None

        dh_nD = varying(jnp.zeros(h_nD.shape, f32))
        (dh_nD, dw), _ = jax.lax.scan(backprop, (dh_nD, dw), jnp.arange(n_vchunks))
        return dw, terms, dh_nD

    step_fn = step_whole_vocab if n_vchunks == 1 else step_vocab_chunks

    def step(dw, xs):
        dw, terms, dh_nD = step_fn(dw, *xs)
        loss_n, z_n = terms[3:]
        return dw, (loss_n, z_n) if not with_grads else (loss_n, z_n, dh_nD)

    xs = (
        hidden.reshape(cfg.num_chunks, chunk, d_model),
        targets.reshape(cfg.num_chunks, chunk),
        weights.astype(f32).reshape(cfg.num_chunks, chunk),
    )
    dw, ys = jax.lax.scan(step, varying(jnp.zeros(head.shape, f32)), xs)
    loss_tok, z_tok = ys[0].reshape(batch, seq), ys[1].reshape(batch, seq)
    w = xs[2].reshape(batch, seq)
    token_axes = cfg.token_axes
    out = (
        _psum(_weighted_sum(loss_tok, w), token_axes),
        _psum(_weighted_sum(z_tok, w), token_axes),
        _psum(jnp.sum(w), token_axes),
        loss_tok,
        z_tok,
    )
    if with_grads:
        out += _reduce_grads(cfg, ys[2].reshape(batch, seq, d_model), dw, axes)
    return out


def _reduce_grads(cfg: _LossSpec, dh_local, dw_local, axes):
    """Chunk gradients of one shard -> (hidden grads summed over `axes`, head grads summed over
    the token axes, reduce-scattered over those that also shard the head's embed dimension)."""
    scatter = cfg.scatter_axes
    dw = _psum(dw_local, tuple(a for a in cfg.token_axes if a not in scatter))
    if scatter:
        dw = jax.lax.psum_scatter(dw, scatter, scatter_dimension=0, tiled=True)
    return _psum(dh_local, axes), dw


def _varying(cfg: _LossSpec, x):
    """Inside shard_map, mark a fresh scan carry as varying over the mesh axes it will."""
    axes = cfg.token_axes + cfg.vocab_axes
    return jax.lax.pcast(x, axes, to="varying") if cfg.mesh is not None and axes else x


def _psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def _pmax(x, axes):
    return jax.lax.pmax(x, axes) if axes else x


# --------------------------------------------------------------------------- distillation


def soft_loss(
    student_logits: jax.Array, teacher_logits: jax.Array, temperature: float | jax.Array
) -> jax.Array:
    """Per-token `T^2 KL(p_t || p_s)`, float32: logits [..., V] -> [...].

    p_t = softmax(teacher / T), p_s = softmax(student / T):
    `T^2 sum_v p_t,v (log p_t,v - log p_s,v)`. The gradient w.r.t. student logits is
    `T (p_s - p_t)`; the T^2 keeps it on the scale of the hard loss's as T changes.
    """
    t = jnp.asarray(temperature, f32)
    a, b = teacher_logits.astype(f32) / t, student_logits.astype(f32) / t
    return t * t * _kl(a, b, axes=())[0]


def _kl(a_NV, b_NV, axes):
    """KL(softmax(a) || softmax(b)) per token, and both softmaxes; vocabulary sharded over `axes`.

    Written as `sum_v p_a (a - b) - (m_a - m_b) - log(s_a / s_b)` with m the maxima and
    s = sum exp(x - m): the two log-normalisers (about log V each) enter as one log of a
    ratio near 1, so a small KL keeps float32 precision instead of losing it to a difference
    of two rounded logsumexps. Maxima are constants (their gradients cancel exactly).
    """
    sg = jax.lax.stop_gradient
    m_a = sg(_pmax(jnp.max(a_NV, axis=-1), axes))
    m_b = sg(_pmax(jnp.max(b_NV, axis=-1), axes))
    e_a, e_b = jnp.exp(a_NV - m_a[..., None]), jnp.exp(b_NV - m_b[..., None])
    s_a = _psum(jnp.sum(e_a, axis=-1), axes)
    s_b = _psum(jnp.sum(e_b, axis=-1), axes)
    cross = _psum(jnp.sum(e_a * (a_NV - b_NV), axis=-1), axes) / s_a
    kl = cross - (m_a - m_b) - jnp.log(s_a / s_b)
    return kl, e_a / s_a[..., None], e_b / s_b[..., None]


def feature_loss(student_PBSD: jax.Array, teacher_PBSD: jax.Array, kind: str) -> jax.Array:
    """Per-token distance of hidden states, averaged over the P layer pairs: [P,B,S,D] -> [B,S].

    cosine: `1 - <s, t> / (|s| |t|)` (norms clamped at 1e-6); mse: `mean_d (s_d - t_d)^2`.
    Float32. Student states come already projected to the teacher's width.
    """
    if student_PBSD.shape != teacher_PBSD.shape:
        raise ValueError(f"feature shapes differ: {student_PBSD.shape} vs {teacher_PBSD.shape}")
    s, t = student_PBSD.astype(f32), teacher_PBSD.astype(f32)
    if kind == "mse":
        d_PBS = jnp.mean(jnp.square(s - t), axis=-1)
    elif kind == "cosine":
        norm_s = jnp.sqrt(jnp.maximum(jnp.sum(s * s, axis=-1), 1e-12))
        norm_t = jnp.sqrt(jnp.maximum(jnp.sum(t * t, axis=-1), 1e-12))
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total loss from per-token means of the hard, soft and feature losses; and the scales.

    balance "none":    total = (1 - alpha) hard + alpha soft + beta feature
    balance "dynamic": feature_mag_scale = sg(soft) / sg(feature)
                       kd = soft + feature_mag_scale feature
                       kd_mag_scale = sg(hard) / sg(kd)
                       total = hard + alpha kd_mag_scale kd
    sg = stop_gradient; a ratio with a zero denominator is 0. `total` is linear in (hard, soft,
    feature) with stop-gradient coefficients, so its gradient is
    d hard + alpha (hard / kd) (d soft + (soft / feature) d feature) under "dynamic". With
    "none" the two scales are returned for reference only.
    """
    sg = jax.lax.stop_gradient
    feature_mag_scale = _ratio(sg(soft), sg(feature))
    kd = soft + feature_mag_scale * feature
    kd_mag_scale = _ratio(sg(hard), sg(kd))
    if balance == "none":
        total = (1.0 - alpha) * hard + alpha * soft + beta * feature
    elif balance == "dynamic":
        total = hard + alpha * kd_mag_scale * kd
    else:
        raise ValueError(f"balance must be 'none' or 'dynamic', got {balance!r}")
    return total, {"feature_mag_scale": feature_mag_scale, "kd_mag_scale": kd_mag_scale}


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
) -> dict[str, jax.Array]:
    """Weighted sums of the soft loss and of the teacher's cross-entropy, float32 scalars.

    Logits are hidden @ head of each model (softcapped as each model is), `soft_sum =
    sum(w * soft_loss(student, teacher, T))` and `teacher_loss_sum = sum(w * CE(teacher))`
    (no z-loss, no smoothing). Only the student receives gradients: teacher inputs and the
    temperature are constants. `num_vocab_tiling > 1` gives the same values and gradients
    from token chunks, each chunk's student and teacher logits made and dropped in turn,
    under `shard_map` on a `mesh` exactly as `lm_loss`'s tiled path.
    """
    if num_vocab_tiling < 1:
        raise ValueError(f"num_vocab_tiling must be >= 1, got {num_vocab_tiling}")
    if student_head_DV.shape[1] != teacher_head_EV.shape[1]:
        raise ValueError(
            f"vocabularies differ: student head {student_head_DV.shape}, "
            f"teacher head {teacher_head_EV.shape}"
        )
    sg = jax.lax.stop_gradient
    teacher_hidden_BSE, teacher_head_EV = sg(teacher_hidden_BSE), sg(teacher_head_EV)
    temperature = sg(jnp.asarray(temperature, f32))
    spec = _SoftSpec(
        loss=_LossSpec(
            num_chunks=num_vocab_tiling,
            z=0.0,
            eps=0.0,
            cap=float(student_softcap) if student_softcap else None,
            vocab=student_head_DV.shape[1],
            mesh=mesh,
            **_mesh_axes(mesh, rules, student_head_DV.shape[0]),
        ),
        teacher_cap=float(teacher_softcap) if teacher_softcap else None,
    )
    args = (student_hidden_BSD, student_head_DV, teacher_hidden_BSE, teacher_head_EV)
    if num_vocab_tiling == 1:
        return _soft_untiled(spec, *args, targets_BS, weights_BS, temperature)
    soft_sum, teacher_sum = _soft_tiled(spec, *args, targets_BS, weights_BS, temperature)
    return {"soft_sum": soft_sum, "teacher_loss_sum": teacher_sum}


@dataclasses.dataclass(frozen=True)
class _SoftSpec:
    """Static settings of one soft-loss call: the student's `_LossSpec` and the teacher's cap."""

    loss: _LossSpec
    teacher_cap: float | None


def _promoted_logits(h, w):
    """float32 logits h @ w in the wider of the two dtypes (the model's one head matmul)."""
    dtype = jnp.promote_types(h.dtype, w.dtype)
    return _head_logits(h.astype(dtype), w.astype(dtype), None)


def _capped_logits(h, w, cap, cfg: _LossSpec):
    logits = _promoted_logits(h, w)
    if cfg.mesh is not None and _all_auto(cfg.mesh):
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(cfg.mesh, cfg.spec("BSV")))
    return cap * jnp.tanh(logits / cap) if cap else logits


def _soft_untiled(spec: _SoftSpec, hs, ws, ht, wt, targets, weights, temperature):
    """Both models' logits whole, `soft_loss` and `cross_entropy`; gradients by autodiff."""
    cfg = spec.loss
    student = _capped_logits(hs, ws, cfg.cap, cfg)
    teacher = _capped_logits(ht, wt, spec.teacher_cap, cfg)
    w = weights.astype(f32)
    return {
        "soft_sum": _weighted_sum(soft_loss(student, teacher, temperature), w),
        "teacher_loss_sum": _weighted_sum(cross_entropy(teacher, targets)[0], w),
    }


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _soft_tiled(spec: _SoftSpec, hs, ws, ht, wt, targets, weights, temperature):
    return _soft_sharded(spec, with_grads=False)(hs, ws, ht, wt, targets, weights, temperature)[:2]


def _soft_tiled_fwd(spec: _SoftSpec, hs, ws, ht, wt, targets, weights, temperature):
    # Gradients of soft_sum (cotangent 1), made chunk by chunk; the backward pass scales them.
    out = _soft_sharded(spec, with_grads=True)(hs, ws, ht, wt, targets, weights, temperature)
    soft_sum, teacher_sum, soft_tok, teacher_tok, dh, dw = out
    res = (hs, ws, ht, wt, targets, weights, temperature, soft_tok, teacher_tok, dh, dw)
    return (soft_sum, teacher_sum), res


def _soft_tiled_bwd(spec: _SoftSpec, res, cts):
    hs, ws, ht, wt, targets, weights, temperature, soft_tok, teacher_tok, dh, dw = res
    cfg = spec.loss
    ct_soft, ct_teacher = (c.astype(f32) for c in cts)
    dh = _like((ct_soft * dh).astype(hs.dtype), hs, cfg)
    dw = _like((ct_soft * dw).astype(ws.dtype), ws, cfg)
    if jnp.issubdtype(weights.dtype, jnp.floating):
        d_weights = (ct_soft * soft_tok + ct_teacher * teacher_tok).astype(weights.dtype)
    else:
        d_weights = np.zeros(weights.shape, jax.dtypes.float0)
    # The teacher and the temperature are constants (stop_gradient in `soft_loss_sums`).
    return (
        dh,
        dw,
        jnp.zeros_like(ht),
        jnp.zeros_like(wt),
        np.zeros(targets.shape, jax.dtypes.float0),
        d_weights,
        jnp.zeros_like(temperature),
    )


_soft_tiled.defvjp(_soft_tiled_fwd, _soft_tiled_bwd)


def _soft_sharded(spec: _SoftSpec, with_grads: bool):
    """`_soft_local` on each device's shard of tokens and vocabulary (or on everything)."""
    cfg = spec.loss
    local = functools.partial(_soft_local, spec, with_grads)
    if cfg.mesh is None:
        return local
    bsd, dv, bs = cfg.spec("BSD"), cfg.spec("DV"), cfg.spec("BS")
    in_specs = (bsd, dv, bsd, dv, bs, bs, P())
    out_specs = (P(), P(), bs, bs)
    if with_grads:
        out_specs += (bsd, cfg.spec("dDV"))
    return _shard_mapped(cfg.mesh, local, in_specs, out_specs)


def _soft_local(spec: _SoftSpec, with_grads: bool, hs, ws, ht, wt, targets, weights, temperature):
    """Chunked soft loss on local tokens and a local vocabulary slice of both heads.

    Returns (soft_sum, teacher_sum, soft per token, teacher CE per token) and, with
    `with_grads`, the float32 gradients of soft_sum w.r.t. the student hidden and head.
    Per chunk: d soft / d student logits = w T (p_s - p_t) (times 1 - tanh^2 if capped).
    """
    cfg = spec.loss
    batch, seq, d_model = hs.shape
    vocab_local = ws.shape[1]
    tokens = _shard_tokens(cfg, batch, seq)
    chunk = tokens // cfg.num_chunks
    axes, cap, teacher_cap, t = cfg.vocab_axes, cfg.cap, spec.teacher_cap, temperature
    s_dtype = jnp.promote_types(hs.dtype, ws.dtype)
    ws_c = ws.astype(s_dtype)
    wt_c = wt.astype(jnp.promote_types(ht.dtype, wt.dtype))
    columns = jnp.arange(vocab_local)
    if axes:
        columns = columns + jax.lax.axis_index(axes) * vocab_local

    def step(dw, xs):
        h_nD, g_nE, y_n, w_n = xs
        xs_nV = jnp.dot(h_nD, ws_c, preferred_element_type=f32)
        tanh_nV = None
        if cap:
            tanh_nV = jnp.tanh(xs_nV / cap)
            xs_nV = cap * tanh_nV
        xt_nV = jnp.dot(g_nE, wt_c, preferred_element_type=f32)
        if teacher_cap:
            xt_nV = teacher_cap * jnp.tanh(xt_nV / teacher_cap)
        partials = _partials(xt_nV, columns == y_n[:, None])
        teacher_n = _token_terms(partials, z=0.0, eps=0.0, vocab=cfg.vocab, axes=axes)[3]
        kl_n, p_t, p_s = _kl(xt_nV / t, xs_nV / t, axes)
        soft_n = t * t * kl_n
        if not with_grads:
            return dw, (soft_n, teacher_n)
        g_nV = (w_n * t)[:, None] * (p_s - p_t)
        if cap:
            g_nV = g_nV * (1.0 - jnp.square(tanh_nV))
        g_nV = g_nV.astype(s_dtype)
        dh_nD = jnp.dot(g_nV, ws_c.T, preferred_element_type=f32)
        dw = dw + jnp.dot(h_nD.T.astype(s_dtype), g_nV, preferred_element_type=f32)
        return dw, (soft_n, teacher_n, dh_nD)

    xs = (
        hs.reshape(cfg.num_chunks, chunk, d_model),
        ht.reshape(cfg.num_chunks, chunk, ht.shape[-1]),
        targets.reshape(cfg.num_chunks, chunk),
        weights.astype(f32).reshape(cfg.num_chunks, chunk),
    )
    dw, ys = jax.lax.scan(step, _varying(cfg, jnp.zeros(ws.shape, f32)), xs)
    soft_tok, teacher_tok = ys[0].reshape(batch, seq), ys[1].reshape(batch, seq)
    w = xs[3].reshape(batch, seq)
    token_axes = cfg.token_axes
    out = (
        _psum(_weighted_sum(soft_tok, w), token_axes),
        _psum(_weighted_sum(teacher_tok, w), token_axes),
        soft_tok,
        teacher_tok,
    )
    if with_grads:
        out += _reduce_grads(cfg, ys[2].reshape(batch, seq, d_model), dw, axes)
    return out
