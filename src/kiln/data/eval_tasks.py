"""Evaluation tasks: parsing `[NAME=]KIND:PATH` strings and reading their data into token rows.

Two kinds: `perplexity:PATH` (text, JSONL or Parquet files, or `stdlib:GLOB`; documents packed
end to end in windows of data.seq_len, exactly like the held-out split during training) and
`choice:FILE.jsonl` (multiple choice, one `{"context", "choices", "gold"}` object per line,
scored by the log-likelihood of each choice after its context). `kiln:NAME` is a task file
shipped with kiln (in `kiln/data/eval_data/`). Nothing here touches JAX.
"""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.data.corpus import Corpus
from kiln.data.pipeline import Batch, StreamWindows
from kiln.data.sources import (
    STDLIB_PREFIX,
    check_regular,
    plan_tasks,
    read_documents,
    resolve_inputs,
)
from kiln.data.tokenizers import Tokenizer
from kiln.errors import KilnError
from kiln.util import storage

KINDS = ("perplexity", "choice")
BUNDLED_PREFIX = "kiln:"
BUNDLED_DIR = Path(__file__).parent / "eval_data"
FIELD = "text"  # the JSONL/Parquet field of a perplexity task's documents
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}  # else text


@dataclass(frozen=True)
class TaskSpec:
    """One task string: its metric name (`eval/<name>/<metric>`), kind and path."""

    name: str
    kind: str
    path: str
    text: str  # as the user wrote it


def parse_task(text: str, what: str = "task") -> TaskSpec:
    """`[NAME=]KIND:PATH` -> TaskSpec; the name defaults to the file name's stem."""
    allowed = f"allowed: [NAME=]KIND:PATH with KIND one of {', '.join(KINDS)}"
    body, name = text, None
    head, sep, rest = text.partition("=")
    if sep and ":" not in head and "/" not in head:
        name, body = head, rest
    kind, sep, path = body.partition(":")
    if not sep or kind not in KINDS:
        got = f"unknown task kind {kind!r} in {text!r}" if sep else f"{text!r} names no kind"
        raise KilnError(f"{what}: {got}; {allowed}")
    if not path:
        raise KilnError(f"{what}: {text!r} gives no path; {allowed}")
    problem = storage.url_problem(path)
    if problem is not None:
        raise KilnError(f"{what}: {text!r}: {problem}; {storage.ALLOWED}")
    name = name if name is not None else default_name(path)
    if not _NAME.match(name):
        raise KilnError(
            f"{what}: task name {name!r} (of {text!r}); allowed: letters, digits, '_', '.', '-' "
            "(name the task: NAME=KIND:PATH)"
        )
    return TaskSpec(name, kind, path, text)


def parse_tasks(texts: list[str] | tuple[str, ...], what: str = "task") -> list[TaskSpec]:
    """Every task string parsed; two tasks with one name are refused (their metrics would mix)."""
    specs = [parse_task(t, what) for t in texts]
    seen: dict[str, str] = {}
    for s in specs:
        if s.name in seen:
            raise KilnError(
                f"{what}: {seen[s.name]!r} and {s.text!r} are both named {s.name!r}; "
                "name one of them: NAME=KIND:PATH"
            )
        seen[s.name] = s.text
    return specs


def default_name(path: str) -> str:
    """The stem of the last path component without glob characters ('stdlib' for stdlib:**)."""
    for prefix in (BUNDLED_PREFIX, STDLIB_PREFIX):
        if path.startswith(prefix):
            path = path[len(prefix) :] or prefix[:-1]
            if glob.has_magic(path) and prefix == STDLIB_PREFIX:
                return "stdlib"
    parts = [p for p in Path(path).parts if not glob.has_magic(p)]
    stem = Path(parts[-1]).stem if parts else "task"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "task"


def task_path(spec: TaskSpec) -> str:
    """The path a task reads: `kiln:NAME` is a file shipped in kiln/data/eval_data/."""
    if spec.path.startswith(BUNDLED_PREFIX):
        return str(BUNDLED_DIR / spec.path[len(BUNDLED_PREFIX) :])
    return spec.path


# ---------------------------------------------------------------------------------------------
# perplexity


@dataclass
class PerplexityTask:
    """Documents of a perplexity task, packed like the training stream (each ends in EOS)."""

    spec: TaskSpec
    windows: StreamWindows
    num_documents: int
    num_bytes: int  # UTF-8 bytes of the documents: the denominator of bits per byte


