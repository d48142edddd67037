"""`kiln distill` with `distillation.teacher_logits_dir`: the stored teacher rows of every batch.

The store is indexed by (step, global row). The data iterator's state says which global batch
comes next (grain's `next_index`), so restoring the iterator from a checkpoint restores the
reader's position with it: the two cannot drift apart across a resume. Every stored row also
carries the CRC-32 of the inputs and targets it was computed from; a batch row that does not
match is refused, so a reader out of step with the data is an error, never a silent mismatch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kiln.config import Config
from kiln.distill import checks
from kiln.distill.store import FIELD, open_shard, read_manifest, row_crcs, shards
from kiln.errors import KilnError

# Batch keys the reader adds: teacher_values f32 [B,S,K], teacher_ids i32 [B,S,K], teacher_lse f32 [B,S].
TEACHER_KEYS = ("teacher_values", "teacher_ids", "teacher_lse")
_OPEN_SHARDS = 4  # shards kept memory-mapped (a step reads one per writer-process block)


class StoreReader:
    """This process's rows of a store, step by step."""

    def __init__(
        self, directory: Path, manifest: dict[str, Any], process_index: int, process_count: int,
        *, verify: bool,
    ):  # fmt: skip
        self.directory, self.manifest, self.verify = Path(directory), manifest, verify
        batch = manifest["global_batch_size"]
        if batch % process_count:
            raise KilnError(
                f"train.global_batch_size: {batch} is not divisible by the {process_count} processes"
            )
        n = batch // process_count
        self.rows = (process_index * n, (process_index + 1) * n)
        self.steps = manifest["steps"]
        self.shards = shards(manifest)
        for _, _, name in self.shards:
            if not (self.directory / name).is_dir():
                raise KilnError(
                    f"{FIELD}: shard {self.directory / name} is missing; the store is incomplete "
                    "(run `kiln teacher-logits` again with the same config and --out to finish it)"
                )
        self._open: OrderedDict[str, dict] = OrderedDict()

    def _shard(self, steps: tuple[int, int], rows: tuple[int, int], name: str) -> dict:
        if name not in self._open:
            shape = (steps[1] - steps[0], rows[1] - rows[0], self.manifest["seq_len"],
                     self.manifest["top_k"])  # fmt: skip
            self._open[name] = open_shard(
                self.directory / name, shape, self.manifest["dtype"], verify=self.verify
            )
            while len(self._open) > _OPEN_SHARDS:
                self._open.popitem(last=False)
        self._open.move_to_end(name)
        return self._open[name]

    def read(self, step: int) -> dict[str, np.ndarray]:
        """Rows of global batch `step` of this process: the teacher keys and `row_crc`."""
        if not 0 <= step < self.steps:
            raise KilnError(
                f"train.steps: the run reached step {step + 1}, but the store in {self.directory} "
                f"covers {self.steps} steps"
            )
        lo, hi = self.rows
        parts: list[dict] = []
        for steps, rows, name in self.shards:
            if not steps[0] <= step < steps[1] or rows[1] <= lo or rows[0] >= hi:
                continue
            arrays = self._shard(steps, rows, name)
            i, a, b = step - steps[0], max(lo, rows[0]) - rows[0], min(hi, rows[1]) - rows[0]
            parts.append({k: np.asarray(v[i, a:b]) for k, v in arrays.items()})
        out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        values = out.pop("values")
        if self.manifest["dtype"] == "bfloat16":
            values = values.view(ml_dtypes.bfloat16)
        return {
            "teacher_values": values.astype(np.float32),
            "teacher_ids": out.pop("ids"),
            "teacher_lse": out.pop("lse"),
            "row_crc": out.pop("row_crc"),
        }


def batch_index(state: dict[str, Any]) -> int:
    """The index of the next global batch of a data iterator state (grain's `next_index`)."""
    if not isinstance(state, dict) or not isinstance(state.get("next_index"), int):
        raise KilnError(
            f"{FIELD}: the data iterator's state {state!r} does not say which batch comes next; "
            "offline teacher logits need the position of the data stream"
        )
    return state["next_index"]


class WithTeacherLogits(Iterator):
    """A data iterator whose batches carry the stored teacher rows; its state is the data's."""

    def __init__(self, batches, reader: StoreReader):
        self.batches, self.reader = batches, reader
        self.step = batch_index(batches.get_state())

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self.batches)
        rows = self.reader.read(self.step)
        stored, got = rows.pop("row_crc"), row_crcs(batch)
        if not np.array_equal(stored, got):
            row = self.reader.rows[0] + int(np.flatnonzero(stored != got)[0])
            raise KilnError(
                f"{FIELD}: row {row} of batch {self.step} is not the one the store in "
                f"{self.reader.directory} was written from (its inputs differ); the store belongs "
                "to another token stream (write it again for this config)"
            )
        self.step += 1
        return {**batch, **rows}

    def get_state(self) -> dict[str, Any]:
        return self.batches.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.batches.set_state(state)
        self.step = batch_index(state)


def check(config: Config) -> dict[str, Any]:
    """The store's manifest, checked against the config (no data read); KilnError if they differ."""
    manifest = read_manifest(Path(config.distillation.teacher_logits_dir).expanduser())
    checks.check_config(config, manifest)
    return manifest


def with_teacher_logits(config: Config, datasets, batches) -> WithTeacherLogits:
    """`batches` with the store's teacher rows, after checking the store against the stream."""
    directory = Path(config.distillation.teacher_logits_dir).expanduser()
    manifest = check(config)
    checks.check_stream(config, manifest, datasets)
    reader = StoreReader(
        directory,
        manifest,
        datasets.process_index,
        datasets.process_count,
        verify=config.data.verify_shards,
    )
    return WithTeacherLogits(batches, reader)
