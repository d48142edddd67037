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
from kiln.parallel.mesh import current_reduce_dtype

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


class _Chunks:
    """What every chunk schedule reads of one shard: its inputs, the plan, and the work on one
    chunk of tokens (its logits on a vocabulary chunk, the losses' statistics and per-token
    terms, the logit gradients and their products with the head and the hidden states)."""

    def __init__(self, tiling: Tiling, with_grads: bool, inputs: Inputs, coefs):
        self.hs, self.ws, self.targets, self.weights, self.ht, self.wt, self.temp, self.top = inputs
        self.tiling, self.with_grads, self.coefs = tiling, with_grads, coefs
        self.batch, self.seq, self.d_model = self.hs.shape
        self.vocab_local = self.ws.shape[1]
        plan = self.plan = tiling.schedule
        assert plan.rows == self.batch * self.seq and self.vocab_local % plan.vocab_chunk == 0, (
            plan,
            self.hs.shape,
        )
        self.chunk, self.block, self.vchunk = plan.chunk, plan.block, plan.vocab_chunk
        self.n_vchunks = self.vocab_local // self.vchunk
        self.axes, self.losses = tiling.axes.vocab, tiling.losses
        self.dtype = self.ws.dtype  # the head matmuls' input dtype, as in `logits`
        columns = jnp.arange(self.vocab_local)
        if self.axes:
            columns = columns + jax.lax.axis_index(self.axes) * self.vocab_local
        self.columns = columns
        self.offsets = np.cumsum([0] + [len(s) for s in tiling.sets])

    def vslice(self, x, k):
        """Vocabulary chunk k of x along its last axis (all of it without vocabulary chunks)."""
        if k is None:
            return x
        return jax.lax.dynamic_slice_in_dim(x, k * self.vchunk, self.vchunk, axis=-1)

    def head_logits(self, h_n, g_n, k):
        """The student's (and the teacher's) logits of tokens [n] on vocabulary chunk k."""
        tiling = self.tiling
        x_s = logits(h_n, self.vslice(self.ws, k), softcap=tiling.student_cap)
        x_t = (
            None
            if self.wt is None
            else logits(g_n, self.vslice(self.wt, k), softcap=tiling.teacher_cap)
        )
        return x_s, x_t

    def view(self, x_s, x_t, y_n, top_n, k) -> ChunkLogits:
        whole = k is None and self.vocab_local == self.tiling.vocab  # each row's whole vocabulary
        target = y_n if whole else None
        cols = self.vslice(self.columns, k)
        top_col = None if top_n is None else block_columns(top_n.ids, cols[0], cols.shape[0])
        return ChunkLogits(x_s, x_t, cols == y_n[:, None], self.temp, target, top_n, top_col)

    def chunk_logits(self, h_n, g_n, y_n, top_n, k) -> ChunkLogits:
        return self.view(*self.head_logits(h_n, g_n, k), y_n, top_n, k)

    def logit_grads(self, lg, stats, w_n):
        """Per gradient set: the gradient of its losses w.r.t. the student's logits [n, c],
        in the head's dtype (the products' operands)."""
        grads = []
        for k, names in enumerate(self.tiling.sets):
            cts = {t: w_n * self.coefs[self.offsets[k] + i] for i, t in enumerate(names)}
            parts = [loss.dlogits(lg, st, cts) for loss, st in zip(self.losses, stats)]
            g = sum(p for p in parts if p is not None)
            grads.append(softcap_grad(g, lg.student, self.tiling.student_cap).astype(self.dtype))
        return tuple(grads)

    def products(self, grads, h_n, w_Dc):
        """Each logit gradient [n, c] times the head and the hidden states: K-tuples of [n, D]
        and [D, c] float32, as plain 2-D dots (XLA:CPU runs them about twice as fast as one
        einsum batched over K); accumulation in float32."""
        h_Dn = h_n.T.astype(self.dtype)
        dh = tuple(jnp.dot(g, w_Dc.T, preferred_element_type=f32) for g in grads)
        dw = tuple(jnp.dot(h_Dn, g, preferred_element_type=f32) for g in grads)
        return dh, dw

    def chunk_sums(self, lg, stats):
        return tuple(loss.sums(lg, st) for loss, st in zip(self.losses, stats))

    def token_terms(self, stats, sums, y_n, w_n):
        ok = scored(y_n, w_n, self.tiling.vocab)
        terms = {}
        for loss, st, sm in zip(self.losses, stats, sums):
            terms.update(loss.values(st, sm, ok, self.temp))
        return terms

    def rows(self, x_s, x_t, y_n, w_n, top_n):
        """Per-token terms and logit gradients of rows whose logits hold the shard's vocabulary."""
        lg = self.view(x_s, x_t, y_n, top_n, None)
        stats = tuple(loss.stats(lg, self.axes) for loss in self.losses)
        terms = self.token_terms(stats, psum(self.chunk_sums(lg, stats), self.axes), y_n, w_n)
        return terms, (self.logit_grads(lg, stats, w_n) if self.with_grads else None)

    def cut(self, x, fill=None):
        """[B, S, ...] -> [chunks, chunk, ...]; a last chunk the rows do not fill takes copies of
        the last row (`fill`: a constant instead), which weight 0 keeps out of every result."""
        if x is None:
            return None
        plan = self.plan
        flat = x.reshape(plan.rows, *x.shape[2:])
        if plan.padding:
            widths = [(0, plan.padding)] + [(0, 0)] * (flat.ndim - 1)
            if fill is None:
                flat = jnp.pad(flat, widths, mode="edge")
            else:
                flat = jnp.pad(flat, widths, constant_values=fill)
        return flat.reshape(plan.num_chunks, self.chunk, *flat.shape[1:])

    def uncut(self, x):
        """[chunks, chunk, ...] -> the shard's rows [B * S, ...], padding dropped."""
        return x.reshape(self.plan.num_chunks * self.chunk, *x.shape[2:])[: self.plan.rows]


