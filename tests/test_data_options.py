"""Data settings a user's own corpus needs: one path as a list, list overrides and YAML quoting,
files that are not UTF-8, `model.vocab_size: auto`, the tokenizer of shards, held-out sets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, assert_user_error, kiln, make_config
from kiln.config import load_config
from kiln.data import make_datasets
from kiln.data.prepare import prepare
from kiln.data.tokenizers import load_tokenizer
from kiln.errors import KilnError

WORDS = ["kiln", "mesh", "shard", "token", "batch", "loss"]


def word_tokenizer(d: Path, size: int = 130) -> Path:
    """A WordLevel tokenizer.json of `size` tokens: <unk>, <|endoftext|>, WORDS, then fillers."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    names = ["<unk>", "<|endoftext|>", *WORDS]
    names += [f"w{i}" for i in range(size - len(names))]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(d / "tok.json"))
    return d / "tok.json"


def data_config(tmp_path: Path, **data):
    return make_config(
        data={"seq_len": 8, "cache_dir": str(tmp_path / "cache"), **data},
        model={"vocab_size": 384, "max_seq_len": 8},
        train={"global_batch_size": 4, "eval_every_steps": 0},
        output_dir=tmp_path / "runs",
    )


# --- point 10: one path, list overrides ------------------------------------------------------


def test_one_path_string_is_a_list_of_one(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i} " * 5)
    config = load_config(REPO / "configs/tiny.yaml", [f"data.paths={tmp_path / 'in'}"])
    assert config.data.paths == [str(tmp_path / "in")]
    ds = make_datasets(data_config(tmp_path, source="text", paths=str(tmp_path / "in")))
    assert ds.train.num_documents + ds.eval.num_documents == 3


def test_unquoted_glob_in_a_list_override_explains_quoting(tmp_path):
    proc = kiln("config", REPO / "configs/tiny.yaml", "data.paths=[*.md, docs/*.md]")
    assert_user_error(
        proc, "data.paths=[*.md, docs/*.md]", "quote", """'data.paths=["*.md", "docs/*.md"]'"""
    )


# --- point 11: files that are not UTF-8 ------------------------------------------------------


def test_on_decode_error_skips_or_replaces_and_counts(tmp_path):
    spec = str(word_tokenizer(tmp_path))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("kiln mesh shard " * 4)
    (tmp_path / "in" / "b.txt").write_bytes(b"token batch \xff\xfe loss " * 4)  # not UTF-8
    (tmp_path / "in" / "c.txt").write_text("loss token " * 4)

    def datasets(policy):
        return make_datasets(
            data_config(
                tmp_path, source="text", paths=str(tmp_path / "in"), tokenizer=spec,
                on_decode_error=policy, eval_fraction=0.0, seq_len=4,
            )
        )  # fmt: skip

    with pytest.raises(KilnError, match=r"b\.txt: not UTF-8 text .*data\.on_decode_error"):
        datasets("error")
    skipped = datasets("skip")
    assert skipped.train.num_documents == 2
    assert skipped.notes == [
        f"data.paths: skipped 1 input that is not UTF-8 (on_decode_error: skip; the first: "
        f"{tmp_path / 'in' / 'b.txt'})"
    ]
    replaced = datasets("replace")
    assert replaced.train.num_documents == 3
    assert "replaced 1 input" in replaced.notes[0]
    # The replaced file's words are there, its invalid bytes became U+FFFD (<unk> here).
    tok = load_tokenizer(spec)
    want = tok.encode((b"token batch \xff\xfe loss " * 4).decode("utf-8", errors="replace"))
    stream = replaced.train.gather(np.arange(replaced.train.num_tokens))
    assert want == stream[len(tok.encode("kiln mesh shard " * 4)) + 1 :][: len(want)].tolist()


