"""The chunk schedule of the tiled loss engine: how one shard's tokens are walked, chosen once.

- `whole`: `num_vocab_tiling` chunks of the shard's tokens, each chunk's logits made whole and
  its element-wise work left to the compiler, which on GPU and TPU fuses it into a few kernels.
- `vocab`: the same token chunks with each shard's vocabulary cut into `vocab_chunk_size`
  columns (a pass for the statistics, then one for the sums and gradients).
- `cpu_blocked`: chunks of about `chunk_bytes` of float32 logits per model (never more rows
  than a `num_vocab_tiling` chunk), whose element-wise passes run in row blocks of about
  `block_bytes`, in the cores' caches, instead of streaming [rows, V] arrays from memory once
  per pass. The same operations per row: the same values up to the order in which the head
  gradient adds up its chunks and how XLA vectorises a row's sums at the block's shape.
  Sizes need not divide the shard's tokens: the last chunk is filled with copies of the last
  row at weight 0, which add nothing to any sum or gradient.

`auto` (`loss.schedule`'s default) is `cpu_blocked` when the mesh's devices are CPUs and
`whole` otherwise, so a step compiled ahead of time for a TPU topology keeps whole chunks;
either becomes `vocab` when `vocab_chunk_size` cuts the vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

SCHEDULES = ("auto", "whole", "cpu_blocked")
ScheduleName = Literal["auto", "whole", "cpu_blocked"]


@dataclasses.dataclass(frozen=True)
class CpuBlocked:
    """The `cpu_blocked` schedule with its sizes: bytes of one chunk's float32 logits per model,
    and of one row block's."""

    chunk_bytes: int = 32 << 20
    block_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("chunk_bytes", "block_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CpuBlocked.{name}: {value!r}; allowed: a positive int")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How one shard's `rows` tokens and `vocab_local` columns are cut (static, hashable)."""

    kind: Literal["whole", "vocab", "cpu_blocked"]
    rows: int  # the shard's tokens
    chunk: int  # rows per chunk
    block: int  # rows per element-wise block: `chunk` but for cpu_blocked
    vocab_chunk: int  # columns per vocabulary chunk: the shard's vocabulary but for vocab

    @property
    def num_chunks(self) -> int:
        return -(-self.rows // self.chunk)

    @property
    def padding(self) -> int:
        """Rows added to fill the last chunk (copies of the last row, at weight 0)."""
        return self.num_chunks * self.chunk - self.rows

    @property
    def blocked(self) -> bool:
        return self.block < self.chunk


def _rows_within(budget_bytes: int, vocab_local: int) -> int:
    """The largest power of two of rows whose float32 logits fit `budget_bytes` (at least 1)."""
    fit = max(1, budget_bytes // (4 * vocab_local))
    return 1 << (fit.bit_length() - 1)


def choose(
    requested: ScheduleName | CpuBlocked,
    platform: str,
    rows: int,
    num_chunks: int,
    vocab_local: int,
    vocab_chunk: int | None,
) -> Schedule:
    """The schedule for a shard of `rows` tokens and `vocab_local` columns; ValueError when a
    requested one cannot apply."""
    if not isinstance(requested, CpuBlocked) and requested not in SCHEDULES:
        raise ValueError(
            f"schedule: {requested!r}; allowed: {', '.join(SCHEDULES)} or a CpuBlocked(...)"
        )
    whole_chunk = max(1, rows // num_chunks)
    if vocab_chunk and vocab_chunk < vocab_local:
        if requested != "auto" and requested != "whole":
            raise ValueError(
                "schedule: cpu_blocked cuts token rows of whole-vocabulary chunks; with "
                f"vocab_chunk_size={vocab_chunk} the vocabulary chunks set the schedule; allowed: "
                "auto or whole, or vocab_chunk_size null"
            )
        return Schedule("vocab", rows, whole_chunk, whole_chunk, vocab_chunk)
    if isinstance(requested, CpuBlocked):
        sizes = requested
    elif requested == "cpu_blocked" or (requested == "auto" and platform == "cpu"):
        sizes = CpuBlocked()
    else:
        return Schedule("whole", rows, whole_chunk, whole_chunk, vocab_local)
    chunk = min(whole_chunk, _rows_within(sizes.chunk_bytes, vocab_local))
    block = min(chunk, _rows_within(sizes.block_bytes, vocab_local))
    return Schedule("cpu_blocked", rows, chunk - chunk % block, block, vocab_local)
