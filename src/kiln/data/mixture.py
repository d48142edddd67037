"""Weighted mixtures: training windows drawn from several sources in fixed proportions.

Each source is its own endless stream of windows: shuffled by its own seed and, when its last
window has been drawn, shuffled anew and read again (its epochs count on their own; see
`window_stream`). grain's
`MapDataset.mix` interleaves the streams: element e of the mixture is element j of source i,
a pure function of e and the weights, so any prefix of the mixture holds each source in
proportion to its weight (to grain's rounding of the weights to integers, the smallest to
100), and the iterator's one position restores every source's position and the schedule.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline import (
    Batch,
    Datasets,
    StreamWindows,
    SyntheticWindows,
    held_out_batches,
    split_sizes,
)
from kiln.data.tokenizers import Tokenizer


def source_seed(seed: int, index: int) -> int:
    """The shuffle (and synthetic) seed of source `index`: data.seed itself for the first
    source, so that a one-entry data.sources reads exactly what the shorthand reads."""
    if index == 0:
        return seed % 2**32
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@dataclass
class SourceSplit:
    """One source's training and held-out windows, and what pins it (see kiln.runs.pinned)."""

    train: StreamWindows | SyntheticWindows
    held_out: StreamWindows | SyntheticWindows
    seed: int
    entropy_rate: float | None = None  # nats per token of a synthetic source
    inputs: dict[str, Any] | None = None  # {"corpus": ..., "split": ...} of real data
    trained: list[Path] = field(default_factory=list)  # files read for training
    held: list[Path] = field(default_factory=list)  # files of its eval_paths


def _tagged(source: int, window: int) -> tuple[int, int]:
    return source, window


# Below this many windows a source's epochs are numpy permutations: grain's index_shuffle
# (used above it, as for a single source) takes milliseconds per index on a few windows.
SMALL_SOURCE = 2**16


def window_stream(grain: Any, part: SourceSplit) -> Any:
    """The endless window ids of one source: each epoch a new order of all its windows."""
    n = part.train.num_windows
    if n is None:
        return grain.MapDataset.range(sys.maxsize)
    if n >= SMALL_SOURCE:
        return grain.MapDataset.range(n).shuffle(seed=part.seed).repeat()
    return grain.MapDataset.range(sys.maxsize).map(functools.partial(_permuted, n, part.seed))


def _permuted(n: int, seed: int, index: int) -> int:
    epoch, i = divmod(index, n)
    return int(_permutation(n, seed, epoch)[i])


@functools.lru_cache(maxsize=64)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch` of a small source: a permutation of its n windows (at most 256 KiB)."""
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int32)


class MixedDatasets(Datasets):
    """Train and held-out batches of one process, drawn from several sources.

    The global elements are the mixture's (source, window) pairs; rows and processes take
    them exactly as `Datasets` takes windows, so global batches do not depend on the number of
    processes. A source of weight 0 is not trained on; its held-out split is still evaluated.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        names: Sequence[str],
        weights: Sequence[float],
        parts: Sequence[SourceSplit],
        **common: Any,
    ):
        super().__init__(tokenizer, parts[0].train, parts[0].held_out, **common)
        self.train = self.eval = None  # per source: self.parts
        self.names, self.weights, self.parts = list(names), list(weights), list(parts)
        total = math.fsum(self.weights)
        self.shares = [w / total for w in self.weights]
        self.notes.append("data.sources: " + ", ".join(map(self._summary, range(len(parts)))))
        self.inputs = {
            key: {n: p.inputs[key] for n, p in zip(self.names, self.parts) if p.inputs}
            for key in ("corpus", "split")
            if any(p.inputs for p in self.parts)
        }

    def _summary(self, i: int) -> str:
        """'web 60% (12,345 training windows)': what a share means in repetitions."""
        n = self.parts[i].train.num_windows
        size = "synthetic" if n is None else f"{n:,} training windows"
        return f"{self.names[i]} {self.shares[i]:.0%} ({size})"

    def train_iterator(self) -> Iterator[Batch]:
        """Endless batches of this process; the iterator has get_state() / set_state(state)."""
        import grain  # not at import: `kiln prepare` and its workers never load JAX

        streams, weights = [], []
        for i, (part, weight) in enumerate(zip(self.parts, self.weights)):
            if weight == 0:
                continue
            streams.append(window_stream(grain, part).map(functools.partial(_tagged, i)))
            weights.append(weight)
        mixed = grain.MapDataset.mix(streams, weights)
        blocks = mixed.batch(self.local_batch_size, drop_remainder=True)
        batches = blocks[self.process_index :: self.process_count].map(self.batch)
        options = grain.ReadOptions(
            num_threads=min(2, self.prefetch_batches), prefetch_buffer_size=self.prefetch_batches
        )
        return iter(batches.to_iter_dataset(options))

    def batch(self, elements: tuple[np.ndarray, np.ndarray]) -> Batch:
        """Rows of (source index, window id) pairs: source [rows], window [rows]."""
        source, window = (np.asarray(a) for a in elements)
        out: Batch = {}
        for i in np.unique(source):
            rows = source == i
            part = self.parts[int(i)].train.batch(window[rows])
            for key, value in part.items():
                if key not in out:
                    out[key] = np.empty((len(source), *value.shape[1:]), value.dtype)
                out[key][rows] = value
        return out

    def eval_batches(self, num_batches: int) -> list[Batch]:
        """Every source's held-out batches of this process, one source after another."""
        return [b for batches in self.eval_sets(num_batches).values() for b in batches]

    def eval_sets(self, num_batches: int) -> dict[str, list[Batch]]:
        """`num_batches` held-out batches of each source, by name; the same on every call."""
        return {
            name: held_out_batches(part.held_out, num_batches, part.seed, self)
            for name, part in zip(self.names, self.parts)
        }

    def combine_eval(self, by_source: dict[str, dict[str, float]]) -> dict[str, float]:
        """eval/loss/<name> for each source; eval/loss, eval/z_loss: the sources' per-token means
        weighted by their shares (what a training batch of the mixture has in expectation)."""
        out = {f"eval/loss/{n}": by_source[n]["eval/loss"] for n in self.names}
        for tag in ("eval/loss", "eval/z_loss"):
            out[tag] = math.fsum(p * by_source[n][tag] for n, p in zip(self.names, self.shares))
        out["eval/perplexity"] = math.exp(min(out["eval/loss"] - out["eval/z_loss"], 80.0))
        return out

    def describe(self) -> dict[str, Any]:
        """Sizes for logs: each source's share and, for real data, windows, tokens, documents."""
        out: dict[str, Any] = {"tokenizer": self.tokenizer.spec, "seq_len": self.seq_len}
        for name, share, part in zip(self.names, self.shares, self.parts):
            out[name] = {
                "share": share,
                **split_sizes(part.train, part.held_out, part.entropy_rate),
            }
        return out
