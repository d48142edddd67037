"""Packed training batches: windows of a document stream (or synthetic tokens) through grain.

A corpus split is one stream: its documents (each already ending in EOS) end to end. Window w
is stream[w*L : w*L + L + 1] for L = seq_len, so every token after the first is a target
exactly once per epoch; the last window is padded (weights 0). Inside a window a new segment
starts at every EOS *input*: the EOS acts as the beginning-of-sequence of the next document,
so `segment_ids` (1, 2, ...; 0 = padding) and `positions` restart there and the model can mask
attention between documents.

Shards of chat or prompt/completion records carry a loss weight per token (0 for prompts and
template text): a target's weight is its own, and segments start at the recorded document
ends rather than at every EOS, since a chat template may use the EOS token inside a
conversation (e.g. as its end-of-turn token).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from kiln.data import synthetic
from kiln.data.corpus import Corpus, token_id_error
from kiln.data.tokenizers import Tokenizer
from kiln.errors import KilnError

Batch = dict[str, np.ndarray]


def pack(
    tokens_BxT: np.ndarray,
    valid_BxT: np.ndarray,
    eos_id: int | None,
    pad_id: int,
    *,
    weights_BxT: np.ndarray | None = None,
    ends_BxT: np.ndarray | None = None,
) -> Batch:
    """Model inputs from windows of T = seq_len + 1 tokens; `eos_id` None = no documents.

    weights_BxT: each token's loss weight as a target (None = 1); ends_BxT: True at the EOS
    that ends a document (None = at every EOS).
    """
    tokens_BxT = np.where(valid_BxT, tokens_BxT, pad_id).astype(np.int32)
    inputs, targets = tokens_BxT[:, :-1], tokens_BxT[:, 1:]
    in_valid = valid_BxT[:, :-1]
    length = inputs.shape[1]
    idx = np.arange(length, dtype=np.int32)
    if eos_id is None:
        segment_ids = np.ones_like(inputs)
        positions = np.broadcast_to(idx, inputs.shape).copy()
    else:
        ends = inputs == eos_id if ends_BxT is None else ends_BxT[:, :-1]
        starts = ends & in_valid
        segment_ids = 1 + np.cumsum(starts, axis=1, dtype=np.int32)
        positions = idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return {
        "inputs": inputs,
        "targets": targets,
        "positions": np.where(in_valid, positions, 0).astype(np.int32),
        "segment_ids": np.where(in_valid, segment_ids, 0).astype(np.int32),
        "weights": (
            valid_BxT[:, 1:] if weights_BxT is None else valid_BxT[:, 1:] * weights_BxT[:, 1:]
        ).astype(np.float32),
    }


class StreamWindows:
    """Windows of seq_len + 1 tokens over the documents `doc_ids` of a corpus, end to end.

    Every token read is checked against `vocab_size` (model.vocab_size): a shard damaged after
    `open_corpus` checked its recorded maximum is refused rather than trained on.
    """

    def __init__(
        self,
        corpus: Corpus,
        doc_ids: np.ndarray,
        seq_len: int,
        eos_id: int,
        pad_id: int,
        *,
        vocab_size: int,
    ):
        self.shards, self.paths = corpus.shards, corpus.paths
        self.seq_len, self.eos_id, self.pad_id = seq_len, eos_id, pad_id
        self.vocab_size = vocab_size
        shard = corpus.doc_shard[doc_ids]
        start = corpus.doc_start[doc_ids]
        length = corpus.doc_len[doc_ids]
        # Neighbouring documents stored back to back form one run: one lookup covers them.
        new_run = np.ones(len(doc_ids), bool)
        new_run[1:] = (shard[1:] != shard[:-1]) | (start[1:] != start[:-1] + length[:-1])
        first = np.flatnonzero(new_run)
        self.run_shard = shard[first]
        self.run_start = start[first]
        self.run_cum = np.zeros(len(first) + 1, np.int64)
        if len(first):
            np.cumsum(np.add.reduceat(length, first), out=self.run_cum[1:])
        self.weights = corpus.weights
        # Stream offsets where each document ends (after its EOS): segment boundaries of
        # weighted corpora, whose documents may hold EOS tokens inside.
        self.doc_ends = np.cumsum(length) if corpus.weights is not None else None
        self.num_documents = len(doc_ids)
        self.num_tokens = int(self.run_cum[-1])
        self.num_windows = max(0, math.ceil((self.num_tokens - 1) / seq_len))

    def gather(self, q: np.ndarray) -> np.ndarray:
        """Tokens at stream positions `q` (any shape, each in [0, num_tokens))."""
        return self._gather(q)[0]

    def _gather(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens at stream positions `q` and, for a weighted corpus, their loss weights."""
        r = np.searchsorted(self.run_cum, q, side="right") - 1
        local = self.run_start[r] + (q - self.run_cum[r])
        shard = self.run_shard[r]
        out = np.empty(q.shape, np.int32)
        weights = None if self.weights is None else np.ones(q.shape, np.float32)
        for s in np.unique(shard):
            m = shard == s
            tokens = self.shards[s][local[m]]
            if tokens.max() >= self.vocab_size:
                raise token_id_error(self.paths[s], int(tokens.max()), self.vocab_size)
            out[m] = tokens
            if weights is not None and self.weights[s] is not None:
                weights[m] = self.weights[s][local[m]]
        return out, weights

    def batch(self, window_ids: np.ndarray) -> Batch:
        q = np.asarray(window_ids, np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        valid = q < self.num_tokens
        tokens, weights = self._gather(np.minimum(q, self.num_tokens - 1))
        if weights is None:
            return pack(tokens, valid, self.eos_id, self.pad_id)
        at = np.minimum(np.searchsorted(self.doc_ends, q + 1), len(self.doc_ends) - 1)
        ends = self.doc_ends[at] == q + 1
        return pack(tokens, valid, self.eos_id, self.pad_id, weights_BxT=weights, ends_BxT=ends)


class SyntheticWindows:
    """Endless generated windows; window i depends only on (seed, stream, i)."""

    num_windows = None

    def __init__(self, kind: str, vocab_size: int, seq_len: int, seed: int, stream: int):
        self.kind, self.vocab_size, self.seq_len = kind, vocab_size, seq_len
        self.seed, self.stream = seed, stream

    def batch(self, window_ids: np.ndarray) -> Batch:
        make = synthetic.markov_windows if self.kind == "markov" else synthetic.uniform_windows
        ids = np.asarray(window_ids, np.int64)
        tokens = make(ids, self.seq_len + 1, self.vocab_size, self.seed, self.stream)
        return pack(tokens, np.ones(tokens.shape, bool), None, 0)


class FirstRead(Iterator):
    """A data iterator whose next batch is read at once: a batch that cannot be read (a token id
    beyond model.vocab_size in a shard opened with data.verify_shards: false) is refused before
    a run writes anything. The same batches follow; the state is the data's."""

    def __init__(self, batches):
        self.batches = batches
        self._state = batches.get_state()
        self._first = [next(batches)]

    def __next__(self) -> Batch:
        return self._first.pop() if self._first else next(self.batches)

    def get_state(self) -> dict[str, Any]:
        return self._state if self._first else self.batches.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._first = []
        self.batches.set_state(state)


class Datasets:
    """Train and held-out batches of one process: its rows of every global batch.

    Rows of global batch b are global elements b*B .. b*B + B - 1 of an endless sequence of
    windows (shuffled anew each epoch by data.seed); process p of P holds the block of elements
    b*B + p*B/P + k, k < B/P, so the union over processes is the same for any P, and each block
    lands on its own process's devices, which hold rows p*B/P .. (p+1)*B/P - 1 of the batch.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        train: StreamWindows | SyntheticWindows,
        eval_: StreamWindows | SyntheticWindows | None,
        *,
        global_batch_size: int,
        process_index: int,
        process_count: int,
        seed: int,
        prefetch_batches: int,
        entropy_rate: float | None = None,
        inputs: dict[str, Any] | None = None,
        notes: list[str] | None = None,
        warnings: list[str] | None = None,
    ):
        self.tokenizer, self.train, self.eval = tokenizer, train, eval_
        # Lines for the run's console (e.g. inputs skipped as not UTF-8), and warnings.
        self.notes, self.warnings = notes or [], warnings or []
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.process_index, self.process_count = process_index, process_count
        self.seed, self.prefetch_batches = seed % 2**32, prefetch_batches
        self.seq_len = train.seq_len
        # Nats per token a perfect model reaches on the synthetic source; None for real data.
        self.entropy_rate = entropy_rate
        # What the stream depends on beyond the config (corpus, split), pinned by a run.
        self.inputs = inputs or {}

    def train_iterator(self) -> Iterator[Batch]:
        """Endless batches of this process; the iterator has get_state() / set_state(state)."""
        # Imported here so that `kiln prepare` and its worker processes never load JAX.
        import grain

        n = self.train.num_windows
        if n is None:
            ids = grain.MapDataset.range(sys.maxsize)
        else:
            ids = grain.MapDataset.range(n).shuffle(seed=self.seed).repeat()
        blocks = ids.batch(self.local_batch_size, drop_remainder=True)
        batches = blocks[self.process_index :: self.process_count].map(self.train.batch)
        options = grain.ReadOptions(
            num_threads=min(2, self.prefetch_batches), prefetch_buffer_size=self.prefetch_batches
        )
        return iter(batches.to_iter_dataset(options))

    def eval_batches(self, num_batches: int) -> list[Batch]:
        """`num_batches` held-out batches of this process; the same ones on every call."""
        if self.eval is None or self.eval.num_windows == 0:
            raise KilnError(
                "data.eval_fraction: no held-out documents (eval_fraction is 0 or the corpus has "
                "a single document); set data.eval_fraction > 0 or train.eval_every_steps: 0"
            )
        return held_out_batches(self.eval, num_batches, self.seed, self)

    def eval_sets(self, num_batches: int) -> dict[str, list[Batch]]:
        """Held-out batches by source name ('' for the one source of the shorthand)."""
        return {"": self.eval_batches(num_batches)}

    def combine_eval(self, by_source: dict[str, dict[str, float]]) -> dict[str, float]:
        """The eval metrics of the run from those of each set of `eval_sets`."""
        return by_source[""]

    def describe(self) -> dict[str, Any]:
        """Sizes for logs: windows, tokens and documents of each split."""
        out: dict[str, Any] = {"tokenizer": self.tokenizer.spec, "seq_len": self.seq_len}
        return {**out, **split_sizes(self.train, self.eval, self.entropy_rate)}


def split_sizes(train, held_out, entropy_rate: float | None) -> dict[str, Any]:
    """Documents, tokens and windows of real (not synthetic) train and held-out windows, and
    a synthetic corpus's entropy rate: what `describe` logs of one source."""
    out: dict[str, Any] = {}
    for name, split in (("train", train), ("eval", held_out)):
        if isinstance(split, StreamWindows):
            out[f"{name}_documents"] = split.num_documents
            out[f"{name}_tokens"] = split.num_tokens
            out[f"{name}_windows"] = split.num_windows
    if entropy_rate is not None:
        out["entropy_rate"] = entropy_rate
    return out


def held_out_batches(
    windows: StreamWindows | SyntheticWindows, num_batches: int, seed: int, layout: Datasets
) -> list[Batch]:
    """This process's rows of `num_batches` global batches of held-out windows, in an order
    fixed by `seed` (repeated when there are fewer windows than rows)."""
    b, p, k = layout.global_batch_size, layout.process_index, layout.local_batch_size
    elements = np.arange(num_batches)[:, None] * b + p * k + np.arange(k)
    if windows.num_windows is not None:
        order = np.random.default_rng(seed).permutation(windows.num_windows)
        elements = order[elements % windows.num_windows]
    return [windows.batch(row) for row in elements]
