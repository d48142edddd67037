"""Write kiln's embedded chat set: three-turn conversations about standard-library functions.

Each conversation asks what a public, documented function of a standard-library module does
(the answer is its docstring's first sentence), then for its parameters (its signature), then
which module defines it. Answers are taken from the source, so a model can learn them, and
the last one can be copied from the question: a small model's loss on assistant tokens falls
visibly within a few hundred steps. Deterministic: files in sorted order, one seeded random
generator; the shipped file comes from Python 3.11.

    PYTHONPATH=src python scripts/stdlib_chat.py [--out FILE] [--conversations N] [--seed S]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
from pathlib import Path

from kiln.data.sources import resolve_inputs, stdlib_root

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src/kiln/data/bundled/stdlib_chat.jsonl"
SYSTEM = "You answer questions about the Python standard library in one short sentence."
MAX_ANSWER_BYTES = 100  # a conversation stays near data.seq_len of configs/sft_tiny.yaml


def functions(path: Path, root: Path) -> list[tuple[str, str, str]]:
    """(module, signature, first docstring sentence) of a file's documented public functions."""
    module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    if any(part.startswith("_") or part in ("test", "tests") for part in module.split(".")):
        return []
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        sentence = " ".join(doc.strip().split("\n\n")[0].split())
        sentence = sentence.split(". ")[0].rstrip(".") + "."
        signature = f"{node.name}({ast.unparse(node.args)})"
        if len(sentence.encode()) <= MAX_ANSWER_BYTES and len(signature) <= MAX_ANSWER_BYTES:
            out.append((module, signature, sentence))
    return out


def conversation(module: str, signature: str, sentence: str, rng: random.Random) -> dict:
    name = signature.split("(")[0]
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    messages += [
        {"role": "user", "content": f"What does {module}.{name} do?"},
        {"role": "assistant", "content": sentence},
        {"role": "user", "content": "What are its parameters?"},
        {"role": "assistant", "content": f"{signature}"},
        {"role": "user", "content": "Which module defines it?"},
        {"role": "assistant", "content": f"The {module} module."},
    ]
    return {"messages": messages}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--conversations", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    root = stdlib_root()
    found = [f for path in resolve_inputs(["stdlib:**/*.py"]) for f in functions(path, root)]
    rng = random.Random(args.seed)
    chosen = rng.sample(found, min(args.conversations, len(found)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as fh:
        for item in chosen:
            fh.write(json.dumps(conversation(*item, rng)) + "\n")
    print(f"{args.out}: {len(chosen)} conversations from {len(found)} functions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
