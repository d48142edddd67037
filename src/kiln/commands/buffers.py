"""`kiln compile --peak-buffers`: the buffers live at the peak of a compiled step, from XLA's dump.

The step is compiled with `xla_dump_to`: XLA then writes, beside the optimized HLO module, its
buffer assignment (each value's allocation, offset and size) and the live ranges of the
scheduled module, which end with the values live at the peak (`Live ranges at T (peak):`).
Each of those is read (`kiln.commands.hlo`) with its allocation slice, and the HLO instruction
that defines it with the JAX op (`metadata={op_name=...}`) and the Python line that made it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from kiln.commands.hlo import assigned_slices, hlo_instructions, peak_values
from kiln.errors import RunStopped
from kiln.util.scratch import temporary_directory


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One buffer live at the compiled step's peak, per device."""

    bytes: int
    shape: str  # dtype[dims], e.g. f32[4,128,384]; a tuple (its index table) in parentheses
    instruction: str  # the optimized HLO's value: `name` or `name{tuple index}`
    op_name: str  # its metadata: the JAX op (`jit(step)/.../dot_general`) or argument path
    source: str  # file:line of the Python that made it; "" when the HLO names none
    phi: bool  # a loop or conditional's merged value: the carry, not an array of its own
    shared: int  # other values live at the peak in the same slice of memory (counted once)


def compiler_options(directory: str | Path) -> dict[str, Any]:
    """XLA options that dump the optimized module, buffer assignment and live ranges to `directory`."""
    return {"xla_dump_to": str(directory), "xla_dump_hlo_as_text": True}


@contextlib.contextmanager
def dump_directory() -> Iterator[Path]:
    """A temporary directory for XLA's dump, with JAX's persistent compilation cache off.

    A program found in the cache is not compiled, so nothing would be dumped. JAX decides
    whether its cache is in use once, at the first compile: `reset_cache` makes it decide again.
    The directory is removed however the command ends: a signal ends it while XLA's compile
    threads are still writing (kiln.util.scratch).
    """
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        with temporary_directory("kiln-xla-dump-") as directory:
            yield directory
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def peak_buffers(directory: str | Path, count: int) -> list[PeakBuffer]:
    """The `count` largest buffers live at the peak of the module XLA dumped into `directory`."""
    live_range = _dumped(directory, "after_optimizations-live-range.txt")
    prefix = live_range.name.removesuffix("-live-range.txt")
    slices = assigned_slices((live_range.parent / f"{prefix}-buffer-assignment.txt").read_text())
    instructions = hlo_instructions((live_range.parent / f"{prefix}.txt").read_text())
    return largest(peak_values(live_range.read_text()), slices, instructions, count)


def _dumped(directory: str | Path, suffix: str) -> Path:
    """The one file of the dump whose name ends in `suffix` (RunStopped when XLA wrote none)."""
    found = sorted(Path(directory).glob(f"*{suffix}"))
    if len(found) != 1:
        raise RunStopped(
            f"--peak-buffers: XLA's dump holds {len(found)} files *{suffix} (one expected); "
            f"the XLA of jax {jax.__version__} may name its dumps differently"
        )
    return found[0]


def largest(
    values: list[tuple[str, int]],
    slices: dict[str, tuple[int, int, str, bool]],
    instructions: dict[str, tuple[str, str, str]],
    count: int,
) -> list[PeakBuffer]:
    """The `count` largest of `values`, one per allocation slice, by bytes then name.

    Values in one slice (allocation and offset) at the peak are one buffer in memory: a
    bitcast's or a loop's value over its operand's bytes. The largest (the first of equals by
    name) stands for them, with how many others it holds.
    """
    by_slice: dict[Any, list[tuple[str, int]]] = {}
    for name, nbytes in sorted(values, key=lambda v: (-v[1], v[0])):
        where = slices.get(name)
        by_slice.setdefault(where[:2] if where else name, []).append((name, nbytes))
    out = []
    for (name, nbytes), *others in by_slice.values():
        defining = name.split("{", 1)[0]
        result, op_name, source = instructions.get(defining, ("", "", ""))
        shape, phi = slices[name][2:] if name in slices else (result, False)
        out.append(PeakBuffer(nbytes, shape, name, op_name, source, phi, len(others)))
    return out[:count]


def format_buffers(buffers: list[PeakBuffer]) -> list[str]:
    """Lines of the human report: bytes, shape, value, JAX op and source line, in columns."""
    values = [
        b.instruction
        + (" (phi)" if b.phi else "")
        + (f" (+{b.shared} in its slice)" if b.shared else "")
        for b in buffers
    ]
    shape_width = max((len(b.shape) for b in buffers), default=0)
    value_width = max(map(len, values), default=0)
    return [
        f"    {b.bytes / 1e6:10.3f} MB  {b.shape:<{shape_width}}  {value:<{value_width}}  "
        f"{b.op_name or '(no op_name)'}{'  ' + b.source if b.source else ''}"
        for b, value in zip(buffers, values, strict=True)
    ]
