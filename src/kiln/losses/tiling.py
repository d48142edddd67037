"""The static description of a loss call: mesh axes, tiling settings, inputs; and their checks."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.config import DEFAULT_AXIS_RULES
from kiln.config.axes import entry_axes
from kiln.losses import schedule as sc
from kiln.losses.core import TopK, check_positive_int, logits
from kiln.parallel.mesh import logical_spec, traced_platform


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Mesh axes of the logits' tokens and vocabulary, and of the head gradient's scatter."""

    batch: tuple[str, ...] = ()
    length: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    # Token axes that also shard the head's embed dimension (FSDP): its gradient is
    # reduce-scattered over them instead of all-reduced, as the parameter is stored.
    scatter: tuple[str, ...] = ()

    @property
    def tokens(self) -> tuple[str, ...]:
        return self.batch + self.length

    def spec(self, kind: str) -> P:
        b, s, v = (self.batch or None), (self.length or None), (self.vocab or None)
        return {
            "BS": P(b, s),
            "BSD": P(b, s, None),
            "DV": P(None, v),
            "BSV": P(b, s, v),
            "KBSD": P(None, b, s, None),
            "KDV": P(None, self.scatter or None, v),
        }[kind]


def mesh_axes(mesh: Mesh | None, rules, d_model: int) -> MeshAxes:
    """The logits' axes from `kiln.parallel.mesh.logical_spec` (batch, length, vocab), and the scatter axes."""
    if mesh is None:
        return MeshAxes()
    rules = DEFAULT_AXIS_RULES if rules is None else rules

    def present(entry) -> tuple[str, ...]:
        return tuple(a for a in entry_axes(entry) if a in mesh.shape)

    batch, length, vocab = (present(e) for e in logical_spec(("batch", "length", "vocab"), rules))
    embed = present(logical_spec(("embed", "vocab"), rules)[0])
    # Scatter over a prefix of the head's embed axes that are all token axes, in the embed
    # order, so the scattered gradient lands where the parameter's shards are.
    scatter: list[str] = []
    for a in embed:
        if a not in batch + length or d_model % math.prod(mesh.shape[b] for b in [*scatter, a]):
            break
        scatter.append(a)
    return MeshAxes(batch, length, vocab, tuple(scatter))


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static settings of one engine call (hashable: a `nondiff_argnums` of the custom VJP).

    `sets` names the differentiable terms of each gradient set; the flat `coefs` argument
    holds their coefficients in that order. With `objective`, the one set's combination is
    the output `objective_sum`, the only output with hidden/head gradients.
    """

    losses: tuple[Any, ...]
    sets: tuple[tuple[str, ...], ...]
    num_chunks: int
    vocab: int
    mesh: Mesh | None = None
    axes: MeshAxes = MeshAxes()
    vocab_chunk: int | None = None
    student_cap: float | None = None
    teacher_cap: float | None = None
    objective: bool = False
    schedule: sc.Schedule | None = None  # how the engine walks a shard (`kiln.losses.schedule`)

    @property
    def terms(self) -> tuple[str, ...]:
        return tuple(t for loss in self.losses for t in loss.terms)

    @property
    def tiled(self) -> bool:
        return self.num_chunks > 1 or bool(self.vocab_chunk)


class Inputs(NamedTuple):
    """Arrays of an engine call; the teacher's are None for a loss of the student alone."""

    hidden: jax.Array  # [B, S, D]
    head: jax.Array  # [D, V]
    targets: jax.Array  # [B, S] int
    weights: jax.Array  # [B, S]
    teacher_hidden: jax.Array | None = None  # [B, S, E]
    teacher_head: jax.Array | None = None  # [E, V]
    temperature: jax.Array | None = None  # scalar
    teacher_top_k: TopK | None = None  # stored teacher top-k: [B, S, K], [B, S, K], [B, S]


def all_auto(mesh: Mesh) -> bool:
    return all(t == AxisType.Auto for t in mesh.axis_types)


