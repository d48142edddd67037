"""Raw inputs: resolving paths, URLs and globs (and `stdlib:`), planning work, reading documents."""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kiln.errors import KilnError, first_line
from kiln.util import storage
from kiln.util.storage import Location

Format = Literal["text", "jsonl", "parquet"]
# Rows per Arrow batch read from Parquet: memory is bounded by a batch, never a whole file.
PARQUET_BATCH_ROWS = 1024
FORMATS: tuple[str, ...] = ("text", "jsonl", "parquet")
STDLIB_PREFIX = "stdlib:"
BUNDLED_PREFIX = "kiln:"  # data files shipped inside the kiln package (kiln/data/bundled/)
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")


def bundled_root() -> Path:
    """The directory of the data files shipped with kiln (e.g. its embedded chat set)."""
    return Path(__file__).resolve().parent / "bundled"


def stdlib_root() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_inputs(patterns: Sequence[str], what: str = "data.paths") -> list[Location]:
    """Files named by paths, directories (all files below) or globs; `stdlib:GLOB` is a glob
    inside the running interpreter's standard library (site-packages excluded), `kiln:GLOB`
    one among the data files shipped with kiln. A URL (gs://, s3://, hf://, memory://, ...;
    see kiln.util.storage) gives its files as URL strings."""
    if not patterns:
        raise KilnError(
            f"{what}: no input given; allowed: files, directories, globs, stdlib:GLOB, kiln:GLOB"
        )
    found: dict[Location, None] = {}
    for pattern in patterns:
        matches = _expand(pattern, what)
        if not matches:
            raise KilnError(f"{what}: {pattern!r} matches no files")
        found.update(dict.fromkeys(matches))
    return sorted(found, key=str)


