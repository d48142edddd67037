"""The one tiled loss engine: token chunks (and vocabulary chunks) with per-chunk loss callbacks.

A `lax.scan` over chunks of each device's tokens makes each chunk's logits (student, and
teacher if there is one; a teacher's stored top-k rows ride along instead of its logits), hands
them to the loss callbacks, forms the gradient w.r.t. the
student's logits of every requested combination of the losses ("gradient sets"), multiplies
it into hidden-state and head gradients, and drops the logits. The backward pass of the
custom VJP only scales those saved gradients by the incoming cotangents, so the tiled loss
costs the matmul FLOPs of the untiled one and never holds more than one chunk's logits.

A loss callback (`CrossEntropy`, `SoftKL`, `TopKKL`) provides, per token, mergeable statistics of the
logits (`stats`, `merge`, `reduce`), sums that need those statistics first (`sums`), the
per-token values, and `dlogits`. With `vocab_chunk` each shard's vocabulary is cut too: a
first pass merges the statistics of the vocabulary chunks (an online logsumexp), a second
recomputes each chunk's logits for the sums and gradients (4/3 of the matmul FLOPs).

On a mesh the loop runs inside `jax.shard_map`: chunks are cut from each device's local tokens,
so no token moves; the vocabulary stays sharded over the head's `vocab` mesh axes, with
statistics combined by `pmax`/`psum` over them; head gradients are `psum`-ed over the token
axes (reduce-scattered over those that also shard the head's embed dimension) once, after
the scan. Explicit collectives keep the partitioner from gathering the full logits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.losses.core import (
    ChunkLogits,
    TopK,
    f32,
    logits,
    psum,
    scored,
    softcap_grad,
    weighted_sum,
)
from kiln.losses.tiling import Inputs, Tiling, all_explicit
from kiln.losses.top_k import block_columns

# Per-token terms that can carry a gradient to the student, and the sums they give.
DIFFERENTIABLE = ("loss", "z_loss", "soft")


class Local(NamedTuple):
    """The chunk loop's results on one shard (sums already combined over the mesh)."""

    terms: dict[str, jax.Array]  # per-token [B, S]
    sums: dict[str, jax.Array]  # "<term>_sum" and "weight_sum", float32 scalars
    dh: jax.Array | None  # [K, B, S, D] float32, one per gradient set
    dw: jax.Array | None  # [K, D, V] float32


# --------------------------------------------------------------------------- the chunk loop


def _varying(tiling: Tiling, x):
    """Inside shard_map, mark a fresh scan carry as varying over the mesh axes it will."""
    axes = tiling.axes.tokens + tiling.axes.vocab
    return jax.lax.pcast(x, axes, to="varying") if tiling.mesh is not None and axes else x


