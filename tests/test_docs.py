"""The docs site builds with --strict, and the generated config reference is current."""

import subprocess
import sys

import yaml

from conftest import REPO, kiln, kiln_env

REFERENCE = REPO / "docs" / "reference" / "config.md"


def nav_pages(nav):
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            yield from nav_pages(value) if isinstance(value, list) else [value]


def test_docs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
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
