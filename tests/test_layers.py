"""The package layers of docs/architecture.md, checked from the sources' own imports (`ast`):
no import cycle, no import from a lower layer to a higher one, and function-local imports of
kiln only where they keep a heavy dependency out of a light command."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"

# Bottom to top: a module may import its own package and the packages of lower layers.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Which accelerators are attached (device files, no JAX): `import kiln` reads it.
    ("kiln.util.platforms",),
    ("kiln", "kiln.errors"),  # the version, the platform choice and the user-error types
    ("kiln.util",),  # files at paths or URLs, checksums, signals, numbers in words
    ("kiln.data",),  # documents -> token shards -> batches; eval task data (no JAX)
    ("kiln.config",),  # the schema, YAML loading, cross-field rules, the axis resolver
    ("kiln.parallel",),  # the device mesh, shardings, jax.distributed
    ("kiln.losses",),  # LM and distillation losses over hidden states and a head
    ("kiln.model",),  # model families (decoder-only Transformer), attention kernels
    ("kiln.runs",),  # the run directory: lock, checkpoints, pinned inputs, URL mirror
    ("kiln.training",),  # objectives, the step, optimizer, loop, metrics, the runner
    ("kiln.distill",),  # online and offline distillation, the teacher-logits store
    ("kiln.commands",),  # what each `kiln` command does
    ("kiln.cli",),  # argument parsing and exit codes
)

# Function-local imports of kiln that stay, and why: each keeps a heavy dependency out of a
# command that does not need it.
LAZY = {
    # `kiln --help`, bad arguments and `kiln prepare` start without JAX: each command imports
    # what it runs only once it runs.
    "kiln.commands.handlers",
    # orbax (checkpoint restore) is imported when a run's model is loaded, not by `kiln
    # generate`/`kiln eval` refusing bad input.
    "kiln.runs.runmodel",
}


def modules(src: Path = SRC) -> dict[str, Path]:
    found = {}
    for path in sorted((src / "kiln").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported kiln module, line, inside a function) for each import that runs: those under
    `if TYPE_CHECKING:` are annotations only, and never run."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST, local: bool) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from kiln import losses` imports the module kiln.losses; `from kiln.x import f`, kiln.x.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            targets = []
        for target in targets:
            if target == "kiln" or target.startswith("kiln."):
                module = resolve(target)
                if module is not None and module != name:
                    found.append((module, node.lineno, local))
        inner = local or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, members in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and len(member) > best:
                best, level = len(member), i
    assert level is not None, f"{module} is in no layer of LAYERS: add its package to the table"
    return level


def package_of(module: str) -> str:
    return max(
        (m for members in LAYERS for m in members if module == m or module.startswith(m + ".")),
        key=len,
    )


Graph = dict[str, list[tuple[str, int, bool]]]


def graph(src: Path = SRC) -> Graph:
    known = modules(src)
    return {name: imports(name, path, known) for name, path in known.items()}


def upward_imports(g: Graph) -> list[str]:
    return [
        f"{name}:{line} imports {target}"
        for name, edges in g.items()
        for target, line, _ in edges
        if package_of(target) != package_of(name) and layer_of(target) >= layer_of(name)
    ]


def import_cycles(g: Graph) -> list[str]:
    edges = {name: sorted({t for t, _, _ in targets}) for name, targets in g.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []
    cycles: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node)
    return cycles


def local_imports(g: Graph) -> list[str]:
    return [
        f"{name}:{line} imports {target}"
        for name, edges in g.items()
        if name not in LAZY
        for target, line, inside in edges
        if inside
    ]


def test_top_level_holds_only_the_entry_points():
    top = sorted(p.name for p in (SRC / "kiln").glob("*.py"))
    assert top == ["__init__.py", "cli.py", "errors.py"]


def test_every_module_is_in_a_layer_and_imports_only_downwards():
    upward = upward_imports(graph())
    assert not upward, "imports from a lower layer up (or across one layer):\n" + "\n".join(upward)


def test_no_import_cycles():
    cycles = import_cycles(graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_function_local_imports_only_keep_heavy_dependencies_out():
    local = local_imports(graph())
    assert not local, "function-local kiln imports outside LAZY:\n" + "\n".join(local)


# Libraries that belong to one layer and above: the optimizers (optax) are the trainer's, so
# a model family never names one (`kiln.training.optim.OPTIMIZERS`).
OWNED = {"optax": "kiln.training"}


def library_imports(src: Path = SRC) -> list[str]:
    """`module:line imports library` for each import of an OWNED library below its layer."""
    found = []
    for name, path in modules(src).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            for target in targets:
                library = target.split(".")[0]
                if library in OWNED and layer_of(name) < layer_of(OWNED[library]):
                    found.append(f"{name}:{node.lineno} imports {library}")
    return found


def test_libraries_are_imported_only_from_the_layer_that_owns_them():
    found = library_imports()
    assert not found, "imports of a library below the layer that owns it:\n" + "\n".join(found)


def test_every_package_says_what_it_is_for_and_what_it_may_import():
    for init in sorted((SRC / "kiln").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.relative_to(REPO)}: docstring lacks 'May import'"
        assert "Public names" in doc, f"{init.relative_to(REPO)}: docstring lacks 'Public names'"


def test_the_checks_report_an_upward_import_a_cycle_and_a_local_import(tmp_path):
    pkg = tmp_path / "kiln"
    for sub in ("util", "data"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "util" / "a.py").write_text("from kiln.data import b\n")
    (pkg / "data" / "b.py").write_text("from kiln.data import c\n")
    (pkg / "data" / "c.py").write_text("def f():\n    from kiln.data import b\n")
    (pkg / "data" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.util import a\n"
    )
    g = graph(tmp_path)
    assert upward_imports(g) == ["kiln.util.a:1 imports kiln.data.b"]
    assert import_cycles(g) == ["kiln.data.b -> kiln.data.c -> kiln.data.b"]
    assert local_imports(g) == ["kiln.data.c:2 imports kiln.data.b"]
    assert g["kiln.data.d"] == []  # annotations only: never runs
