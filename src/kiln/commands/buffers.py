"""`kiln compile --peak-buffers`: the buffers live at the peak of a compiled step, from XLA's dump.

The step is compiled with `xla_dump_to`: XLA then writes, beside the optimized HLO module, its
buffer assignment (each value's allocation, offset and size) and the live ranges of the
scheduled module, which end with the values live at the peak (`Live ranges at T (peak):`).
Each of those is read here with its allocation slice, and the HLO instruction that defines it
with the JAX op (`metadata={op_name=...}`) and the Python line that made it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from kiln.errors import RunStopped
from kiln.util.scratch import temporary_directory

# `    fusion.3{}: 4194304 bytes (cumulative: 8388608 bytes)` under `Live ranges at T (peak):`.
_PEAK_VALUE = re.compile(r"^\s+(\S+): (\d+) bytes \(cumulative")
# `allocation 294: size 46666448, preallocated-temp:` and, under it,
# ` value: <2600 copy.187 @0> (size=262144,offset=40435712): f32[4,128,128]{2,1,0}`.
_ALLOCATION = re.compile(r"^allocation (\d+):")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+?)( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
# `  %name = TYPE opcode(...), ..., metadata={op_name="..." stack_frame_id=97}`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.-]+) = ")
_METADATA = re.compile(r"metadata=\{(.*?)\}(?:,|$)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_SOURCE = re.compile(r'source_file="((?:[^"\\]|\\.)*)" source_line=(\d+)')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
# The module's stack-frame tables: `1 "path.py"` (FileNames), `35 {file_name_id=8 ...
# line=284 ...}` (FileLocations), `97 {file_location_id=35 parent_frame_id=97}` (StackFrames).
_NAMED = re.compile(r'^(\d+) "(.*)"$')
_LOCATION = re.compile(r"^(\d+) \{file_name_id=(\d+) .*?\bline=(\d+)")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+)")
# An array type's layout, `{2,1,0}` or `{2,3,1,0:T(8,128)}`, left out of the shapes shown.
_LAYOUT = re.compile(r"\{[^{}]*\}")


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


def peak_values(live_range: str) -> list[tuple[str, int]]:
    """(value, bytes) of every value live at the peak of XLA's live-range dump."""
    _, found, peak = live_range.partition(" (peak):\n")
    if not found:
        raise RunStopped("--peak-buffers: XLA's live-range dump has no `(peak):` section")
    values = []
    for line in peak.splitlines():
        match = _PEAK_VALUE.match(line)
        if match is None:
            break
        values.append((_value_key(match.group(1)), int(match.group(2))))
    return values


def assigned_slices(assignment: str) -> dict[str, tuple[int, int, str, bool]]:
    """value -> (allocation, offset, shape, phi) from XLA's buffer-assignment dump."""
    slices, allocation = {}, -1
    for line in assignment.splitlines():
        header = _ALLOCATION.match(line)
        if header is not None:
            allocation = int(header.group(1))
            continue
        value = _VALUE.match(line)
        if value is not None:
            name, phi, _, offset, shape = value.groups()
            slices[_value_key(name)] = (allocation, int(offset), _shape(shape), bool(phi))
    return slices


def hlo_instructions(hlo: str) -> dict[str, tuple[str, str, str]]:
    """instruction -> (result type, op_name, file:line) of an HLO module's text."""
    files, locations, frames = _stack_frames(hlo)

    def source(metadata: str) -> str:
        direct = _SOURCE.search(metadata)
        if direct is not None:
            return f"{_path(_unescape(direct.group(1)))}:{direct.group(2)}"
        frame = _FRAME_ID.search(metadata)
        location = locations.get(frames.get(int(frame.group(1)), -1)) if frame else None
        if location is None or location[0] not in files:
            return ""
        return f"{_path(files[location[0]])}:{location[1]}"

    out = {}
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        rest = line[match.end() :]
        result = rest.split(" ", 1)[0] if not rest.startswith("(") else _tuple_type(rest)
        metadata = _METADATA.search(rest)
        metadata = metadata.group(1) if metadata else ""
        op_name = _OP_NAME.search(metadata)
        out[match.group(1)] = (
            _shape(result),
            _unescape(op_name.group(1)) if op_name else "",
            source(metadata),
        )
    return out


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


def _value_key(name: str) -> str:
    """A value's name as both dumps agree on it: `name{1}`; an array's `name{}` as `name`."""
    return name.removesuffix("{}")


def _shape(hlo_type: str) -> str:
    """An HLO type without layouts and index comments: `f32[4,128]{1,0}` -> `f32[4,128]`."""
    return re.sub(r"/\*index=\d+\*/", "", _LAYOUT.sub("", hlo_type)).replace(", ", ",")


def _tuple_type(text: str) -> str:
    """The parenthesized tuple type at the start of `text`."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return text[: i + 1]
    return text


def _stack_frames(hlo: str) -> tuple[dict[int, str], dict[int, tuple[int, int]], dict[int, int]]:
    """The module's FileNames, FileLocations (file id, line) and StackFrames (location id)."""
    files, locations, frames, section = {}, {}, {}, ""
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif line.startswith(("%", "ENTRY")):  # the computations: the tables are behind
            break
        elif section == "FileNames" and (named := _NAMED.match(line)):
            files[int(named.group(1))] = _unescape(named.group(2))
        elif section == "FileLocations" and (location := _LOCATION.match(line)):
            locations[int(location.group(1))] = (int(location.group(2)), int(location.group(3)))
        elif section == "StackFrames" and (frame := _FRAME.match(line)):
            frames[int(frame.group(1))] = int(frame.group(2))
    return files, locations, frames


def _path(path: str) -> str:
    """`path` relative to the working directory when under it."""
    relative = os.path.relpath(path) if os.path.isabs(path) else path
    return path if relative.startswith("..") else relative


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)
