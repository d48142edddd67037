"""Pipeline parallelism in SPMD form: a stack of layers split over the `stage` mesh axis and a
batch cut into micro-batches that flow through the stages, every stage working at once.

The stack's L layers are cut into S stages x R repeats of L/(S·R) consecutive layers. Position
p = r·S + s of the pipeline (0 <= p < S·R) runs layers p·L/(S·R) ... (p+1)·L/(S·R) - 1 on stage
s: a micro-batch passes stage 0, 1, ..., S-1, then (R > 1, the circular schedule) stage 0 again
with the next layers, R times. At iteration i stage s works on item t = i - s (micro-batch t mod
M, repeat t div M) when 0 <= t < R·M; the others are the bubble, whose outputs never reach a
result. Each iteration runs every stage's layers at once (one `vmap` over the stage axis, split
over `stage` by `spmd_axis_name`), then moves every stage's output to the next stage by a
rotation of the stage axis (a collective-permute). The last stage's outputs wait in a buffer of
M micro-batches until stage 0 takes them again (M >= S, so an output is written before it is
read) and, after the last repeat, are the result. R·M + S - 1 iterations in all: the bubble
fraction is (S - 1) / (R·M + S - 1). The backward pass is autodiff through the iterations.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from kiln.config.axes import shards_per_dim, without_axis
from kiln.parallel.mesh import current_rules, logical_spec, mesh_axes, use_rules

STAGE = "stage"  # the mesh axis the stages are split over
# (repeats, micro-batches) of the innermost `pipelined` (None outside one).
_SETTINGS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "kiln_pipeline", default=None
)
# True while the code of pipeline stages (or what runs on whole micro-batches beside them) is traced.
_IN_STAGES: contextvars.ContextVar[bool] = contextvars.ContextVar("kiln_in_stages", default=False)


class Schedule(NamedTuple):
    """S stages, R repeats (circular when R > 1), M micro-batches (M >= S)."""

    stages: int
    repeats: int
    microbatches: int

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of stage-iterations that compute nothing: (S-1) / (R·M + S - 1)."""
        return (self.stages - 1) / self.iterations


@contextlib.contextmanager
def pipelined(repeats: int, microbatches: int) -> Iterator[None]:
    """Model code traced inside runs its block stack in pipeline stages (`current_schedule`)
    when the mesh has more than one on `stage`: `repeats` circular repeats, the batch cut into
    `microbatches`. Set around the trace of a step (inside jit is fine)."""
    token = _SETTINGS.set((repeats, microbatches))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def current_schedule() -> Schedule | None:
    """The schedule of the innermost `pipelined` on the traced mesh; None outside one, or on a
    mesh with one stage (the stack is scanned as it is)."""
    settings = _SETTINGS.get()
    mesh = jax.sharding.get_abstract_mesh()
    if settings is None or mesh.empty or dict(mesh.shape).get(STAGE, 1) == 1:
        return None
    return Schedule(dict(mesh.shape)[STAGE], *settings)


def stage_order(layers: int, stages: int, repeats: int) -> np.ndarray:
    """Layer indices in stage order: [S, R, L/(S·R)] flattened, entry (s, r, j) the layer at
    position r·S + s, j-th of its group. Identity when R == 1."""
    per = layers // (stages * repeats)
    s, r, j = np.meshgrid(np.arange(stages), np.arange(repeats), np.arange(per), indexing="ij")
    return ((r * stages + s) * per + j).reshape(-1)


