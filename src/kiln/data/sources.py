"""Raw inputs: resolving paths and globs (and `stdlib:`), planning work, reading documents."""

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

Format = Literal["text", "jsonl", "parquet"]
FORMATS: tuple[str, ...] = ("text", "jsonl", "parquet")
STDLIB_PREFIX = "stdlib:"
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")


def stdlib_root() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_inputs(patterns: Sequence[str], what: str = "data.paths") -> list[Path]:
    """Files named by paths, directories (all files below) or globs; `stdlib:GLOB` is a glob
    inside the running interpreter's standard library (site-packages excluded)."""
    if not patterns:
        raise KilnError(f"{what}: no input given; allowed: files, directories, globs, stdlib:GLOB")
    found: dict[Path, None] = {}
    for pattern in patterns:
        matches = _expand(pattern)
        if not matches:
            raise KilnError(f"{what}: {pattern!r} matches no files")
        found.update(dict.fromkeys(matches))
    return sorted(found)


def _expand(pattern: str) -> list[Path]:
    if pattern.startswith(STDLIB_PREFIX):
        root = stdlib_root()
        hits = glob.glob(pattern[len(STDLIB_PREFIX) :], root_dir=root, recursive=True)
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


def input_identity(files: Sequence[Path]) -> list[dict[str, Any]]:
    """(path, size, mtime) of every input: what a cache or manifest is keyed by."""
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError as e:
            raise KilnError(f"cannot read {f}: {e.strerror}") from None
        out.append({"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


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
    fmt: str, files: Sequence[Path], sizes: Sequence[int], target_bytes: int
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


def _jsonl_tasks(path: Path, size: int, target_bytes: int) -> Iterator[Task]:
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


def _parquet_tasks(path: Path, target_bytes: int) -> Iterator[Task]:
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
            with _open(Path(p)) as fh:
                raw = _read(fh, Path(p))
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
    with _open(Path(path)) as fh:
        fh.seek(task.start)
        chunk = fh.read(task.end - task.start)
    docs: list[str | bytes] = []
    for n, line in enumerate(chunk.split(b"\n")):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            where = f"{path}:{_line_number(path, task.start, n)}"
            if policy == "error":
                raise _not_utf8(where, e, text_file=False) from None
            errors.add(policy, where)
            if policy == "skip":
                continue
            text = line.decode("utf-8", errors="replace")
        try:
            record = json.loads(text)
        except ValueError as e:
            where = _line_number(path, task.start, n)
            raise KilnError(f"{path}:{where}: invalid JSON ({e.args[0]})") from None
        if not isinstance(record, dict) or field not in record:
            where = _line_number(path, task.start, n)
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise KilnError(
                f"{path}:{where}: no field {field!r} (data.field / --field); the record has {keys}"
            )
        value = record[field]
        if value is None:
            continue
        if not isinstance(value, str):
            where = _line_number(path, task.start, n)
            raise KilnError(
                f"{path}:{where}: field {field!r} is {type(value).__name__}; allowed: a string"
            )
        if value:
            docs.append(value.encode("utf-8") if want_bytes else value)
    return docs


def _read_parquet(task: Task, field: str, want_bytes: bool) -> list[str | bytes]:
    path = task.paths[0]
    pf = _parquet_file(Path(path))
    if field not in pf.schema_arrow.names:
        raise KilnError(
            f"{path}: no column {field!r} (data.field / --field); columns: {pf.schema_arrow.names}"
        )
    try:
        column = pf.read_row_groups(list(task.row_groups), columns=[field]).column(field)
    except Exception as e:
        raise KilnError(f"{path}: cannot read Parquet row groups ({first_line(e)})") from None
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise KilnError(f"{path}: column {field!r} has type {column.type}; allowed: string")
    values = [v for v in column.to_pylist() if v]
    return [v.encode("utf-8") for v in values] if want_bytes else values


def _parquet_file(path: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except OSError as e:
        if e.errno is not None:
            raise KilnError(f"cannot read {path}: {e.strerror}") from None
        raise KilnError(f"{path}: not a valid Parquet file ({first_line(e)})") from None
    except Exception as e:
        raise KilnError(f"{path}: not a valid Parquet file ({first_line(e)})") from None


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise KilnError(f"cannot read {path}: {e.strerror}") from None


def _read(fh, path: Path) -> bytes:
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


def _line_number(path: str, start: int, line_in_chunk: int) -> int:
    with open(path, "rb") as fh:
        before = fh.read(start).count(b"\n")
    return before + line_in_chunk + 1


def default_workers() -> int:
    """Processes for tokenizing: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
