"""Write kiln's embedded multiple-choice task: the true next line of a Python function.

Each question shows up to 64 bytes of a function from this Python's standard library (the lines
before one of its first ten lines) and offers that line among three distractors drawn the same
way from functions of *other* files, so a model that ignores the context scores chance (0.25)
in expectation. Deterministic: files in sorted order, one seeded random generator; the same
standard library gives the same file (the shipped one comes from Python 3.11.7).

    PYTHONPATH=src python scripts/stdlib_choice.py [--out FILE] [--questions N] [--seed S]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
from pathlib import Path

from kiln.data.sources import resolve_inputs, stdlib_root

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src/kiln/data/eval_data/stdlib_next_line.jsonl"
CONTEXT_LINES = 4
# Rows of [EOS] + context + line stay near data.seq_len of configs/tiny.yaml (128).
MAX_CONTEXT_BYTES = 64
LINE_BYTES = (10, 60)  # a candidate line's length without indentation, in bytes
STRING_MARK = "\0"  # prefix of a line inside a multi-line string literal: not a candidate


def candidate(line: str) -> bool:
    """A line worth asking about: code of moderate length, not a comment or docstring."""
    body = line.strip()
    return (
        LINE_BYTES[0] <= len(body.encode()) <= LINE_BYTES[1]
        and not body.startswith(("#", '"', "'", "@"))
        and not body.endswith("\\")
        and body.isascii()
        and not line.startswith(STRING_MARK)
    )


def functions(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, source lines) of every function of a file (nested ones too); the
    lines inside multi-line strings (docstrings) are blanked out as candidates by a marker."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    for node in ast.walk(tree):
        multi_line = isinstance(node, ast.Constant) and (node.end_lineno or 0) > node.lineno
        if multi_line and isinstance(node.value, str | bytes):
            for i in range(node.lineno, node.end_lineno + 1):
                lines[i - 1] = STRING_MARK + lines[i - 1]
    return [
        (node.lineno, lines[node.lineno - 1 : node.end_lineno])
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno
    ]


def question_line(funcs, rng: random.Random) -> tuple[int, list[str], int] | None:
    """(function's first line number, its lines, index k of a candidate line among its first
    ten) of a random function of a file; None if the function drawn has no candidate."""
    funcs = [f for f in funcs if len(f[1]) > 2]
    if not funcs:
        return None
    first, lines = rng.choice(funcs)
    targets = [k for k in range(1, min(len(lines), 10)) if candidate(lines[k])]
    return (first, lines, rng.choice(targets)) if targets else None


def build(questions: int, seed: int) -> list[dict]:
    """The questions, as JSON-able records (with `source`: file:line of the answer)."""
    root = stdlib_root()
    files = [
        p for p in resolve_inputs(["stdlib:**/*.py"]) if "test" not in p.relative_to(root).parts[0]
    ]
    per_file = {str(p.relative_to(root)): functions(p) for p in files}
    rng = random.Random(seed)
    names = sorted(n for n, f in per_file.items() if f)
    order = names[:]
    rng.shuffle(order)
    out = []
    for name in order:
        if len(out) == questions:
            break
        drawn = question_line(per_file[name], rng)
        if drawn is None:
            continue
        first, lines, k = drawn
        true = lines[k].rstrip()
        context = [line.lstrip(STRING_MARK) for line in lines[max(0, k - CONTEXT_LINES) : k]]
        while len("\n".join(context).encode()) > MAX_CONTEXT_BYTES and len(context) > 1:
            context = context[1:]
        # Distractors are drawn exactly as the true line is (a random file, function and line),
        # so a model that ignores the context scores chance in expectation.
        distractors: list[str] = []
        for _ in range(5000):
            other = rng.choice(names)
            pick = question_line(per_file[other], rng) if other != name else None
            if pick is None:
                continue
            line = pick[1][pick[2]].rstrip()
            if line in (true, *distractors):
                continue
            distractors.append(line)
            if len(distractors) == 3:
                break
        if len(distractors) < 3:
            continue
        choices = [true, *distractors]
        rng.shuffle(choices)
        out.append(
            {
                "context": "\n".join(line.rstrip() for line in context) + "\n",
                "choices": choices,
                "gold": choices.index(true),
                "source": f"{name}:{first + k}",
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = build(args.questions, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    version = ".".join(map(str, sys.version_info[:3]))
    print(
        f"wrote {len(records)} questions from the Python {version} standard library to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