def _expand(pattern: str, what: str) -> list[Location]:
    if pattern.startswith(BUNDLED_PREFIX):
        root = bundled_root()
        hits = glob.glob(pattern[len(BUNDLED_PREFIX) :], root_dir=root, recursive=True)
        return [(root / h).absolute() for h in hits if (root / h).is_file()]
    if storage.is_remote(storage.location(pattern, what)):
        return list(storage.expand(pattern, what))
    if storage.scheme(pattern) == "file":
        pattern = str(storage.location(pattern, what))
    if pattern.startswith(STDLIB_PREFIX):
        root = stdlib_root()
        hits = _stdlib_glob(pattern[len(STDLIB_PREFIX) :], root)
        return [
            (root / h).absolute()
            for h in hits
            if not set(Path(h).parts) & set(_NOT_STDLIB) and (root / h).is_file()
        ]
    path = Path(pattern).expanduser()
    if glob.has_magic(pattern):
        hits = glob.glob(str(path), recursive=True)
        return [Path(h).absolute() for h in hits if Path(h).is_file()]
    if path.is_dir():
        return [
            p.absolute()
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
    if path.exists():
        return [path.absolute()]
    return []


def _stdlib_glob(pattern: str, root: Path) -> list[str]:
    """`glob(pattern)` inside `root`, a leading `**` not descending into the excluded
    directories (site-packages holds most of an interpreter's files)."""
    head, sep, rest = pattern.partition("/")
    if head != "**" or not sep:
        return glob.glob(pattern, root_dir=root, recursive=True)
    hits = glob.glob(rest, root_dir=root, recursive=True)  # `**` as no directory
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_dir() and not entry.name.startswith(".") and entry.name not in _NOT_STDLIB:
            below = glob.glob(pattern, root_dir=entry.path, recursive=True)
            hits += [f"{entry.name}/{h}" for h in below]
    return hits


def check_regular(files: Sequence[Location], what: str) -> None:
    """KilnError for a local input that is not a regular file: a FIFO or device would block or
    never end, and its (size, mtime) cannot key a cache."""
    for f in files:
        if isinstance(f, Path) and f.exists() and not f.is_file():
            raise KilnError(
                f"{what}: {str(f)!r} is not a regular file (a FIFO, socket or device); "
                "allowed: files, directories, globs, stdlib:GLOB"
            )


def input_identity(files: Sequence[Location]) -> list[dict[str, Any]]:
    """(path, size, mtime or a URL's version tag) of every input: what a cache or manifest is
    keyed by."""
    return [storage.identity(f) for f in files]


@dataclass(frozen=True)
class Task:
    """A unit of `prepare` work that becomes one shard: whole text files, a byte range of
    one JSONL file, or some row groups of one Parquet file."""

    fmt: str
    paths: tuple[str, ...]
    start: int = 0  # jsonl: byte range [start, end)
    end: int = -1
    row_groups: tuple[int, ...] = ()  # parquet
    num_bytes: int = 0


def plan_tasks(
    fmt: str, files: Sequence[Location], sizes: Sequence[int], target_bytes: int
) -> list[Task]:
    """Cut the inputs into tasks of about `target_bytes`, in input order."""
    if fmt == "text":
        tasks, group, group_bytes = [], [], 0
        for f, size in zip(files, sizes):
            group.append(str(f))
            group_bytes += size
            if group_bytes >= target_bytes:
                tasks.append(Task("text", tuple(group), num_bytes=group_bytes))
                group, group_bytes = [], 0
        if group:
            tasks.append(Task("text", tuple(group), num_bytes=group_bytes))
        return tasks
    if fmt == "jsonl":
        return [t for f, size in zip(files, sizes) for t in _jsonl_tasks(f, size, target_bytes)]
    return [t for f in files for t in _parquet_tasks(f, target_bytes)]


def _jsonl_tasks(path: Location, size: int, target_bytes: int) -> Iterator[Task]:
    start = 0
    with _open(path) as fh:
        while start < size:
            end = min(start + target_bytes, size)
            if end < size:  # move the cut just past the next newline
                fh.seek(end)
                fh.readline()
                end = fh.tell()
            yield Task("jsonl", (str(path),), start, end, num_bytes=end - start)
            start = end


def _parquet_tasks(path: Location, target_bytes: int) -> Iterator[Task]:
    meta = _parquet_file(path).metadata
    group: list[int] = []
    group_bytes = 0
    for i in range(meta.num_row_groups):
        group.append(i)
        group_bytes += meta.row_group(i).total_byte_size
        if group_bytes >= target_bytes:
            yield Task("parquet", (str(path),), row_groups=tuple(group), num_bytes=group_bytes)
            group, group_bytes = [], 0
    if group:
        yield Task("parquet", (str(path),), row_groups=tuple(group), num_bytes=group_bytes)


OnDecodeError = Literal["error", "skip", "replace"]


@dataclass
class DecodeErrors:
    """Inputs that were not UTF-8, under data.on_decode_error skip or replace."""

    skipped: int = 0
    replaced: int = 0
    first: str | None = None  # the first one, as path or path:line

    def add(self, policy: OnDecodeError, where: str) -> None:
        if policy == "skip":
            self.skipped += 1
        else:
            self.replaced += 1
        self.first = self.first or where


def read_documents(
    task: Task, field: str, want_bytes: bool, on_decode_error: OnDecodeError = "error"
) -> tuple[list[str | bytes], DecodeErrors]:
    """The documents of one task: raw bytes if `want_bytes` (byte tokenizer), else str; and the
    inputs that were not UTF-8 (see data.on_decode_error)."""
    errors = DecodeErrors()
    if task.fmt == "text":
        docs: list[str | bytes] = []
        for p in task.paths:
            with _open(storage.location(p)) as fh:
                raw = _read(fh, p)
            text = raw if want_bytes else _decode(raw, p, on_decode_error, errors)
            if text:
                docs.append(text)
        return docs, errors
    if task.fmt == "jsonl":
        return _read_jsonl(task, field, want_bytes, on_decode_error, errors), errors
    return _read_parquet(task, field, want_bytes), errors


def _read_jsonl(
    task: Task, field: str, want_bytes: bool, policy: OnDecodeError, errors: DecodeErrors
) -> list[str | bytes]:
    path = task.paths[0]
    docs: list[str | bytes] = []
    for n, record in jsonl_records(task, policy, errors):
        if not isinstance(record, dict) or field not in record:
            where = line_number(path, task.start, n)
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise KilnError(
                f"{path}:{where}: no field {field!r} (data.field / --field); the record has {keys}"
            )
        value = record[field]
        if value is None:
            continue
        if not isinstance(value, str):
            where = line_number(path, task.start, n)
            raise KilnError(
                f"{path}:{where}: field {field!r} is {type(value).__name__}; allowed: a string"
            )
        if value:
            docs.append(value.encode("utf-8") if want_bytes else value)
    return docs


def jsonl_records(
    task: Task, policy: OnDecodeError, errors: DecodeErrors
) -> Iterator[tuple[int, Any]]:
    """(line index in the task's byte range, parsed JSON) of every non-blank line of a JSONL
    task; `line_number(path, task.start, index)` names a line in messages."""
    path = task.paths[0]
    with _open(storage.location(path)) as fh:
        fh.seek(task.start)
        chunk = fh.read(task.end - task.start)
    for n, line in enumerate(chunk.split(b"\n")):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            where = f"{path}:{line_number(path, task.start, n)}"
            if policy == "error":
                raise _not_utf8(where, e, text_file=False) from None
            errors.add(policy, where)
            if policy == "skip":
                continue
            text = line.decode("utf-8", errors="replace")
        try:
            record = json.loads(text)
        except ValueError as e:
            where = line_number(path, task.start, n)
            raise KilnError(f"{path}:{where}: invalid JSON ({e.args[0]})") from None
        yield n, record


def _read_parquet(task: Task, field: str, want_bytes: bool) -> list[str | bytes]:
    """The task's row groups, PARQUET_BATCH_ROWS rows at a time (never the whole file)."""
    import pyarrow as pa

    path = task.paths[0]
    pf = _parquet_file(storage.location(path))
    if field not in pf.schema_arrow.names:
        raise KilnError(
            f"{path}: no column {field!r} (data.field / --field); columns: {pf.schema_arrow.names}"
        )
    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise KilnError(f"{path}: column {field!r} has type {kind}; allowed: string")
    values: list[str] = []
    try:
        for batch in pf.iter_batches(
            PARQUET_BATCH_ROWS, row_groups=list(task.row_groups), columns=[field]
        ):
            values.extend(v for v in batch.column(0).to_pylist() if v)
    except Exception as e:
        raise KilnError(f"{path}: cannot read Parquet row groups ({first_line(e)})") from None
    return [v.encode("utf-8") for v in values] if want_bytes else values


def _parquet_file(path: Location):
    import pyarrow.parquet as pq

    source = path if isinstance(path, Path) else _open(path)
    try:
        return pq.ParquetFile(source)
    except OSError as e:
        if e.errno is not None:
            raise KilnError(f"cannot read {path}: {e.strerror}") from None
        raise KilnError(f"{path}: not a valid Parquet file ({first_line(e)})") from None
    except Exception as e:
        raise KilnError(f"{path}: not a valid Parquet file ({first_line(e)})") from None


def _open(path: Location):
    return storage.open_read(path)


def _read(fh, path: str) -> bytes:
    try:
        return fh.read()
    except OSError as e:
        raise KilnError(f"cannot read {path}: {e.strerror}") from None


def _decode(raw: bytes, path: str, policy: OnDecodeError, errors: DecodeErrors) -> str | None:
    """UTF-8 text of a file; None if it is not UTF-8 and `policy` is skip."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if policy == "error":
            raise _not_utf8(path, e) from None
        errors.add(policy, path)
        return None if policy == "skip" else raw.decode("utf-8", errors="replace")


def _not_utf8(where: str, e: UnicodeDecodeError, text_file: bool = True) -> KilnError:
    byte = ", or use data.tokenizer=byte, which reads files of any encoding" if text_file else ""
    return KilnError(
        f"{where}: not UTF-8 text (invalid byte at offset {e.start}); set data.on_decode_error "
        f"to skip or replace (kiln prepare --on-decode-error){byte}"
    )


def line_number(path: str, start: int, line_in_chunk: int) -> int:
    """1-based line number in `path` of line `line_in_chunk` of the chunk at byte `start`."""
    before = storage.read_bytes(storage.location(path), 0, start).count(b"\n")
    return before + line_in_chunk + 1


def default_workers() -> int:
    """Processes for tokenizing: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