def all_explicit(mesh: Mesh) -> bool:
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def whole_logits(hidden, head, cap, mesh, axes: MeshAxes):
    """Untiled logits [B, S, V]; on an Auto mesh pinned vocabulary-sharded like the head."""
    x = logits(hidden, head)
    if mesh is not None and all_auto(mesh):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, axes.spec("BSV")))
    return cap * jnp.tanh(x / cap) if cap else x


def _shards(mesh: Mesh | None, ax: MeshAxes) -> tuple[int, int, int]:
    """Shards of the batch, the sequence and the vocabulary on `mesh`."""
    sizes = {} if mesh is None else dict(mesh.shape)
    return tuple(math.prod(sizes[a] for a in axes) for axes in (ax.batch, ax.length, ax.vocab))


def check_tiling(tiling: Tiling, hidden_shape, head_shape) -> None:
    """Shapes that the mesh, `num_vocab_tiling` and `vocab_chunk_size` must divide; ValueError."""
    batch, seq, _ = hidden_shape
    vocab = head_shape[1]
    ax = tiling.axes
    pieces = []
    for name, n, axes, shards in zip(
        ("hidden_BSD: batch", "hidden_BSD: sequence length", "head_DV: vocabulary"),
        (batch, seq, vocab),
        (ax.batch, ax.length, ax.vocab),
        _shards(tiling.mesh, ax),
        strict=True,
    ):
        if n % shards:
            raise ValueError(
                f"{name} {n} does not split into the {shards} shards of mesh axes {axes}; "
                "change the mesh, the rules or the shape"
            )
        pieces.append(n // shards)
    tokens = pieces[0] * pieces[1]
    if tokens % tiling.num_chunks:
        raise ValueError(
            f"num_vocab_tiling={tiling.num_chunks} does not divide the {tokens} tokens "
            f"({pieces[0]} x {pieces[1]}) of one shard"
        )
    if tiling.vocab_chunk and pieces[2] % tiling.vocab_chunk:
        raise ValueError(
            f"vocab_chunk_size={tiling.vocab_chunk} does not divide the {pieces[2]} vocabulary "
            "entries of one shard"
        )


def make_tiling(
    losses,
    sets,
    hidden,
    head,
    *,
    num_vocab_tiling,
    vocab_chunk_size,
    mesh,
    rules,
    schedule: sc.ScheduleName | sc.CpuBlocked = "auto",
    **caps,
) -> Tiling:
    """The checked `Tiling` of a call: hidden [B, S, D], head [D, V]; `caps` as in `Tiling`;
    `schedule` as in `kiln.losses.schedule` (chosen here, once, for the shard's shape)."""
    check_positive_int("num_vocab_tiling", num_vocab_tiling)
    check_positive_int("vocab_chunk_size", vocab_chunk_size, optional=True)
    if hidden.ndim != 3 or head.ndim != 2 or hidden.shape[-1] != head.shape[0]:
        raise ValueError(
            f"expected hidden [B, S, D] and head [D, V], got {hidden.shape} and {head.shape}"
        )
    axes = mesh_axes(mesh, rules, head.shape[0])
    batch_shards, seq_shards, vocab_shards = _shards(mesh, axes)
    rows = (hidden.shape[0] // batch_shards) * (hidden.shape[1] // seq_shards)
    vocab_local = head.shape[1] // vocab_shards
    tiling = Tiling(
        losses=tuple(losses),
        sets=tuple(sets),
        num_chunks=num_vocab_tiling,
        vocab=head.shape[1],
        mesh=mesh,
        axes=axes,
        vocab_chunk=vocab_chunk_size,
        schedule=sc.choose(
            schedule, traced_platform(mesh), rows, num_vocab_tiling, vocab_local, vocab_chunk_size
        ),
        **caps,
    )
    if tiling.tiled:
        check_tiling(tiling, hidden.shape, head.shape)
    return tiling