def _local(tiling: Tiling, with_grads: bool, inputs: Inputs, coefs) -> Local:
    """The chunk loop on local tokens [B, S] and a local vocabulary slice of the heads."""
    hs, ws, targets, weights, ht, wt, temp, top = inputs
    batch, seq, d_model = hs.shape
    vocab_local = ws.shape[1]
    plan = tiling.schedule
    assert plan.rows == batch * seq and vocab_local % plan.vocab_chunk == 0, (plan, hs.shape)
    chunk, block, vchunk = plan.chunk, plan.block, plan.vocab_chunk
    n_vchunks = vocab_local // vchunk
    axes, losses = tiling.axes.vocab, tiling.losses
    dtype = ws.dtype  # the head matmuls' input dtype, as in `logits`
    columns = jnp.arange(vocab_local)
    if axes:
        columns = columns + jax.lax.axis_index(axes) * vocab_local
    offsets = np.cumsum([0] + [len(s) for s in tiling.sets])

    def vslice(x, k):
        """Vocabulary chunk k of x along its last axis (all of it without vocabulary chunks)."""
        return x if k is None else jax.lax.dynamic_slice_in_dim(x, k * vchunk, vchunk, axis=-1)

    def head_logits(h_n, g_n, k):
        """The student's (and the teacher's) logits of tokens [n] on vocabulary chunk k."""
        x_s = logits(h_n, vslice(ws, k), softcap=tiling.student_cap)
        x_t = None if wt is None else logits(g_n, vslice(wt, k), softcap=tiling.teacher_cap)
        return x_s, x_t

    def view(x_s, x_t, y_n, top_n, k) -> ChunkLogits:
        whole = k is None and vocab_local == tiling.vocab  # each row's whole vocabulary
        target = y_n if whole else None
        cols = vslice(columns, k)
        top_col = None if top_n is None else block_columns(top_n.ids, cols[0], cols.shape[0])
        return ChunkLogits(x_s, x_t, cols == y_n[:, None], temp, target, top_n, top_col)

    def chunk_logits(h_n, g_n, y_n, top_n, k) -> ChunkLogits:
        return view(*head_logits(h_n, g_n, k), y_n, top_n, k)

    def logit_grads(lg, stats, w_n):
        """Per gradient set: the gradient of its losses w.r.t. the student's logits [n, c],
        in the head's dtype (the products' operands)."""
        grads = []
        for k, names in enumerate(tiling.sets):
            cts = {t: w_n * coefs[offsets[k] + i] for i, t in enumerate(names)}
            parts = [loss.dlogits(lg, st, cts) for loss, st in zip(losses, stats)]
            g = sum(p for p in parts if p is not None)
            grads.append(softcap_grad(g, lg.student, tiling.student_cap).astype(dtype))
        return tuple(grads)

    def products(grads, h_n, w_Dc):
        """Each logit gradient [n, c] times the head and the hidden states: K-tuples of [n, D]
        and [D, c] float32 (plain 2-D dots: a batched einsum over K made XLA's CPU dots twice
        as slow); accumulation in float32."""
        h_Dn = h_n.T.astype(dtype)
        dh = tuple(jnp.dot(g, w_Dc.T, preferred_element_type=f32) for g in grads)
        dw = tuple(jnp.dot(h_Dn, g, preferred_element_type=f32) for g in grads)
        return dh, dw

    def add(xs, ys):
        return tuple(x + y for x, y in zip(xs, ys))

    def chunk_sums(lg, stats):
        return tuple(loss.sums(lg, st) for loss, st in zip(losses, stats))

    def token_terms(stats, sums, y_n, w_n):
        ok = scored(y_n, w_n, tiling.vocab)
        terms = {}
        for loss, st, sm in zip(losses, stats, sums):
            terms.update(loss.values(st, sm, ok, temp))
        return terms

    def rows(x_s, x_t, y_n, w_n, top_n):
        """Per-token terms and logit gradients of rows whose logits hold the shard's vocabulary."""
        lg = view(x_s, x_t, y_n, top_n, None)
        stats = tuple(loss.stats(lg, axes) for loss in losses)
        terms = token_terms(stats, psum(chunk_sums(lg, stats), axes), y_n, w_n)
        return terms, (logit_grads(lg, stats, w_n) if with_grads else None)

    def whole_vocabulary(h_n, g_n, y_n, w_n, top_n, bufs):
        """One chunk's logits made whole (one product per model), then its element-wise work in
        blocks of `block` rows (the `cpu_blocked` schedule), each block's logit gradients written
        into its rows of `bufs` (one [chunk, c] buffer per gradient set, reused from chunk to
        chunk)."""
        x_s, x_t = head_logits(h_n, g_n, None)
        xs = (x_s, x_t, y_n, w_n, top_n)
        if block == chunk:
            return rows(*xs)

        def one_block(bufs, i):
            # The block is sliced in the loop body, not handed in as a scanned input: the
            # element-wise passes then read its rows where they lie (a scanned input is copied
            # out first, and its unrolled pair once more).
            b = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i * block, block), xs)
            terms, grads = rows(*b)
            put = functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=0)
            return tuple(put(buf, g, i * block) for buf, g in zip(bufs, grads or ())), terms

        # Two blocks per iteration: their independent work can run on two threads at once.
        bufs, terms = jax.lax.scan(one_block, bufs, jnp.arange(chunk // block), unroll=2)
        return {t: v.reshape(chunk) for t, v in terms.items()}, (bufs if with_grads else None)

    def step(carry, xs):
        dw, bufs = carry
        h_n, g_n, y_n, w_n, top_n = xs
        dh_n = None
        if n_vchunks == 1:
            terms, grads = whole_vocabulary(h_n, g_n, y_n, w_n, top_n, bufs)
            if with_grads:
                dh_n, dw_add = products(grads, h_n, ws)
                dw = add(dw, dw_add)
                bufs = grads if block < chunk else bufs
            return (dw, bufs), (terms, dh_n)

        def merge_chunk(acc, k):
            lg = chunk_logits(h_n, g_n, y_n, top_n, k)
            return tuple(ls.merge(a, ls.stats(lg, ())) for ls, a in zip(losses, acc)), None

        lg0 = chunk_logits(h_n, g_n, y_n, top_n, 0)
        first = tuple(loss.stats(lg0, ()) for loss in losses)
        stats, _ = jax.lax.scan(merge_chunk, first, jnp.arange(1, n_vchunks))
        stats = tuple(loss.reduce(st, axes) for loss, st in zip(losses, stats))
        zero = jax.tree.map(
            lambda s: _varying(tiling, jnp.zeros(s.shape, s.dtype)),
            jax.eval_shape(chunk_sums, lg0, stats),
        )
        needs_pass = with_grads or jax.tree.leaves(zero)

        def second_pass(carry, k):
            sums, dh_n, dw = carry
            lg = chunk_logits(h_n, g_n, y_n, top_n, k)
            sums = jax.tree.map(jnp.add, sums, chunk_sums(lg, stats))
            if with_grads:
                dh_k, dw_k = products(logit_grads(lg, stats, w_n), h_n, vslice(ws, k))
                dw = tuple(
                    jax.lax.dynamic_update_slice_in_dim(a, vslice(a, k) + b, k * vchunk, -1)
                    for a, b in zip(dw, dw_k)
                )
                dh_n = add(dh_n, dh_k)
            return (sums, dh_n, dw), None

        sums = zero
        if needs_pass:
            dh0 = tuple(_varying(tiling, jnp.zeros((chunk, d_model), f32)) for _ in tiling.sets)
            carry = (zero, dh0 if with_grads else None, dw)
            (sums, dh_n, dw), _ = jax.lax.scan(second_pass, carry, jnp.arange(n_vchunks))
        terms = token_terms(stats, psum(sums, axes), y_n, w_n)
        return (dw, bufs), (terms, dh_n)

    def cut(x, fill=None):
        """[B, S, ...] -> [chunks, chunk, ...]; a last chunk the rows do not fill takes copies of
        the last row (`fill`: a constant instead), which weight 0 keeps out of every result."""
        if x is None:
            return None
        flat = x.reshape(plan.rows, *x.shape[2:])
        if plan.padding:
            widths = [(0, plan.padding)] + [(0, 0)] * (flat.ndim - 1)
            if fill is None:
                flat = jnp.pad(flat, widths, mode="edge")
            else:
                flat = jnp.pad(flat, widths, constant_values=fill)
        return flat.reshape(plan.num_chunks, chunk, *flat.shape[1:])

    def uncut(x):
        """[chunks, chunk, ...] -> the shard's rows [B * S, ...], padding dropped."""
        return x.reshape(plan.num_chunks * chunk, *x.shape[2:])[: plan.rows]

    dw0, bufs0 = None, ()
    if with_grads:
        dw0 = tuple(_varying(tiling, jnp.zeros((d_model, vocab_local), f32)) for _ in tiling.sets)
        if n_vchunks == 1 and block < chunk:
            # The logit gradients of every chunk's blocks land in the same buffers.
            bufs0 = tuple(
                _varying(tiling, jnp.zeros((chunk, vocab_local), dtype)) for _ in tiling.sets
            )
    w = weights.astype(f32)
    xs = (cut(hs), cut(ht), cut(targets), cut(w, fill=0.0), jax.tree.map(cut, top))
    (dw, _), (terms, dh) = jax.lax.scan(step, (dw0, bufs0), xs)
    terms = {k: uncut(v).reshape(batch, seq) for k, v in terms.items()}
    token_axes = tiling.axes.tokens
    sums = {f"{k}_sum": psum(weighted_sum(v, w), token_axes) for k, v in terms.items()}
    sums["weight_sum"] = psum(jnp.sum(w), token_axes)
    if not with_grads:
        return Local(terms, sums, None, None)
    dh = psum(jnp.stack([uncut(g).reshape(batch, seq, d_model) for g in dh]), axes)
    scatter = tiling.axes.scatter
    dw = psum(jnp.stack(dw), tuple(a for a in token_axes if a not in scatter))
    if scatter:
        dw = jax.lax.psum_scatter(dw, scatter, scatter_dimension=1, tiled=True)
    return Local(terms, sums, dh, dw)


def _reshard(a, spec, mesh):
    """An input (or the top-k's arrays) moved to its spec on an explicit mesh."""
    if a is None:
        return None
    if isinstance(a, TopK):
        return TopK(*(_reshard(x, s, mesh) for x, s in zip(a, spec)))
    return jax.reshard(a, NamedSharding(mesh, spec))


def _sharded(tiling: Tiling, with_grads: bool):
    """`_local` on each device's shard of tokens and vocabulary (or on everything)."""
    local = functools.partial(_local, tiling, with_grads)
    mesh = tiling.mesh
    if mesh is None:
        return local
    ax = tiling.axes
    bsd, dv, bs = ax.spec("BSD"), ax.spec("DV"), ax.spec("BS")
    teacher = (bsd, dv, P(), TopK(bsd, bsd, bs))
    out_specs = Local(
        {t: bs for t in tiling.terms},
        {k: P() for k in [*(f"{t}_sum" for t in tiling.terms), "weight_sum"]},
        ax.spec("KBSD") if with_grads else None,
        ax.spec("KDV") if with_grads else None,
    )

    def call(inputs: Inputs, coefs):
        # The head is gathered (FSDP) for the loss once the hidden states are there, not at
        # the start of the step, where XLA would otherwise hold it through the forward pass.
        hidden, head = jax.lax.optimization_barrier((inputs.hidden, inputs.head))
        inputs = inputs._replace(hidden=hidden, head=head)
        specs = Inputs(
            bsd, dv, bs, bs, *(s if a is not None else None for s, a in zip(teacher, inputs[4:]))
        )
        if all_explicit(mesh):
            # Explicit meshes type arrays by their sharding: move them to the specs first
            # (for the head this is the FSDP all-gather of its embed dimension).
            inputs = Inputs(*(_reshard(a, s, mesh) for a, s in zip(inputs, specs)))
            coefs = jax.reshard(coefs, NamedSharding(mesh, P()))
        mapped = jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=out_specs)
        return mapped(inputs, coefs)

    return call


# --------------------------------------------------------------------------- the custom VJP


def run(tiling: Tiling, inputs: Inputs, coefs: jax.Array) -> dict[str, jax.Array]:
    """Sums `<term>_sum` and `weight_sum` (and `objective_sum`), differentiable as documented."""
    return _tiled(tiling, inputs, jax.lax.stop_gradient(coefs.astype(f32)))


def _with_objective(tiling: Tiling, sums: dict, coefs) -> dict:
    if tiling.objective:
        names = tiling.sets[0]
        sums = {
            **sums,
            "objective_sum": sum(coefs[i] * sums[f"{t}_sum"] for i, t in enumerate(names)),
        }
    return sums


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(tiling: Tiling, inputs: Inputs, coefs):
    return _with_objective(tiling, _sharded(tiling, False)(inputs, coefs).sums, coefs)


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _primal(x):
    return x.value if _is_primal(x) else x


def _tiled_fwd(tiling: Tiling, inputs: Inputs, coefs):
    inputs, coefs = jax.tree.map(_primal, (inputs, coefs), is_leaf=_is_primal)
    out = _sharded(tiling, True)(inputs, coefs)
    # Both gradients are finished together: XLA would otherwise leave the head gradient's
    # reduce-scatter until the backward pass needs it, holding the unscattered [D, V] until then.
    dh, dw = jax.lax.optimization_barrier((out.dh, out.dw))
    return _with_objective(tiling, out.sums, coefs), (inputs, coefs, out.terms, dh, dw)


def _tiled_bwd(tiling: Tiling, res, cts):
    inputs, coefs, terms, dh, dw = res
    # A sum nothing differentiates arrives as a symbolic zero (z_loss_sum, usually only logged).
    skipped = {k for k, c in cts.items() if isinstance(c, SymbolicZero)}
    ct = {k: jnp.zeros((), f32) if k in skipped else c.astype(f32) for k, c in cts.items()}
    differentiated = [ct[f"{t}_sum"] for t in DIFFERENTIABLE if f"{t}_sum" in ct]
    if tiling.objective:
        dh, dw = ct["objective_sum"] * dh[0], ct["objective_sum"] * dw[0]
        # Only objective_sum's gradient was made: any other cotangent poisons the gradients.
        wrong = functools.reduce(jnp.logical_or, [c != 0 for c in differentiated], False)
        dh, dw = jnp.where(wrong, jnp.nan, dh), jnp.where(wrong, jnp.nan, dw)
    else:
        scale = [ct[f"{names[0]}_sum"] for names in tiling.sets]
        dh = sum(c * g for c, g in zip(scale, dh))
        dw = sum(c * g for c, g in zip(scale, dw))
        if "z_loss_sum" not in skipped:
            dh, dw = _add_z_grads(tiling, inputs, ct, dh, dw)
    weights = inputs.weights
    if jnp.issubdtype(weights.dtype, jnp.floating):
        d_w = ct["weight_sum"] + sum(ct[f"{t}_sum"] * v for t, v in terms.items())
        if tiling.objective:
            d_w = d_w + ct["objective_sum"] * sum(
                coefs[i] * terms[t] for i, t in enumerate(tiling.sets[0])
            )
        d_weights = d_w.astype(weights.dtype)
    else:
        d_weights = np.zeros(weights.shape, jax.dtypes.float0)
    mesh = tiling.mesh

    def like(grad, primal):
        """On an explicit mesh, give a gradient its primal's sharding (a VJP requires it)."""
        grad = grad.astype(primal.dtype)
        if mesh is None or not all_explicit(mesh):
            return grad
        return jax.reshard(grad, NamedSharding(mesh, jax.typeof(primal).sharding.spec))

    # Teacher inputs and the temperature are constants, and so are the coefficients.
    d_inputs = Inputs(
        like(dh, inputs.hidden),
        like(dw, inputs.head),
        np.zeros(inputs.targets.shape, jax.dtypes.float0),
        d_weights,
        *(jax.tree.map(_zero_cotangent, a) for a in inputs[4:]),
    )
    return d_inputs, jnp.zeros_like(coefs)


def _zero_cotangent(x):
    """The (zero) cotangent of a constant input: float0 for integers."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _add_z_grads(tiling: Tiling, inputs: Inputs, ct, dh, dw):
    """z_loss_sum is usually only logged (a symbolic zero cotangent: this is not called); when
    it is differentiated, its gradients need the chunk logits again, so they are recomputed
    only where its cotangent is not 0."""
    z_losses = [ls for ls in tiling.losses if "z_loss" in ls.differentiable and ls.z]
    if not z_losses or "z_loss_sum" not in ct:
        return dh, dw
    ct_z = ct["z_loss_sum"]
    z_tiling = dataclasses.replace(tiling, losses=tuple(z_losses), sets=(("z_loss",),))
    student = Inputs(*inputs[:4])

    def add(dh, dw):
        out = _sharded(z_tiling, True)(student, ct_z[None])
        return dh + out.dh[0], dw + out.dw[0]

    return jax.lax.cond(ct_z != 0, add, lambda dh, dw: (dh, dw), dh, dw)


_tiled.defvjp(_tiled_fwd, _tiled_bwd, symbolic_zeros=True)