def test_on_decode_error_for_jsonl_lines_and_kiln_prepare(tmp_path):
    lines = [b'{"text": "first"}', b'{"text": "bad \xff"}', b'{"text": "third"}']
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    proc = kiln(
        "prepare", "--input", tmp_path / "a.jsonl", "--format", "jsonl", "--output", tmp_path / "o"
    )
    assert_user_error(proc, "a.jsonl:2: not UTF-8 text")
    proc = kiln(
        "prepare", "--input", tmp_path / "a.jsonl", "--format", "jsonl", "--output", tmp_path / "o",
        "--on-decode-error", "skip",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "2 documents" in proc.stdout and "skipped 1 input that is not UTF-8" in proc.stdout
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["decode_errors"]["skipped"] == 1 and manifest["on_decode_error"] == "skip"


def test_on_decode_error_is_part_of_the_cache_key(tmp_path):
    from kiln.data import cache_dir_for

    files, tok = [tmp_path / "a.txt"], load_tokenizer("byte")
    files[0].write_text("x")
    keys = {
        p: cache_dir_for(data_config(tmp_path, source="text", on_decode_error=p), files, tok)
        for p in ("error", "skip", "replace")
    }
    assert len(set(keys.values())) == 3


# --- point 12: vocab_size auto, the tokenizer of shards --------------------------------------


def test_vocab_size_auto_and_the_tokenizer_from_the_shards_manifest(tmp_path):
    tiny = load_config(REPO / "configs/tiny.yaml", ["model.vocab_size=auto"])
    assert tiny.model.vocab_size == 384  # byte: 259 tokens, rounded up to a multiple of 128

    spec = str(word_tokenizer(tmp_path, size=130))
    (tmp_path / "a.txt").write_text("kiln mesh shard token " * 20)
    prepare([tmp_path / "a.txt"], "text", "text", load_tokenizer(spec), tmp_path / "shards")
    config_file = tmp_path / "c.yaml"
    config_file.write_text(
        json.dumps(
            {
                "data": {"source": "tokens", "paths": str(tmp_path / "shards"), "seq_len": 8},
                "model": {"vocab_size": "auto", "max_seq_len": 8},
                "train": {"global_batch_size": 4, "eval_every_steps": 0},
            }
        )
    )
    config = load_config(config_file)
    assert config.data.tokenizer == spec  # no data.tokenizer: the manifest's
    assert config.model.vocab_size == 256  # 130 rounded up
    batch = next(make_datasets(config).train_iterator())
    assert set(batch["inputs"].ravel().tolist()) <= {1, 2, 3, 4, 5}  # the words and EOS
    # On top of configs/tiny.yaml (which leaves data.tokenizer to its default) too.
    shards = tmp_path / "shards"
    tiny = load_config(
        REPO / "configs/tiny.yaml",
        ["data.source=tokens", f"data.paths={shards}", "model.vocab_size=auto"],
    )
    assert (tiny.data.tokenizer, tiny.model.vocab_size) == (spec, 256)
    # A tokenizer given in the config still wins, and is checked against the shards.
    with pytest.raises(KilnError, match=r"shards were tokenized with"):
        make_datasets(load_config(config_file, ["data.tokenizer=byte"]))


# --- point 13: held-out sets -----------------------------------------------------------------


def test_a_held_out_set_smaller_than_an_eval_batch_is_a_warning(tmp_path):
    for i in range(7):
        (tmp_path / f"{i}.txt").write_text(f"doc {i} " * 3)
    config = make_config(
        data={"source": "text", "paths": str(tmp_path / "*.txt"), "seq_len": 8, "eval_fraction": 0.1,
              "cache_dir": str(tmp_path / "cache")},
        model={"max_seq_len": 8},
        train={"global_batch_size": 8, "eval_every_steps": 10},
        output_dir=tmp_path / "runs",
    )  # fmt: skip
    ds = make_datasets(config)
    assert ds.eval.num_documents == 1
    (warning,) = ds.warnings
    assert warning.startswith(
        f"the held-out set is 1 document ({ds.eval.num_tokens} tokens, "
        f"{ds.eval.num_windows} sequences of data.seq_len), fewer than one eval batch of 8 sequences"
    )


def test_eval_paths_name_the_held_out_set(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "held").mkdir()
    for i in range(5):
        (tmp_path / "train" / f"{i}.txt").write_text("a" * 40)
    for i in range(2):
        (tmp_path / "held" / f"{i}.txt").write_text("z" * 40)
    ds = make_datasets(
        data_config(
            tmp_path, source="text", paths=str(tmp_path / "train"),
            eval_paths=str(tmp_path / "held"),
        )
    )  # fmt: skip
    assert ds.train.num_documents == 5 and ds.eval.num_documents == 2  # all of data.paths trains
    (batch,) = ds.eval_batches(1)
    real = batch["inputs"][batch["weights"] > 0]
    assert set(real.tolist()) <= {ord("z"), 257}  # held-out text and EOS only
    with pytest.raises(KilnError, match=r"data\.eval_paths: .*0\.txt is also in data\.paths"):
        make_datasets(
            data_config(
                tmp_path, source="text", paths=str(tmp_path / "train"),
                eval_paths=str(tmp_path / "train" / "0.txt"),
            )
        )  # fmt: skip
    with pytest.raises(KilnError, match=r"data\.eval_paths: .*source is synthetic"):
        make_config(data={"source": "synthetic", "eval_paths": ["x"]})
