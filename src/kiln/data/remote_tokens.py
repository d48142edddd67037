"""Token shards behind a URL, read by byte ranges through fsspec (memory maps need local files)."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.util import storage

# Positions closer than this many bytes are fetched in one range: fewer requests for the
# short gaps between rows of a batch, at the cost of reading the gap.
_MERGE_GAP_BYTES = 64 << 10
_CHUNK = 8 << 20


class RemoteTokens:
    """A 1-D token array stored in the file at `url`: indexing with an int array or a slice
    fetches only the byte ranges that hold the requested positions."""

    def __init__(self, url: str, dtype: np.dtype, length: int):
        self.url, self.dtype, self.length = url, np.dtype(dtype), length
        self.fs, self.path = storage.filesystem(url, url)

    def __len__(self) -> int:
        return self.length

    @property
    def shape(self) -> tuple[int]:
        return (self.length,)

    def _fetch(self, starts: np.ndarray, ends: np.ndarray) -> list[bytes]:
        size = self.dtype.itemsize
        with storage.reading(self.url):
            blobs = self.fs.cat_ranges(
                [self.path] * len(starts),
                (starts * size).tolist(),
                (ends * size).tolist(),
                on_error="raise",
            )
        if [len(b) for b in blobs] != ((ends - starts) * size).tolist():
            raise KilnError(
                f"{self.url}: shorter than the {self.length} tokens its manifest records; the "
                "shard is damaged, re-run kiln prepare"
            )
        return blobs

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.length)
            if stop <= start:
                return np.zeros(0, self.dtype)
            (blob,) = self._fetch(np.array([start]), np.array([stop]))
            return np.frombuffer(blob, self.dtype)[::step]
        idx_N = np.asarray(key, np.int64)
        if idx_N.size == 0:
            return np.zeros(idx_N.shape, self.dtype)
        if idx_N.min() < 0 or idx_N.max() >= self.length:
            raise IndexError(f"{self.url}: positions outside [0, {self.length})")
        wanted = np.unique(idx_N)
        gap = _MERGE_GAP_BYTES // self.dtype.itemsize
        cut = np.flatnonzero(np.diff(wanted) > gap) + 1
        starts = wanted[np.r_[0, cut]]
        ends = wanted[np.r_[cut - 1, len(wanted) - 1]] + 1
        blobs = self._fetch(starts, ends)
        values = np.concatenate([np.frombuffer(b, self.dtype) for b in blobs])
        offset = np.concatenate([[0], np.cumsum(ends - starts)[:-1]])
        run = np.searchsorted(starts, idx_N, side="right") - 1
        return values[offset[run] + idx_N - starts[run]]


def crc32_of_url(url: str) -> int:
    """CRC-32 of the bytes at a URL, streamed in chunks."""
    crc = 0
    with storage.open_read(url) as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc
