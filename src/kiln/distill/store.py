"""The store of `kiln teacher-logits`: its layout, manifest and shards.

A store holds, for every token of the first `steps` global batches of a config's training
stream, the teacher's top-k logits (after its soft-cap, not divided by the temperature), their
token ids, and lse = logsumexp(teacher_logits / T) over the whole vocabulary. Layout:

  manifest.json         what the store is (teacher run, step and model, data, batch, steps, k,
                        dtype, temperature); written before any shard, fixed for the store's life
  steps-A-B.rows-R0-R1/ one shard: global batches A..B-1, global rows R0..R1-1 of each
      values.npy        [steps, rows, seq_len, k]  float32, or bfloat16 stored as uint16
      ids.npy           [steps, rows, seq_len, k]  int32
      lse.npy           [steps, rows, seq_len]     float32
      row_crc.npy       [steps, rows]              uint32 CRC-32 of each row's inputs and targets
      shard.json        bytes and CRC-32 of each file (written last)

A shard is written in a hidden staging directory and renamed into place once complete, so a
killed writer leaves only whole shards (and a staging directory the next run removes). Each
process of the writer writes the rows of its own devices: the shards of a store cover rows
in `writer_processes` equal blocks, whatever the reader's process count.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError, write_error
from kiln.util.atomic import write_whole
from kiln.util.checksums import crc32_of
from kiln.util.files import pid_alive, write_array

MANIFEST = "manifest.json"
SHARD_INFO = "shard.json"
VERSION = 1
DTYPES = ("bfloat16", "float32")
ARRAYS = ("values", "ids", "lse", "row_crc")
FIELD = "distillation.teacher_logits_dir"
# What running `kiln teacher-logits` again does after a failed write.
FINISH = "finish the store (the shards written so far are kept)"


def bytes_per_token(top_k: int, dtype: str) -> int:
    """Storage of one token: k values and k int32 ids, plus the float32 lse."""
    return top_k * ((2 if dtype == "bfloat16" else 4) + 4) + 4


def shard_name(steps: tuple[int, int], rows: tuple[int, int]) -> str:
    return f"steps-{steps[0]:08d}-{steps[1]:08d}.rows-{rows[0]:06d}-{rows[1]:06d}"


def shards(manifest: dict[str, Any]) -> list[tuple[tuple[int, int], tuple[int, int], str]]:
    """Every shard of a complete store: (steps [a, b), rows [r0, r1), directory name)."""
    total, per = manifest["steps"], manifest["shard_steps"]
    writers, batch = manifest["writer_processes"], manifest["global_batch_size"]
    block = batch // writers
    out = []
    for a in range(0, total, per):
        steps = (a, min(a + per, total))
        for q in range(writers):
            rows = (q * block, (q + 1) * block)
            out.append((steps, rows, shard_name(steps, rows)))
    return out


def row_crcs(batch: dict[str, np.ndarray]) -> np.ndarray:
    """CRC-32 of each row's inputs and targets: ties a stored row to the batch row it was made from."""
    inputs = np.ascontiguousarray(batch["inputs"], np.int32)
    targets = np.ascontiguousarray(batch["targets"], np.int32)
    return np.array(
        [zlib.crc32(t.tobytes(), zlib.crc32(i.tobytes())) for i, t in zip(inputs, targets)],
        np.uint32,
    )


# ---------------------------------------------------------------------------------------------
# Manifest


def read_manifest(directory: Path, what: str = FIELD) -> dict[str, Any]:
    """The store's manifest; a KilnError naming `what` if there is none or it is damaged."""
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        raise KilnError(
            f"{what}: {directory} is not a directory; write the store with `kiln teacher-logits`"
        )
    if not path.is_file():
        raise KilnError(
            f"{what}: {directory} has no {MANIFEST}; it is not a store of `kiln teacher-logits`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KilnError(f"{what}: {path} is unreadable ({e}); write the store again") from None
    if not isinstance(manifest, dict) or manifest.get("version") != VERSION:
        raise KilnError(
            f"{what}: {path} is not a version-{VERSION} manifest of `kiln teacher-logits`"
        )
    return manifest


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temporary file, fsync, rename); a failed write leaves nothing."""
    write_whole(path, json.dumps(obj, indent=1, sort_keys=True))


def first_difference(want: Any, got: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    """(dotted key, wanted, found) of the first difference between two JSON trees, or None."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(set(want) | set(got)):
            found = first_difference(want.get(key), got.get(key), f"{prefix}{key}.")
            if found:
                return found
        return None
    return None if want == got else (prefix.rstrip("."), want, got)


# ---------------------------------------------------------------------------------------------
# Shards


def write_shard(directory: Path, name: str, arrays: dict[str, np.ndarray]) -> None:
    """Write one shard's arrays into a staging directory, then rename it into place; a failed
    write (a full disk) removes the staging directory and is a RunStopped naming the shard."""
    staging = directory / f".{name}.partial-{socket.gethostname()}-{os.getpid()}"
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        info = {}
        for key in ARRAYS:
            path = staging / f"{key}.npy"
            write_array(path, arrays[key], npy=True, sync=True)
            info[key] = {"bytes": path.stat().st_size, "crc32": f"{crc32_of(path):08x}"}
        write_json(staging / SHARD_INFO, info)
        os.replace(staging, directory / name)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_error(e, directory / name, then=FINISH) from None
        raise


def remove_stale_staging(directory: Path) -> None:
    """Delete staging directories that killed writers on this host left behind."""
    host = socket.gethostname()
    for path in directory.glob(".*.partial-*"):
        pid = path.name.rpartition(f".partial-{host}-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def shard_complete(path: Path) -> bool:
    """A published shard: its shard.json names every array, at the sizes on disk."""
    try:
        info = json.loads((path / SHARD_INFO).read_text())
        return all((path / f"{k}.npy").stat().st_size == info[k]["bytes"] for k in ARRAYS)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def open_shard(path: Path, shape: tuple[int, ...], dtype: str, *, verify: bool) -> dict:
    """A shard's arrays, memory-mapped and checked against the manifest; KilnError if damaged."""

    def damaged(why: str) -> KilnError:
        return KilnError(
            f"{FIELD}: shard {path} is damaged ({why}); delete it and run `kiln teacher-logits` "
            "again with the same config and --out (it rewrites the missing shards)"
        )

    if not path.is_dir():
        raise KilnError(
            f"{FIELD}: shard {path} is missing; the store is incomplete (run `kiln "
            "teacher-logits` again with the same config and --out to finish it)"
        )
    try:
        info = json.loads((path / SHARD_INFO).read_text())
    except (OSError, ValueError) as e:
        raise damaged(f"{SHARD_INFO}: {e}") from None
    steps, rows, seq, k = shape
    stored = np.uint16 if dtype == "bfloat16" else np.float32
    want = {
        "values": ((steps, rows, seq, k), np.dtype(stored)),
        "ids": ((steps, rows, seq, k), np.dtype(np.int32)),
        "lse": ((steps, rows, seq), np.dtype(np.float32)),
        "row_crc": ((steps, rows), np.dtype(np.uint32)),
    }
    out = {}
    for key, (want_shape, want_dtype) in want.items():
        file = path / f"{key}.npy"
        try:
            size = file.stat().st_size
            if size != info[key]["bytes"]:
                raise damaged(f"{file.name} has {size} bytes, {info[key]['bytes']} were written")
            if verify and f"{crc32_of(file):08x}" != info[key]["crc32"]:
                raise damaged(f"{file.name} fails its CRC-32")
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise damaged(f"{file.name}: {e}") from None
        if array.shape != want_shape or array.dtype != want_dtype:
            raise damaged(
                f"{file.name} is {array.dtype}{list(array.shape)}, expected "
                f"{want_dtype}{list(want_shape)}"
            )
        out[key] = array
    return out
