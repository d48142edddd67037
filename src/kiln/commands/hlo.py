"""Reading XLA's HLO text: the compiled module (collectives, their groups and how often a
step runs them; each instruction's type, JAX op and source line) and the dumps of its buffer
assignment and live ranges (`kiln compile --peak-buffers`). Regular expressions over the text
XLA prints; no JAX.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Iterator

from kiln.errors import RunStopped

COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s16": 16}
_BITS |= {"u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64}
_BITS |= {"c64": 64, "c128": 128}
# `%name = TYPE op(`; an async collective is counted at its `-done`, whose type is the result.
_OP = re.compile(r"=\s+(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-done)?\(")
# A computation's header, `%name (params) -> RESULT {` (ENTRY too): its name and result type.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.-]+)\s+\(.*\)\s+->\s+(.+?)\s*\{\s*$")
# Call sites in an instruction: a while's body and condition, a reduction's to_apply, a
# fusion's or call's computation, a conditional's branches; and a while's known trip count.
_CALLEE = re.compile(r"\b(body|condition|to_apply|calls)=%([\w.-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# For loops without one (the TPU compiler's): an instruction's name, result type, opcode and
# operands (`%a, %b`; a tuple's `/*index=5*/` comments taken out first), its rest after them;
# a compare's direction; an integer scalar type; a get-tuple-element's index.
_CALL = re.compile(r"^\s*(ROOT\s+)?%([\w.-]+)\s+=\s+(.*?)\s([a-z][\w-]*)\(([^()]*)\)(.*)$")
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_INTEGER = re.compile(r"^[su]\d+\[\]")
_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
# An instruction: `  %name = TYPE opcode(...), ..., metadata={op_name="..." stack_frame_id=97}`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.-]+)\s+= ")
# An instruction's name and array type; a ragged all-to-all's operand (its first argument).
_TYPED = re.compile(r"^\s*(?:ROOT\s+)?%([\w.-]+)\s+=\s+(\w+\[[\d,]*\])")
_RAGGED_OPERAND = re.compile(r"ragged-all-to-all\(%([\w.-]+)")
# An async collective's start (its `-done` names it as operand).
_START = re.compile(r"\s(?:" + "|".join(COLLECTIVES) + r")-start\(")
_DONE_OF = re.compile(r"-done\(%([\w.-]+)")
# The device groups of a collective, in the three forms of the HLO text: explicit lists
# `{{0,1},{2,3}}`, an iota `[groups,size]<=[...]`, or mesh axes `mesh['a'=8,'b'=1] {'a'}`.
_GROUP_LISTS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}")
_GROUP_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_GROUP_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
# An instruction's metadata: the JAX op, and the Python line directly or by a stack frame.
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


def collectives(hlo: str) -> dict[str, dict[str, int | None]]:
    """Collective ops of a compiled HLO module by kind: op count and bytes of their results
    (a ragged all-to-all's: the most it can move, the smaller of its operand and its result;
    listed only when the program has one).

    Only ops that exchange data between devices count (see `_read_module`). `ops` and `bytes`
    are static: an op in a loop body (the layer scan, accumulation, attention's query blocks) is
    counted once. `ops_per_step` and `bytes_per_step` count it as often as one step runs it
    (see `collective_ops`; None when a loop's trip count is unknown).
    """
    return collective_summary(hlo)[0]


def collective_summary(
    hlo: str,
) -> tuple[dict[str, dict[str, int | None]], dict[str, dict[str, int]] | None]:
    """(`collectives(hlo)`, the lower bound) from one reading of the module.

    The lower bound: per-step ops and bytes by kind (as `collectives`' `ops_per_step`,
    `bytes_per_step`) with each loop whose trip count the HLO does not give counted as running
    once, where `collectives` has None: every loop of a train step (the layer scan,
    accumulation, the pipeline's iterations) runs at least once (a conditional's branches all
    count, as in `collective_ops`). None when every trip count is known."""
    found, call_sites = _read_module(hlo)
    exact, at_least = _runs_per_step(call_sites, None), _runs_per_step(call_sites, 1)
    has_ragged = any(kind == "ragged-all-to-all" for _, kind, _ in found)
    # The ragged all-to-all is only expert parallelism's, on TPU and GPU.
    kinds = [k for k in COLLECTIVES if has_ragged or k != "ragged-all-to-all"]
    out: dict[str, dict[str, int | None]] = {
        kind: {"ops": 0, "bytes": 0, "ops_per_step": 0, "bytes_per_step": 0} for kind in kinds
    }
    bound = {kind: {"ops_per_step": 0, "bytes_per_step": 0} for kind in kinds}
    unknown = False
    for computation, kind, result in found:
        count, nbytes, runs = out[kind], shape_bytes(result), exact(computation)
        count["ops"] += 1
        count["bytes"] += nbytes
        if runs is None or count["ops_per_step"] is None:
            count["ops_per_step"] = count["bytes_per_step"] = None
            unknown = True
        else:
            count["ops_per_step"] += runs
            count["bytes_per_step"] += runs * nbytes
        bound[kind]["ops_per_step"] += at_least(computation)
        bound[kind]["bytes_per_step"] += at_least(computation) * nbytes
    return out, (bound if unknown else None)


def collective_ops(hlo: str) -> list[tuple[str, str, int | None]]:
    """Every collective op of a compiled HLO module: (kind, result type, runs per step).

    Runs per step: the product of the trip counts of the loops around the op (None when a
    loop's count is unknown: `collective_summary` gives a lower bound then); a conditional's
    branches count as taken. The
    TPU compiler emits a reduce-scatter as an `all-reduce-scatter` fusion (an all-reduce whose
    result is sliced inside it): it is a reduce-scatter with the fusion's result.
    """
    found, call_sites = _read_module(hlo)
    runs = _runs_per_step(call_sites, None)
    return [(kind, result, runs(computation)) for computation, kind, result in found]


def group_size(line: str) -> int | None:
    """Devices in each group of a collective's HLO line (the largest group); None: all of them."""
    lists = _GROUP_LISTS.search(line)
    if lists is not None:
        return max(len(group.split(",")) for group in re.findall(r"\{([\d,]+)\}", lists.group(1)))
    iota = _GROUP_IOTA.search(line)
    if iota is not None:
        return int(iota.group(1))
    mesh = _GROUP_MESH.search(line)
    if mesh is not None:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[axis]) for axis in re.findall(r"'([^']+)'", mesh.group(2)))
    return None


def collective_instructions(hlo: str) -> Iterator[tuple[str | None, str, str]]:
    """(computation, kind, result type) of every collective instruction of an HLO module's
    text, as XLA printed it: an async collective at its `-done`, and none left out or renamed
    (unlike `collective_ops`: groups of one device, a TPU's `all-reduce-scatter` fusion). The
    computation is None before the first header."""
    computation = None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            computation = header.group(1)
            continue
        match = _OP.search(line)
        if match is not None:
            yield computation, match.group(2), match.group(1)


def _read_module(hlo: str):
    """([(computation, kind, result type)] of the collectives, {callee: [(caller, runs)]}).

    `runs` is how often one run of the caller runs the callee: a while loop's trip count for
    its body (one more for its condition; the compiler's `known_trip_count`, else as
    `derived_trip_counts` reads it), None when unknown, 1 for any other call. A
    collective whose groups each hold one device (a reduction over a mesh axis of size 1,
    which XLA:CPU keeps in the program) exchanges nothing and is left out.
    """
    found, call_sites = [], {}
    derived = derived_trip_counts(hlo)
    starts: dict[str, int | None] = {}  # group size of each async collective's start
    types: dict[str, str] = {}  # array type of each instruction read
    computation, scatter_result = None, None  # scatter_result: of the all-reduce-scatter read
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            computation = header.group(1)
            is_scatter = computation.startswith("all-reduce-scatter")
            scatter_result = header.group(2) if is_scatter else None
            continue
        name = _INSTRUCTION.match(line)
        trips = _TRIPS.search(line)
        if trips is not None:
            trips = int(trips.group(1))
        elif name is not None:
            trips = derived.get((computation, name.group(1)))
        for role, callee in _CALLEE.findall(line):
            loop = {"body": trips, "condition": None if trips is None else trips + 1}
            call_sites.setdefault(callee, []).append((computation, loop.get(role, 1)))
        for branches in _BRANCHES.findall(line):
            for callee in re.findall(r"%([\w.-]+)", branches):
                call_sites.setdefault(callee, []).append((computation, 1))
        typed = _TYPED.match(line)
        if typed is not None:
            types[typed.group(1)] = typed.group(2)
        if name is not None and _START.search(line):
            starts[name.group(1)] = group_size(line)
        match = _OP.search(line)
        if match is None:
            continue
        done_of = _DONE_OF.search(line)
        if (starts.get(done_of.group(1)) if done_of else group_size(line)) == 1:
            continue
        kind, result = match.group(2), match.group(1)
        if kind == "all-reduce" and scatter_result is not None:
            kind, result = "reduce-scatter", scatter_result
        operand = _RAGGED_OPERAND.search(line) if kind == "ragged-all-to-all" else None
        if operand is not None and operand.group(1) in types:
            result = min(result, types[operand.group(1)], key=shape_bytes)
        found.append((computation, kind, result))
    return found, call_sites


def derived_trip_counts(hlo: str) -> dict[tuple[str, str], int]:
    """(computation, while instruction) -> trip count, for the while loops whose count the
    compiler does not write (the TPU compiler's) but whose HLO states it in the one form read:
    the condition's root `compare(get-tuple-element(param, i), constant(N))`, the body's
    element i `add(get-tuple-element(param, i), constant(step))` and the while's operand a
    `tuple(...)` whose element i is `constant(init)`, integer scalars each (a `copy` of a value
    taken as the value, as the TPU compiler inserts). Directions LT, LE, GT, GE and NE; any
    other form, or a loop that would not end, is left out (its count unknown)."""
    computations: dict[str, dict[str, tuple]] = {}  # computation -> name -> instruction
    roots: dict[str, str] = {}
    computation = None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            computation = header.group(1)
            computations[computation] = {}
            continue
        call = _CALL.match(_INDEX_COMMENT.sub("", line)) if computation is not None else None
        if call is None:
            continue
        root, name, hlo_type, opcode, operands, rest = call.groups()
        operands = [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]
        computations[computation][name] = (hlo_type, opcode, operands, rest)
        if root:
            roots[computation] = name

    out = {}
    for caller, instructions in computations.items():
        for name, (_, opcode, operands, rest) in instructions.items():
            if opcode != "while":
                continue
            callees = dict(_CALLEE.findall(rest))
            condition, body = callees.get("condition"), callees.get("body")
            if condition is None or body is None:
                continue
            trips = _trip_count(
                computations.get(condition, {}),
                roots.get(condition),
                computations.get(body, {}),
                roots.get(body),
                instructions.get(operands[0]) if len(operands) == 1 else None,
                instructions,
            )
            if trips is not None:
                out[(caller, name)] = trips
    return out


def _trip_count(cond, cond_root, body, body_root, init, caller) -> int | None:
    """A while loop's trip count from its condition, body and operand (`derived_trip_counts`):
    each a computation's instructions, name -> (type, opcode, operands, rest)."""
    compare = cond.get(cond_root)
    if compare is None or compare[1] != "compare" or len(compare[2]) != 2:
        return None
    index, limit = _counter(cond, compare[2][0]), _constant(cond, compare[2][1])
    direction = _DIRECTION.search(compare[3])
    step_root = body.get(body_root)
    if index is None or limit is None or direction is None or step_root is None:
        return None
    if step_root[1] != "tuple" or index >= len(step_root[2]):
        return None
    add = _look_through(body, step_root[2][index])
    if add is None or add[1] != "add" or len(add[2]) != 2:
        return None
    if _counter(body, add[2][0]) == index:
        step = _constant(body, add[2][1])
    elif _counter(body, add[2][1]) == index:
        step = _constant(body, add[2][0])
    else:
        return None
    if init is None or init[1] != "tuple" or index >= len(init[2]):
        return None
    start = _constant(caller, init[2][index])
    if step is None or start is None:
        return None
    return loop_trips(start, limit, step, direction.group(1))


def _look_through(instructions, name):
    """The instruction `name` is, or copies through a chain of copies (None if not there)."""
    while name in instructions and instructions[name][1] == "copy":
        name = instructions[name][2][0]
    return instructions.get(name)


def _constant(instructions, name) -> int | None:
    """The value of an integer scalar constant (through copies); None for anything else."""
    found = _look_through(instructions, name)
    if found is None or found[1] != "constant" or not _INTEGER.match(found[0]):
        return None
    return int(found[2][0]) if re.fullmatch(r"-?\d+", found[2][0]) else None


def _counter(instructions, name) -> int | None:
    """i where `name` is an integer scalar get-tuple-element(parameter, i) (through copies)."""
    found = _look_through(instructions, name)
    if found is None or found[1] != "get-tuple-element" or not _INTEGER.match(found[0]):
        return None
    param = instructions.get(found[2][0])
    index = _TUPLE_INDEX.search(found[3])
    if param is None or param[1] != "parameter" or index is None:
        return None
    return int(index.group(1))


def loop_trips(start: int, limit: int, step: int, direction: str) -> int | None:
    """How often `for (i = start; i <direction> limit; i += step)` runs its body; None when
    it would not end or the direction is none of LT, LE, GT, GE, NE."""
    if direction in ("LE", "GE"):  # i <= limit is i < limit + 1 (integers)
        direction, limit = direction[0] + "T", limit + (1 if direction == "LE" else -1)
    if direction == "GT":  # counting down: as counting up from -start to -limit
        direction, start, limit, step = "LT", -start, -limit, -step
    if direction == "LT":
        if start >= limit:
            return 0
        return -(-(limit - start) // step) if step > 0 else None
    if direction == "NE":
        if start == limit:
            return 0
        if step == 0 or (limit - start) % step or (limit - start) // step < 0:
            return None
        return (limit - start) // step
    return None


def _runs_per_step(call_sites, unknown_trips: int | None):
    """computation -> how often one run of the module runs it (a loop count unknown: taken as
    `unknown_trips`, None makes the runs None)."""

    @functools.cache
    def runs(computation):
        if computation not in call_sites:  # the entry computation (or ops outside any header)
            return 1
        total = 0
        for caller, times in call_sites[computation]:
            outer = runs(caller)
            if times is None and unknown_trips is not None:
                times = unknown_trips
            if times is None or outer is None:
                return None
            total += outer * times
        return total

    return runs


def arrays(hlo_type: str) -> list[tuple[str, str]]:
    """(dtype, dims) of each array of an HLO type: `(bf16[8,128]{1,0}, f32[])` ->
    `[("bf16", "8,128"), ("f32", "")]`."""
    return _ARRAY.findall(hlo_type)


def shape_bytes(hlo_type: str) -> int:
    """Bytes of an HLO result type: an array `bf16[8,128]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in arrays(hlo_type):
        bits = _BITS.get(dtype, 8)  # float8 variants (f8e4m3fn, ...) are one byte
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


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


# ---------------------------------------------------------------------------------------------
# The buffer-assignment and live-range dumps


# `    fusion.3{}: 4194304 bytes (cumulative: 8388608 bytes)` under `Live ranges at T (peak):`.
_PEAK_VALUE = re.compile(r"^\s+(\S+): (\d+) bytes \(cumulative")
# `allocation 294: size 46666448, preallocated-temp:` and, under it,
# ` value: <2600 copy.187 @0> (size=262144,offset=40435712): f32[4,128,128]{2,1,0}`.
_ALLOCATION = re.compile(r"^allocation (\d+):")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+?)( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")


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


def _path(path: str) -> str:
    """`path` relative to the working directory when under it."""
    relative = os.path.relpath(path) if os.path.isabs(path) else path
    return path if relative.startswith("..") else relative


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)