def load_perplexity(spec: TaskSpec, tokenizer: Tokenizer, vocab_size: int, seq_len: int):
    """Read, tokenize and pack a perplexity task's files (format from each file's suffix)."""
    what = f"task {spec.text}"
    files = resolve_inputs([task_path(spec)], what=what)
    check_regular(files, what)
    want_bytes = tokenizer.kind == "byte"
    encoded, num_bytes = [], 0
    for f in files:
        fmt = _FORMATS.get(Path(storage.name(f)).suffix.lower(), "text")
        for task in plan_tasks(fmt, [f], [storage.size(f)], 1 << 62):
            docs, _ = read_documents(task, FIELD, want_bytes)
            num_bytes += sum(len(d if isinstance(d, bytes) else d.encode("utf-8")) for d in docs)
            encoded += tokenizer.encode_batch(docs) if docs else []
    lengths = np.asarray([len(e) + 1 for e in encoded], np.int64)
    if not len(lengths) or lengths.sum() < 2:
        raise KilnError(f"{what}: {len(files)} files hold no text to score")
    tokens = np.full(int(lengths.sum()), tokenizer.eos_id, np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for e, a in zip(encoded, starts):
        tokens[a : a + len(e)] = e
    if tokens.max() >= vocab_size:
        raise KilnError(
            f"{what}: token id {int(tokens.max())} >= model.vocab_size {vocab_size} of the run"
        )
    n = len(lengths)
    corpus = Corpus([tokens], [Path(spec.path)], np.zeros(n, np.int32), starts, lengths)
    ids = (seq_len, tokenizer.eos_id, tokenizer.pad_id)
    windows = StreamWindows(corpus, np.arange(n), *ids, vocab_size=vocab_size)
    return PerplexityTask(spec, windows, n, num_bytes)


def window_batches(task: PerplexityTask, batch_size: int) -> list[Batch]:
    """Every window of the task once, in global batches; rows past the end have weight 0."""
    count = -(-task.windows.num_windows // batch_size)
    ids = np.arange(count * batch_size).reshape(count, batch_size)
    return [task.windows.batch(row) for row in ids]


# ---------------------------------------------------------------------------------------------
# choice


@dataclass
class ChoiceTask:
    """Multiple-choice questions: a row [EOS, context, choice] per (question, choice)."""

    spec: TaskSpec
    gold: np.ndarray  # [Q] index of the right choice
    num_choices: np.ndarray  # [Q]
    choice_bytes: list[list[int]]  # UTF-8 bytes of each choice (acc_norm's length)
    rows: list[np.ndarray]  # tokens of each (question, choice), question-major
    targets_from: list[int]  # index in its row of the first continuation token


def load_choice(spec: TaskSpec, tokenizer: Tokenizer, vocab_size: int, max_seq_len: int):
    """Read and tokenize a choice JSONL file; a KilnError names file:line of a bad record."""
    path = Path(task_path(spec)).expanduser()
    what = f"task {spec.text}"
    check_regular([path], what)
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise KilnError(f"{what}: cannot read {path}: {e.strerror}") from None
    gold, counts, lengths, rows, starts = [], [], [], [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        context, choices, g = _record(line, f"{path}:{number}")
        ctx = tokenizer.encode(context)
        gold.append(g)
        counts.append(len(choices))
        lengths.append([len(c.encode("utf-8")) for c in choices])
        for i, choice in enumerate(choices):
            # As lm-eval-harness: the choice's tokens are those of context+choice after the
            # context's own, so a tokenizer that merges across the seam is scored as it reads.
            cont = tokenizer.encode(context + choice)[len(ctx) :]
            if not cont:
                raise KilnError(f"{path}:{number}: choice {i} gives no tokens after the context")
            if len(cont) > max_seq_len:
                raise KilnError(
                    f"{path}:{number}: choice {i} is {len(cont)} tokens; model.max_seq_len of "
                    f"the run is {max_seq_len}"
                )
            # The context is cut from the left to fit (as lm-eval-harness does).
            row = np.asarray([tokenizer.eos_id, *ctx, *cont], np.int64)[-(max_seq_len + 1) :]
            if row.max() >= vocab_size:
                raise KilnError(f"{path}:{number}: token id {int(row.max())} >= model.vocab_size")
            rows.append(row)
            starts.append(len(row) - len(cont))
    if not gold:
        raise KilnError(f"{what}: {path} holds no questions")
    return ChoiceTask(spec, np.asarray(gold), np.asarray(counts), lengths, rows, starts)


def _record(line: bytes, where: str) -> tuple[str, list[str], int]:
    """(context, choices, gold) of one JSONL line, or a KilnError naming file:line."""
    fmt = 'allowed: {"context": str, "choices": [str, ...], "gold": int}'
    try:
        record = json.loads(line)
    except ValueError as e:
        raise KilnError(f"{where}: invalid JSON ({e.args[0]})") from None
    if not isinstance(record, dict) or any(k not in record for k in ("context", "choices", "gold")):
        raise KilnError(f"{where}: not a question; {fmt}")
    context, choices, gold = record["context"], record["choices"], record["gold"]
    if not isinstance(context, str):
        raise KilnError(f"{where}: context is {type(context).__name__}; {fmt}")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) for c in choices)
    ):
        raise KilnError(f"{where}: choices must be a list of at least 2 strings; {fmt}")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise KilnError(
            f"{where}: gold {gold!r} is out of range; allowed: an integer 0..{len(choices) - 1}"
        )
    return context, choices, gold


def choice_batches(task: ChoiceTask, batch_size: int, max_len: int):
    """(row indices, batch) pairs, rows sorted by length; a batch's length is a multiple of 32."""
    order = np.argsort([-len(r) for r in task.rows], kind="stable")
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = min(max_len, 32 * -(-max(len(task.rows[i]) - 1 for i in idx) // 32))
        batch = {
            k: np.zeros((batch_size, width), np.float32 if k == "weights" else np.int32)
            for k in ("inputs", "targets", "positions", "segment_ids", "weights")
        }
        for b, i in enumerate(idx):
            row, n = task.rows[i], len(task.rows[i]) - 1
            batch["inputs"][b, :n] = row[:-1]
            batch["targets"][b, :n] = row[1:]
            batch["positions"][b, :n] = np.arange(n)
            batch["segment_ids"][b, :n] = 1
            batch["weights"][b, task.targets_from[i] - 1 : n] = 1.0
        yield idx, batch


def choice_metrics(task: ChoiceTask, loglik: np.ndarray) -> dict[str, float]:
    """acc (argmax of the summed log-likelihood) and acc_norm (of log-likelihood per byte)."""
    hits, hits_norm, offset = 0, 0, 0
    for q, n in enumerate(task.num_choices):
        ll = loglik[offset : offset + n]
        offset += n
        hits += int(np.argmax(ll) == task.gold[q])
        hits_norm += int(np.argmax(ll / np.asarray(task.choice_bytes[q])) == task.gold[q])
    q = len(task.gold)
    return {"acc": hits / q, "acc_norm": hits_norm / q, "questions": float(q)}