def _stage_mesh():
    """The traced mesh if it has a `stage` axis (None without one: the pipeline then runs its
    stages on one device, as the tests of the schedule do)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or STAGE not in mesh.axis_names else mesh


def _leading(a: jax.Array, axes) -> jax.Array:
    """`a` with its leading axis split over the mesh axes `axes`, the others left to the compiler."""
    rest = (PartitionSpec.UNCONSTRAINED,) * (a.ndim - 1)
    return jax.lax.with_sharding_constraint(a, PartitionSpec(axes, *rest))


def regroup_rounds(stages: int, repeats: int) -> list[dict[int, tuple[int, int, int]]]:
    """The circular regroup's moves in R rounds, each a permutation of the stages: round k maps
    each receiving stage d to (q, c, r), stage q sending its chunk c into d's slot r.

    Stage q holds positions q·R ... q·R + R - 1 in layer order (chunk c: position q·R + c),
    and position p = r·S + d belongs in stage d's slot r: each stage sends R chunks and receives
    R, a bipartite multigraph of degree R on both sides, which splits into R perfect matchings
    (Kőnig); each is found by augmenting paths on the moves still left."""
    left = {
        q: [(c, (q * repeats + c) % stages, (q * repeats + c) // stages) for c in range(repeats)]
        for q in range(stages)
    }

    def augment(match, q, seen):  # give q a receiver, moving others' along a free path
        for c, d, r in left[q]:
            if d not in seen:
                seen.add(d)
                if d not in match or augment(match, match[d][0], seen):
                    match[d] = (q, c, r)
                    return True
        return False

    rounds = []
    for _ in range(repeats):
        match: dict[int, tuple[int, int, int]] = {}
        for q in range(stages):
            found = augment(match, q, set())
            assert found, "a regular bipartite multigraph has a perfect matching"
        for d, (q, c, r) in match.items():
            left[q].remove((c, d, r))
        rounds.append(match)
    return rounds


def to_stage_order(a: jax.Array, stages: int, repeats: int) -> jax.Array:
    """`a` [L, ...] in layer order, split over `stage` on its first axis, in `stage_order`:
    each stage's block then holds the layers of its R positions.

    Stage s' holds, in layer order, positions s'·R ... s'·R + R - 1 (one chunk of L/(S·R)
    layers each), and stage s needs positions s, S + s, ..., (R-1)·S + s: every chunk moves
    to one slot of one stage. The moves are R rounds (`regroup_rounds`), each one
    collective-permute in which every stage sends one of its chunks and receives one slot (a
    chunk that stays on its stage is not sent), and its transpose (the gradients' way back)
    the same permutes reversed: each stage sends and receives its own weights once, where a
    gather in `stage_order` would bring every stage all the others' weights. The values are
    moved, not computed: the result is `a[stage_order(...)]` bit for bit. Outside a mesh with
    `stage`, that take itself."""
    if repeats == 1:
        return a
    mesh = _stage_mesh()
    if mesh is None:
        return jnp.take(a, jnp.asarray(stage_order(a.shape[0], stages, repeats)), axis=0)
    per = a.shape[0] // (stages * repeats)
    rounds = regroup_rounds(stages, repeats)
    # Per round and stage, the chunk it sends and whether the chunk it gets is its own; per
    # slot and stage, the round that slot comes in.
    sends, arrives = np.zeros((2, repeats, stages), np.int32)
    keeps = np.zeros((repeats, stages), bool)
    for k, match in enumerate(rounds):
        for d, (q, c, r) in match.items():
            sends[k, q], keeps[k, d], arrives[r, d] = c, q == d, k

    def pick(options, index):  # options[index], a traced index, by selects (exact values)
        out = options[0]
        for i in range(1, len(options)):
            out = jnp.where(index == i, options[i], out)
        return out

    def on_stage(block):  # [R·per, ...]: this stage's consecutive layers
        s = jax.lax.axis_index(STAGE)
        chunks = block.reshape(repeats, per, *block.shape[1:])
        got = []
        for k, match in enumerate(rounds):
            payload = pick(chunks, jnp.asarray(sends[k])[s])
            pairs = [(q, d) for d, (q, _, _) in match.items() if q != d]  # kept ones stay
            moved = jax.lax.ppermute(payload, STAGE, pairs) if pairs else payload
            got.append(jnp.where(jnp.asarray(keeps[k])[s], payload, moved))
        slots = [pick(got, jnp.asarray(arrives[r])[s]) for r in range(repeats)]
        return jnp.stack(slots).reshape(block.shape)

    spec = PartitionSpec(STAGE)
    return jax.shard_map(
        on_stage, mesh=mesh, in_specs=spec, out_specs=spec, axis_names={STAGE}, check_vma=False
    )(a)


def run(
    stage_fn: Callable[[Any, jax.Array, Any, jax.Array], tuple[jax.Array, Any]],
    weights: Any,
    inputs: jax.Array,
    extras: Any,
    schedule: Schedule,
) -> tuple[jax.Array, Any]:
    """(outputs [M, ...] of the last position, aux [S, R, ...] summed over micro-batches).

    `weights`: leaves [S, ...] (each stage's weights for all its repeats), split over `stage` on
    their first axis. `inputs` [M, ...]: the micro-batches. `extras`: leaves [M, ...], each
    micro-batch's side inputs (positions, segment ids). `stage_fn(w, x, e, r)` runs one
    position's layers on one micro-batch: those of repeat r (a traced index) of the stage whose
    weights w are (the leaves [...]); it returns its output (shaped as x) and an aux pytree,
    which is summed over the items each (stage, repeat) ran, never over the bubble's.

    Each stage gets its whole weights and the repeat, not the repeat's slice of them: the
    weights are the same at every iteration, so autodiff keeps them once for the backward pass,
    where a slice taken here would be kept once per iteration (docs/pipeline.md). `stage_fn`
    takes the slice inside what its layers recompute.
    """
    s_count, r_count, m_count = schedule
    if m_count < s_count:
        raise ValueError(f"{m_count} micro-batches for {s_count} stages: at least one per stage")
    sharded = _stage_mesh() is not None

    def on_stages(x):  # the leading axis split over the stages, the others as they come
        return _leading(x, STAGE) if sharded else x

    stage = jnp.arange(s_count)
    x0 = inputs[0]
    one = jax.eval_shape(
        lambda w, e: stage_fn(w, x0, e, jnp.int32(0)),
        jax.tree.map(lambda w: w[0], weights),
        jax.tree.map(lambda e: e[0], extras),
    )[1]
    aux0 = jax.tree.map(lambda a: jnp.zeros((s_count, r_count, *a.shape), a.dtype), one)
    shift0 = on_stages(jnp.zeros((s_count, *x0.shape), x0.dtype))
    circ0 = on_stages(jnp.zeros((s_count, *inputs.shape), inputs.dtype))

    def keep_last(circ, shift, i):
        """Stage 0 holds (in shift) the output the last stage made at iteration i - 1: into the
        buffer at its micro-batch, if it was a real item. Every stage writes its own slot."""
        t = i - s_count
        real = (t >= 0) & (t < r_count * m_count)
        m = jnp.mod(t, m_count)
        old = jax.lax.dynamic_index_in_dim(circ, m, axis=1, keepdims=False)
        new = jnp.where(real, shift, old)
        return jax.lax.dynamic_update_index_in_dim(circ, new, m, axis=1)

    def iteration(carry, i):
        shift, circ, aux = carry
        circ = keep_last(circ, shift, i)
        t = i - stage
        real = (t >= 0) & (t < r_count * m_count)
        m = jnp.mod(t, m_count)
        r = jnp.clip(t // m_count, 0, r_count - 1)
        # Stage 0's input: micro-batch i mod M, new or back from the last stage. Every stage
        # reads its own buffer slot (only stage 0's is used), so nothing crosses devices.
        k = jnp.mod(i, m_count)
        back = jax.lax.dynamic_index_in_dim(circ, k, axis=1, keepdims=False)
        new = jax.lax.dynamic_index_in_dim(inputs, k, keepdims=False)
        fresh = jnp.where(i < m_count, new[None], back)
        first = (stage == 0).reshape(-1, *(1,) * x0.ndim)
        x = on_stages(jnp.where(first, fresh, shift))
        e = jax.tree.map(lambda a: on_stages(a[m]), extras)
        y, out_aux = jax.vmap(stage_fn, spmd_axis_name=STAGE if sharded else None)(weights, x, e, r)
        y = on_stages(y)

        def add(acc, a):
            real_a = real.reshape(-1, *(1,) * (a.ndim - 1))
            a = jnp.where(real_a, a, jnp.zeros_like(a))
            return jax.vmap(lambda acc_s, a_s, r_s: acc_s.at[r_s].add(a_s))(acc, a, r)

        aux = jax.tree.map(add, aux, out_aux)
        shift = on_stages(jnp.roll(y, 1, axis=0))
        return (shift, circ, aux), None

    steps = jnp.arange(schedule.iterations)
    (shift, circ, aux), _ = jax.lax.scan(iteration, (shift0, circ0, aux0), steps)
    circ = keep_last(circ, shift, schedule.iterations)
    return circ[0], aux


def split(a: jax.Array, microbatches: int) -> jax.Array:
    """[G, ...] -> [M, G/M, ...]: micro-batch m = rows m, m + M, ... (each shard keeps its rows)."""
    return a.reshape(a.shape[0] // microbatches, microbatches, *a.shape[1:]).swapaxes(0, 1)


def merge(a: jax.Array) -> jax.Array:
    """The inverse of `split`: [M, G/M, ...] -> [G, ...]."""
    return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])


@contextlib.contextmanager
def rows_by_stage() -> Iterator[None]:
    """Trace inside the `with` with `batch` split over `stage` alone, if the rules split it so:
    for an array whose rows are each stage's (the batch outside the stages) while another
    dimension takes the other axes (the embedding's lookup, split over `embed`)."""
    rules = dict(current_rules())
    with use_rules({**rules, "batch": [a for a in rules["batch"] if a == STAGE]}):
        yield


@contextlib.contextmanager
def _within_stages() -> Iterator[tuple[Callable[[Any], Any], Callable[[Any], Any]]]:
    """Trace inside the `with` with the rules inside pipeline stages: the outer rules with
    `stage` taken out. Outside, the batch rule splits rows over `stage` too (kiln.config.axes),
    so that the embedding, the LM head and the loss run on each stage's rows; inside, every
    stage works on whole micro-batches. Yields (gather, split): each puts the rows of the leaves
    [G, ...] of a pytree as the rules inside (gathered over `stage`) or outside put them (the
    other dimensions left to the compiler); no-ops when the batch rule has no `stage`."""
    outer = dict(current_rules())
    inner = without_axis(outer, STAGE)
    mesh = _stage_mesh()

    def rows_as(rules):
        if mesh is None or inner["batch"] == outer["batch"]:
            return lambda tree: tree
        rows = mesh_axes(("batch",), rules, dict(mesh.shape))[0]
        return lambda tree: jax.tree.map(lambda a: _leading(a, rows), tree)

    token = _IN_STAGES.set(True)
    try:
        with use_rules(inner):
            yield rows_as(inner), rows_as(outer)
    finally:
        _IN_STAGES.reset(token)


def in_stages() -> bool:
    """Whether the code being traced runs inside pipeline stages (`stack`), or beside them on
    whole micro-batches (`each_microbatch`)."""
    return _IN_STAGES.get()


def each_microbatch(fn: Callable[..., tuple[Any, Any]], args: Any, microbatches: int):
    """`fn(*args)` on each of the pipeline's micro-batches in turn (leaves of `args` [G, ...],
    cut as `stack` cuts them): (its outputs, leaves [G, ...] put back in row order; its aux
    summed over the micro-batches). For what runs around the stages but has statistics of the
    batch it sees (an MoE layer's), so that they are the micro-batches' as in the stack.

    Where a micro-batch's rows divide over the batch's shards with `stage` (the rules outside
    the stages), each stage runs its own rows of every micro-batch, as the LM head does;
    otherwise, like the stages, it works on whole micro-batches, on every stage."""

    def one(piece):
        return fn(*piece)

    def each(tree):
        outs, aux = jax.lax.map(one, jax.tree.map(lambda a: split(a, microbatches), tree))
        return jax.tree.map(merge, outs), jax.tree.map(lambda a: jnp.sum(a, axis=0), aux)

    mesh = _stage_mesh()
    if mesh is not None:
        [shards] = shards_per_dim(logical_spec(("batch",), current_rules()), dict(mesh.shape))
        if (jax.tree.leaves(args)[0].shape[0] // microbatches) % shards == 0:
            return each(args)
    with _within_stages() as (gather, split_rows):
        outs, aux = each(gather(args))
    return split_rows(outs), aux


def stack(
    run_layers: Callable[[Any, jax.Array, Any, jax.Array], tuple[jax.Array, Any]],
    params: Any,
    x: jax.Array,
    extras: Any,
    schedule: Schedule,
) -> tuple[jax.Array, Any]:
    """A stack of layers in pipeline stages: (its output, its per-layer aux [L, ...]).

    `params`: leaves [L, ...] in layer order (split over `stage` on that axis, so that with
    R = 1 each stage already holds its consecutive layers; with R > 1 they are regrouped by
    `to_stage_order`, which moves each stage's weights once between stages). `x` [G, ...] and
    the leaves of `extras` [G, ...] are cut into M micro-batches of rows a, a + M, ... (each
    shard keeps its rows), after their rows split over `stage` (the batch rule's, outside the
    stages) are gathered; the output's rows are split over `stage` again. Inside, the layers
    are traced with the rules without `stage`.
    `run_layers(params [L/(S·R), R, ...], x, extras, r)` runs consecutive layers on one
    micro-batch, layer j with the weights params[j, r] (taken inside each layer's remat, so
    that no iteration keeps a copy: `run`), and returns its output and per-layer aux
    [L/(S·R), ...], summed here over micro-batches.
    """
    s_count, r_count, m_count = schedule
    layers = jax.tree.leaves(params)[0].shape[0]
    order = stage_order(layers, s_count, r_count)
    per = layers // (s_count * r_count)

    def to_stages(a):
        a = to_stage_order(a, s_count, r_count)
        return a.reshape(s_count, r_count, per, *a.shape[1:]).swapaxes(1, 2)

    with _within_stages() as (gather, split_rows):
        weights = jax.tree.map(to_stages, params)
        pieces = jax.tree.map(lambda a: split(a, m_count), gather((x, extras)))
        out, aux = run(run_layers, weights, *pieces, schedule)
    inverse = jnp.asarray(np.argsort(order))
    aux = jax.tree.map(lambda a: jnp.take(a.reshape(layers, *a.shape[3:]), inverse, axis=0), aux)
    return split_rows(merge(out)), aux
