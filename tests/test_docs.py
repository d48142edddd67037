"""The docs site builds with --strict, the generated config reference is current, every
benchmark figure the docs quote says which command made it, on what machine, under what load,
and the compile figures they quote are the ones kiln gives (scripts/docs_figures.py)."""

import importlib.util
import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, kiln, kiln_env, kiln_main, run_process

REFERENCE = REPO / "docs" / "reference" / "config.md"
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def nav_pages(nav):
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            yield from nav_pages(value) if isinstance(value, list) else [value]


def test_docs_build_strict(tmp_path):
    proc = run_process(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)], cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "reference" / "config" / "index.html").is_file()
    assert (tmp_path / "img" / "zloss_ab.png").is_file()


def test_every_page_is_in_the_nav():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages = set(nav_pages(nav))
    on_disk = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert on_disk == pages, f"not in mkdocs.yml nav: {sorted(on_disk - pages)}"


def test_config_reference_is_current():
    proc = kiln("config", "--schema", "--format", "markdown")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    page = REFERENCE.read_text()
    assert page.startswith("# Config reference\n")
    assert page.endswith(table), (
        "docs/reference/config.md is stale: regenerate it with `python scripts/config_reference.py`"
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "config_reference.py"), "--check"],
        capture_output=True,
        text=True,
        env=kiln_env(),
    )
    assert proc.returncode == 0, proc.stderr


FIGURE = re.compile(r"\b\d+\.\d+\b|\b\d[\d,]* ?(?:MiB|GB|MB|tokens/s|s/step)\b")
COMMAND = re.compile(r"`(?:nice )?python (benchmarks/\w+\.py)[^`]*`|`kiln [^`]+`")
MACHINE = re.compile(r"\b(?:CPU|GPU|TPU)\b|\bcores?\b")
LOAD = re.compile(r"load average|idle|no other job|shared|loaded")


def figure_sections(page):
    """(heading, text) of each `###` section under the page's "## Latest figures"."""
    text = page.read_text().split("## Latest figures", 1)[1].split("\n## ", 1)[0]
    return [(part.split("\n", 1)[0], part) for part in re.split(r"^### ", text, flags=re.M)[1:]]


def test_every_benchmark_figure_names_its_command_machine_and_load():
    sections = figure_sections(REPO / "docs" / "benchmarks.md")
    assert len(sections) >= 5
    for heading, text in sections:
        if not FIGURE.search(text):
            continue
        commands = COMMAND.findall(text)
        assert COMMAND.search(text), f"benchmarks.md, {heading}: figures without their command"
        for script in filter(None, commands):
            assert (REPO / script).is_file(), f"benchmarks.md, {heading}: no {script}"
        assert MACHINE.search(text), f"benchmarks.md, {heading}: figures without the machine"
        assert LOAD.search(text), f"benchmarks.md, {heading}: figures without the load"


# `$ kiln ...` followed by the error lines it prints, in the docs' code blocks.
QUOTED_ERRORS = re.compile(r"^\$ (kiln .+)\n((?:kiln: error: .+\n)+)", re.M)
# What the quoting pages' examples run against: config.md's c.yaml (as the page says), and runs
# for runs.md's `kiln compare` (three runs, the tiny one with training and eval figures).
C_YAML = "model: {d_model: 256, num_heads: 3}\ntrain: {steps: 0}\n"
RUNS = {
    "tiny": {"learning/loss": 3.1, "eval/loss": 3.0, "eval/perplexity": 20.3},
    "zloss_1e-4": {"learning/loss": 3.2},
    "zloss_off": {"learning/loss": 3.3},
}


@pytest.mark.parametrize("page", ["README.md", "docs/config.md", "docs/runs.md"])
def test_quoted_error_messages_are_what_kiln_prints(page, tmp_path):
    """Each error a page quotes after its command is kiln's line, word for word (a quoted
    line ending in "..." is a prefix of it)."""
    blocks = QUOTED_ERRORS.findall((REPO / page).read_text())
    assert blocks, f"{page}: no quoted error"
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "c.yaml").write_text(C_YAML)
    for name, row in RUNS.items():
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text(json.dumps({"step": 1, **row}))
    for command, quoted in blocks:
        proc = kiln_main(*shlex.split(command)[1:], cwd=tmp_path)
        got, want = proc.stderr.splitlines(), quoted.splitlines()
        assert proc.returncode == 2 and len(got) == len(want), (command, proc.stderr)
        for line, doc in zip(got, want):
            assert line == doc or (doc.endswith("...") and line.startswith(doc[:-3])), (line, doc)


def docs_figures():
    """scripts/docs_figures.py as a module."""
    spec = importlib.util.spec_from_file_location("docs_figures", REPO / "scripts/docs_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_the_docs_quote_the_recorded_compile_figures():
    figures = docs_figures()
    records = json.loads(figures.RECORD.read_text())
    assert set(records) == set(figures.ENTRIES)
    for name, entry in figures.ENTRIES.items():
        assert records[name]["command"] == "kiln " + " ".join(entry.command()), name
    assert figures.missing_quotes(records) == []


def test_the_derived_figures_agree_with_the_compiles_they_come_from():
    """A recorded `--summary` and `--fit` of a full-size model against its recorded compile."""
    figures = docs_figures()
    assert figures.disagreements(json.loads(figures.RECORD.read_text())) == []


def test_the_figures_check_covers_every_entry():
    """The re-runs below are every entry that is not derived (TPU ones too, with libtpu)."""
    figures = docs_figures()
    checked = {name for names in figures.reruns(tpu=True).values() for name in names}
    assert checked == {n for n, e in figures.ENTRIES.items() if not e.derived}


def test_kiln_reports_the_fingerprint_of_the_program_lowered_and_another_program_has_another():
    """`kiln compile`'s `program` is the fingerprint the figures check lowers without compiling
    (here in the test process with its XLA flags, which lowering does not read), and a change
    of the model changes it."""
    figures = docs_figures()
    command = ("compile", "configs/tiny.yaml", "model.num_layers=2", "--devices", "8", "--json")
    proc = kiln_main(*command, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fingerprint = figures.program(command)
    assert json.loads(proc.stdout)["program"] == fingerprint
    assert figures.program((*command[:-1], "model.d_ff=384", "--json")) != fingerprint


RERUNS = list(docs_figures().reruns(tpu=True).items())


@pytest.mark.slow
@pytest.mark.parametrize(("command", "names"), RERUNS, ids=[",".join(n) for _, n in RERUNS])
def test_the_recorded_compile_figures_are_what_kiln_gives_now(command, names):
    """Each cheap entry, and the canary of each full-size one, compiled again unless its program
    is the one recorded (then so are its figures): exact figures. A TPU entry compiles in this
    process (XLA:CPU's flags do not reach the TPU compiler); a CPU one in a `kiln` process with
    XLA's own flags, as `scripts/docs_figures.py --check` runs it, since the test processes'
    faster-compiling flags move buffer assignment by a few bytes."""
    figures = docs_figures()
    tpu = any(figures.ENTRIES[n].tpu for n in names)
    if tpu and not HAS_LIBTPU:
        pytest.skip("needs libtpu (the dev extra installs it)")
    records = json.loads(figures.RECORD.read_text())
    # The program the records were measured on, lowered again here: the same program compiles
    # to the same figures, so only a changed program is compiled again.
    if figures.unchanged(records, names, figures.program(command)):
        return
    if tpu:
        proc = kiln_main(*command, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-4000:]
        output = figures.parse(proc.stdout)
    else:
        output = figures.run(list(command))
    assert figures.rerun_problems(records, command, names, output) == []
