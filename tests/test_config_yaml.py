"""Reading config YAML: a key given twice and an empty file are refused, in one line."""

import sys
from pathlib import Path

import pytest

from conftest import run_process
from kiln.config import load_config
from kiln.errors import KilnError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "key", "first", "second"),
    [
        ("model:\n  d_model: 64\n  num_heads: 4\n  d_model: 128\n", "d_model", 2, 4),
        ("model: {d_model: 64}\ntrain: {steps: 3}\nmodel: {num_heads: 4}\n", "model", 1, 3),
        ("mesh:\n  rules:\n    batch: [data]\n    embed: []\n    batch: [fsdp]\n", "batch", 3, 5),
        ("train: {steps: 3, steps: 4}\n", "steps", 1, 1),
    ],
    ids=["nested", "section", "depth-3", "flow"],
)
def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, text, key, first, second):
    path = write(tmp_path / "c.yaml", text)
    with pytest.raises(KilnError) as e:
        load_config(path)
    column = text.splitlines()[second - 1].rindex(key) + 1  # where the second one starts
    assert str(e.value) == (
        f"{path}: line {second}, column {column}: invalid YAML: duplicate key {key!r} "
        f"(first at line {first}); give each key once"
    )


def test_a_key_given_twice_in_a_base_config_names_that_file(tmp_path):
    base = write(tmp_path / "base.yaml", "optim:\n  learning_rate: 0.1\n  learning_rate: 0.2\n")
    top = write(tmp_path / "top.yaml", "base_config: base.yaml\noptim: {learning_rate: 0.3}\n")
    with pytest.raises(KilnError, match=rf"^{base}: line 3, column 3: .*'learning_rate' \(first"):
        load_config(top)


def test_keys_repeated_across_files_overrides_and_merges_are_fine(tmp_path):
    """Only one mapping naming a key twice is an error; later files, overrides and YAML merge
    keys (`<<`) still replace values as before."""
    write(tmp_path / "base.yaml", "model: {d_model: 64, num_heads: 4}\n")
    top = write(tmp_path / "top.yaml", "base_config: base.yaml\nmodel: {d_model: 128}\n")
    config = load_config(top, ["model.num_heads=8"])
    assert (config.model.d_model, config.model.num_heads) == (128, 8)
    merged = write(
        tmp_path / "m.yaml", "model:\n  <<: {d_model: 64, num_heads: 2}\n  d_model: 96\n"
    )
    config = load_config(merged)
    assert (config.model.d_model, config.model.num_heads) == (96, 2)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    path = write(tmp_path / "c.yaml", text)
    with pytest.raises(KilnError) as e:
        load_config(path)
    assert str(e.value) == (
        f"{path}: the config file is empty; allowed: a mapping of sections (`{{}}` for all defaults)"
    )
    # All defaults stay one explicit `{}` away.
    assert load_config(write(tmp_path / "d.yaml", "{}\n")) == load_config(
        write(tmp_path / "e.yaml", "model: {}\n")
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model:\n  d_model: 64\n  d_model: 64\n", "line 3, column 3: invalid YAML: duplicate key"),
        ("", "the config file is empty"),
    ],
)
def test_cli_refuses_in_one_line_with_exit_2(tmp_path, text, message):
    path = write(tmp_path / "c.yaml", text)
    runs = tmp_path / "runs"
    for command in ("config", "train"):
        proc = run_process(
            [sys.executable, "-m", "kiln.cli", command, str(path), f"train.output_dir={runs}"]
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr
        assert proc.stdout == ""
    assert not runs.exists()