def _add(xs, ys):
    return tuple(x + y for x, y in zip(xs, ys))


def _whole_vocabulary_step(c: _Chunks, carry, xs):
    """One token chunk whose logits hold the shard's vocabulary, made by one product per model;
    its element-wise work in blocks of `block` rows when `block < chunk` (the `cpu_blocked`
    schedule), each block's logit gradients written into its rows of `bufs` (one [chunk, c]
    buffer per gradient set, reused from chunk to chunk)."""
    dw, bufs = carry
    h_n, g_n, y_n, w_n, top_n = xs
    x_s, x_t = c.head_logits(h_n, g_n, None)
    rows_in = (x_s, x_t, y_n, w_n, top_n)
    if c.block == c.chunk:
        terms, grads = c.rows(*rows_in)
    else:

        def one_block(bufs, i):
            # The block is sliced in the loop body, not handed in as a scanned input: the
            # element-wise passes then read its rows where they lie (a scanned input is copied
            # out first, and its unrolled pair once more).
            b = jax.tree.map(
                lambda a: jax.lax.dynamic_slice_in_dim(a, i * c.block, c.block), rows_in
            )
            terms, grads = c.rows(*b)
            put = functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=0)
            return tuple(put(buf, g, i * c.block) for buf, g in zip(bufs, grads or ())), terms

        # Two blocks per iteration: their independent work can run on two threads at once.
        bufs_out, terms = jax.lax.scan(one_block, bufs, jnp.arange(c.chunk // c.block), unroll=2)
        terms = {t: v.reshape(c.chunk) for t, v in terms.items()}
        grads = bufs_out if c.with_grads else None
    dh_n = None
    if c.with_grads:
        dh_n, dw_add = c.products(grads, h_n, c.ws)
        dw = _add(dw, dw_add)
        bufs = grads if c.block < c.chunk else bufs
    return (dw, bufs), (terms, dh_n)


def _vocabulary_chunks_step(c: _Chunks, carry, xs):
    """One token chunk over vocabulary chunks: a first pass merges the losses' statistics of
    each chunk's logits (an online logsumexp), a second makes them again for the sums and the
    gradients."""
    dw, bufs = carry
    h_n, g_n, y_n, w_n, top_n = xs
    losses, n_vchunks = c.losses, c.n_vchunks

    def merge_chunk(acc, k):
        lg = c.chunk_logits(h_n, g_n, y_n, top_n, k)
        return tuple(ls.merge(a, ls.stats(lg, ())) for ls, a in zip(losses, acc)), None

    lg0 = c.chunk_logits(h_n, g_n, y_n, top_n, 0)
    first = tuple(loss.stats(lg0, ()) for loss in losses)
    stats, _ = jax.lax.scan(merge_chunk, first, jnp.arange(1, n_vchunks))
    stats = tuple(loss.reduce(st, c.axes) for loss, st in zip(losses, stats))
    zero = jax.tree.map(
        lambda s: _varying(c.tiling, jnp.zeros(s.shape, s.dtype)),
        jax.eval_shape(c.chunk_sums, lg0, stats),
    )
    needs_pass = c.with_grads or jax.tree.leaves(zero)

    def second_pass(carry, k):
        sums, dh_n, dw = carry
        lg = c.chunk_logits(h_n, g_n, y_n, top_n, k)
        sums = jax.tree.map(jnp.add, sums, c.chunk_sums(lg, stats))
        if c.with_grads:
            dh_k, dw_k = c.products(c.logit_grads(lg, stats, w_n), h_n, c.vslice(c.ws, k))
            dw = tuple(
                jax.lax.dynamic_update_slice_in_dim(a, c.vslice(a, k) + b, k * c.vchunk, -1)
                for a, b in zip(dw, dw_k)
            )
            dh_n = _add(dh_n, dh_k)
        return (sums, dh_n, dw), None

    sums, dh_n = zero, None
    if needs_pass:
        dh0 = tuple(_varying(c.tiling, jnp.zeros((c.chunk, c.d_model), f32)) for _ in c.tiling.sets)
        carry = (zero, dh0 if c.with_grads else None, dw)
        (sums, dh_n, dw), _ = jax.lax.scan(second_pass, carry, jnp.arange(n_vchunks))
    terms = c.token_terms(stats, psum(sums, c.axes), y_n, w_n)
    return (dw, bufs), (terms, dh_n)


def _epilogue(c: _Chunks, terms, dh, dw, w) -> Local:
    """Every schedule's end: per-token terms back to [B, S], their weighted sums and the head
    and hidden-state gradients combined over the mesh."""
    batch, seq = c.batch, c.seq
    terms = {k: c.uncut(v).reshape(batch, seq) for k, v in terms.items()}
    token_axes = c.tiling.axes.tokens
    sums = {f"{k}_sum": psum(weighted_sum(v, w), token_axes) for k, v in terms.items()}
    sums["weight_sum"] = psum(jnp.sum(w), token_axes)
    if not c.with_grads:
        return Local(terms, sums, None, None)
    dh = psum(jnp.stack([c.uncut(g).reshape(batch, seq, c.d_model) for g in dh]), c.axes)
    scatter = c.tiling.axes.scatter
    # Summed across devices in float32, or in the head's dtype where the step asks for its
    # weight gradients in the compute dtype (`train.grad_reduce_dtype`), as the layers' are.
    reduce = current_reduce_dtype(f32) or c.dtype
    dw = psum(jnp.stack(dw).astype(reduce), tuple(a for a in token_axes if a not in scatter))
    if scatter:
        dw = jax.lax.psum_scatter(dw, scatter, scatter_dimension=1, tiled=True)
    return Local(terms, sums, dh, dw)


def _local(tiling: Tiling, with_grads: bool, inputs: Inputs, coefs) -> Local:
    """The chunk loop on local tokens [B, S] and a local vocabulary slice of the heads: a scan
    over token chunks of the schedule's step, then the shared epilogue."""
    c = _Chunks(tiling, with_grads, inputs, coefs)
    dw0, bufs0 = None, ()
    if with_grads:
        dw0 = tuple(
            _varying(tiling, jnp.zeros((c.d_model, c.vocab_local), f32)) for _ in tiling.sets
        )
        if c.n_vchunks == 1 and c.block < c.chunk:
            # The logit gradients of every chunk's blocks land in the same buffers.
            bufs0 = tuple(
                _varying(tiling, jnp.zeros((c.chunk, c.vocab_local), c.dtype)) for _ in tiling.sets
            )
    step = _whole_vocabulary_step if c.n_vchunks == 1 else _vocabulary_chunks_step
    w = c.weights.astype(f32)
    xs = (
        c.cut(c.hs),
        c.cut(c.ht),
        c.cut(c.targets),
        c.cut(w, fill=0.0),
        jax.tree.map(c.cut, c.top),
    )
    (dw, _), (terms, dh) = jax.lax.scan(functools.partial(step, c), (dw0, bufs0), xs)
    return _epilogue(c, terms, dh, dw, w)


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
