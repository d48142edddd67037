"""Data: tokenizers, `kiln prepare`, and the packed pipeline, against numpy references."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    TOKENIZER_LINES,
    assert_user_error,
    kiln,
    kiln_main,
    make_config,
    start_kiln,
    train_bpe,
    wait_until,
)
from kiln.config import load_config
from kiln.data import load_tokenizer, make_datasets
from kiln.data.prepare import prepare
from kiln.data.sources import resolve_inputs, stdlib_root
from kiln.data.synthetic import MARKOV_SUCCESSORS, markov_chain, markov_windows
from kiln.errors import KilnError

REPO = Path(__file__).resolve().parents[1]
EOS = 257  # of the byte tokenizer
KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")


def doc_text(i: int, n: int) -> str:
    """Document i: its own letter with a running digit, so content says which document it is."""
    return "".join(f"{chr(65 + i)}{j % 10}" for j in range(n))


@pytest.fixture
def corpus(tmp_path: Path) -> list[bytes]:
    """Seven text files of 1 to 45 bytes (some shorter than a window, some spanning several):
    125 tokens with their EOS, so 8 windows of 16 + 1."""
    docs = []
    for i, n in enumerate([20, 3, 45, 7, 1, 30, 12]):
        text = doc_text(i, n)[:n]
        (tmp_path / f"doc{i}.txt").write_text(text)
        docs.append(text.encode())
    return docs


def cfg(
    tmp_path: Path,
    *,
    batch: int = 4,
    processes: int = 1,
    process_id: int = 0,
    vocab: int = 384,
    **data,
):
    data = {
        "source": "text",
        "paths": [str(tmp_path / "*.txt")],
        "seq_len": 16,
        "eval_fraction": 0.0,
        "cache_dir": str(tmp_path / "cache"),
        **data,
    }
    return make_config(
        data=data,
        model={"vocab_size": vocab},
        train={"global_batch_size": batch},
        distributed={"num_processes": processes, "process_id": process_id},
        output_dir=tmp_path / "runs",
    )


def reference_windows(docs: list[bytes], seq_len: int) -> list[tuple]:
    """Independent reference: documents + EOS end to end, cut every seq_len, padded at the end."""
    stream = np.concatenate([np.append(np.frombuffer(d, np.uint8), EOS) for d in docs])
    n = math.ceil((len(stream) - 1) / seq_len)
    rows = []
    for w in range(n):
        win = stream[w * seq_len : w * seq_len + seq_len + 1]
        weights = np.zeros(seq_len)
        weights[: len(win) - 1] = 1
        padded = np.full(seq_len + 1, 258)
        padded[: len(win)] = win
        rows.append((tuple(padded[:-1]), tuple(padded[1:]), tuple(weights)))
    return rows


def letters(tokens) -> set[int]:
    """Which documents (by their letter) some tokens come from."""
    return {int(t) for t in np.asarray(tokens).ravel() if 65 <= t < 91}


def take(it, n):
    return [next(it) for _ in range(n)]


def rows_of(batches) -> list[tuple]:
    return [
        (tuple(b["inputs"][r]), tuple(b["targets"][r]), tuple(b["weights"][r]))
        for b in batches
        for r in range(len(b["inputs"]))
    ]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# ---------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_round_trip_and_ids():
    tok = load_tokenizer("byte")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    text = "def f(x):\n    return 'é' * x\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text


@pytest.fixture(scope="module")
def trained_tokenizers(tmp_path_factory) -> dict[str, Path]:
    """A tiny BPE tokenizer.json and a tiny sentencepiece model, trained here on a few lines."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("tok")
    train_bpe(d / "tokenizer.json", 300, ["<|endoftext|>", "<pad>"])
    (d / "lines.txt").write_text("\n".join(TOKENIZER_LINES))
    spm.SentencePieceTrainer.train(
        input=str(d / "lines.txt"),
        model_prefix=str(d / "sp"),
        vocab_size=60,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
    )
    return {"hf": d / "tokenizer.json", "sp": d / "sp.model"}


def test_file_tokenizers_find_special_ids_and_round_trip(trained_tokenizers):
    hf = load_tokenizer(str(trained_tokenizers["hf"]))
    assert hf.kind == "huggingface"
    assert hf.eos_id == 0 and hf.pad_id == 1 and hf.bos_id == hf.eos_id  # no BOS token: EOS
    sp = load_tokenizer(str(trained_tokenizers["sp"]))
    assert (sp.kind, sp.vocab_size, sp.bos_id, sp.eos_id, sp.pad_id) == (
        "sentencepiece",
        60,
        1,
        2,
        3,
    )
    text = "the quick brown fox 14 jumps"
    for tok in (hf, sp):
        ids = tok.encode(text)
        assert ids and max(ids) < tok.vocab_size
        assert tok.decode(ids) == text
        batch = tok.encode_batch([text, "lazy dogs"])
        assert batch[0].tolist() == ids


def test_two_tokenizer_files_never_share_a_cache_entry(tmp_path, monkeypatch):
    """Same relative spec, same size, same mtime, different files: two tokenizers."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    first, second = tmp_path / "a", tmp_path / "b"
    for directory, words in ((first, ["kiln", "mesh"]), (second, ["mesh", "kiln"])):
        directory.mkdir()
        vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
        tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(directory / "tok.json"))
        os.utime(directory / "tok.json", ns=(1_700_000_000_000_000_000,) * 2)
    files = [first / "tok.json", second / "tok.json"]
    assert files[0].stat().st_size == files[1].stat().st_size  # only the contents differ
    monkeypatch.chdir(first)
    a = load_tokenizer("tok.json")
    monkeypatch.chdir(second)
    b = load_tokenizer("tok.json")
    assert a.encode("kiln mesh") == [2, 3] and b.encode("kiln mesh") == [3, 2]
    assert a.sha256 != b.sha256
    # The same file again, whichever setting names it: cached.
    assert load_tokenizer("tok.json", what="--tokenizer") is b
    # A rewritten file (new contents, new mtime) is read again.
    files[1].write_text(files[0].read_text())
    assert load_tokenizer("tok.json").encode("kiln mesh") == [2, 3]
    # Errors name the setting the spec came from, whichever was asked first.
    (second / "bad.json").write_text("{}")
    with pytest.raises(KilnError, match=r"^data\.tokenizer: .*bad\.json is not a valid"):
        load_tokenizer("bad.json")
    with pytest.raises(KilnError, match=r"^--tokenizer: .*bad\.json is not a valid"):
        load_tokenizer("bad.json", what="--tokenizer")


def test_jsonl_with_sentencepiece_prepares_into_token_shards(tmp_path, trained_tokenizers):
    spec = str(trained_tokenizers["sp"])
    records = [{"text": f"the lazy fox {i}", "id": i} for i in range(5)] + [{"text": ""}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "shards"
    tok = load_tokenizer(spec)
    manifest, did_work = prepare([tmp_path / "a.jsonl"], "jsonl", "text", tok, out)
    assert did_work and manifest["num_documents"] == 5  # the empty document is skipped
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["sha256"] == tok.sha256
    tokens = np.concatenate(
        [np.fromfile(out / f"{s['name']}.bin", np.uint16) for s in manifest["shards"]]
    )
    expected = np.concatenate([[*tok.encode(r["text"]), tok.eos_id] for r in records[:5]])
    np.testing.assert_array_equal(tokens, expected)

    config = cfg(tmp_path, source="tokens", paths=[str(out)], tokenizer=spec, seq_len=8)
    batch = next(make_datasets(config).train_iterator())
    assert batch["inputs"].shape == (4, 8) and batch["inputs"].max() < 60


def test_parquet_source_reads_the_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["alpha beta", "gamma", None, "delta epsilon zeta"]
    pq.write_table(pa.table({"body": texts, "n": [1, 2, 3, 4]}), tmp_path / "t.parquet")
    config = cfg(tmp_path, source="parquet", paths=[str(tmp_path / "t.parquet")], field="body")
    ds = make_datasets(config)
    assert ds.describe()["train_documents"] == 3
    assert ds.describe()["train_tokens"] == sum(len(t) + 1 for t in texts if t)


# ---------------------------------------------------------------------------------------------
# The pipeline


def test_one_epoch_has_every_window_exactly_once_and_documents_masked(tmp_path, corpus):
    ds = make_datasets(cfg(tmp_path))
    n = ds.train.num_windows
    expected = reference_windows(corpus, 16)
    assert n == len(expected)
    rows = rows_of(take(ds.train_iterator(), math.ceil(n / 4)))[:n]
    assert collections.Counter(rows) == collections.Counter(expected)  # no drop, no duplicate
    # The next epoch is a new order of the same windows.
    rows2 = rows_of(take(ds.train_iterator(), math.ceil(2 * n / 4)))[n : 2 * n]
    assert collections.Counter(rows2) == collections.Counter(expected) and rows2 != rows

    for b in take(ds.train_iterator(), math.ceil(n / 4)):
        for inp, seg, pos, w in zip(b["inputs"], b["segment_ids"], b["positions"], b["weights"]):
            real = seg > 0
            assert np.all(w[~real] == 0)
            for s in np.unique(seg[real]):
                tokens = inp[seg == s]
                body = tokens[1:] if tokens[0] == EOS else tokens
                # A segment holds one document: a single letter, no EOS inside it.
                assert EOS not in body and len(letters(body)) <= 1
                np.testing.assert_array_equal(pos[seg == s], np.arange(len(tokens)))
            # Segments start exactly at EOS inputs (the EOS begins the next document).
            starts = np.flatnonzero(np.diff(seg[real]) != 0) + 1
            assert np.all(inp[real][starts] == EOS)


def test_same_seed_same_batches_other_seed_other_order(tmp_path, corpus):
    a = take(make_datasets(cfg(tmp_path)).train_iterator(), 6)
    b = take(make_datasets(cfg(tmp_path)).train_iterator(), 6)
    c = take(make_datasets(cfg(tmp_path, seed=1)).train_iterator(), 6)
    assert_same_batches(a, b)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))


@pytest.mark.parametrize("source", ["text", "synthetic"])
def test_restored_state_continues_exactly(tmp_path, corpus, source):
    config = cfg(tmp_path, source=source)
    it = make_datasets(config).train_iterator()
    take(it, 5)  # 8 windows = 2 batches per epoch: the continuation crosses epochs
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 7)
    resumed = make_datasets(config).train_iterator()
    resumed.set_state(state)
    assert_same_batches(take(resumed, 7), expected)


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_hold_disjoint_rows_that_cover_each_global_batch(tmp_path, corpus, processes):
    steps = 5
    whole = take(make_datasets(cfg(tmp_path, batch=8)).train_iterator(), steps)
    parts = [
        take(
            make_datasets(
                cfg(tmp_path, batch=8, processes=processes, process_id=p)
            ).train_iterator(),
            steps,
        )
        for p in range(processes)
    ]
    for step in range(steps):
        for p in range(processes):
            local = parts[p][step]
            assert local["inputs"].shape == (8 // processes, 16)
            for k in KEYS:
                rows = slice(p * 8 // processes, (p + 1) * 8 // processes)
                np.testing.assert_array_equal(local[k], whole[step][k][rows])
    # The first global batch is the whole first epoch (8 windows): each read once.
    first = [r for p in range(processes) for r in rows_of(parts[p][:1])]
    assert len(set(first)) == len(first)


def test_a_saved_state_continues_on_another_process_count(tmp_path, corpus):
    # What a checkpoint holds is the count of global batches read, whatever the process count:
    # a run saved by 2 processes continues on 1 or 4 with the batches 1 process would read.
    whole = take(make_datasets(cfg(tmp_path, batch=8)).train_iterator(), 8)
    saved = [make_datasets(cfg(tmp_path, batch=8, processes=2, process_id=p)) for p in range(2)]
    states = []
    for datasets in saved:
        it = datasets.train_iterator()
        take(it, 5)  # past 5 epochs (8 windows each) too
        states.append(json.loads(json.dumps(it.get_state())))
    assert states[0] == states[1] == {"next_index": 5}
    for processes in (1, 4):
        k = 8 // processes
        for p in range(processes):
            it = make_datasets(
                cfg(tmp_path, batch=8, processes=processes, process_id=p)
            ).train_iterator()
            it.set_state(states[0])
            for step, batch in enumerate(take(it, 3), start=5):
                for key in KEYS:
                    np.testing.assert_array_equal(batch[key], whole[step][key][p * k : (p + 1) * k])


def test_eval_split_is_held_out_deterministic_and_sharded(tmp_path):
    for i in range(20):
        (tmp_path / f"doc{i:02d}.txt").write_text(doc_text(i, 40))
    config = cfg(tmp_path, eval_fraction=0.1)
    ds = make_datasets(config)
    info = ds.describe()
    assert (info["train_documents"], info["eval_documents"]) == (18, 2)
    first, again = ds.eval_batches(3), ds.eval_batches(3)
    assert_same_batches(first, again)
    train = take(ds.train_iterator(), math.ceil(ds.train.num_windows / 4))
    held_out = letters(np.concatenate([b["inputs"][b["weights"] > 0] for b in first]))
    trained = letters(np.concatenate([b["inputs"].ravel() for b in train]))
    assert len(held_out) == 2 and len(trained) == 18 and not held_out & trained
    halves = [
        make_datasets(cfg(tmp_path, eval_fraction=0.1, processes=2, process_id=p)).eval_batches(3)
        for p in (0, 1)
    ]
    for b in range(3):
        for p in (0, 1):
            rows = slice(p * len(halves[p][b]["inputs"]), (p + 1) * len(halves[p][b]["inputs"]))
            np.testing.assert_array_equal(halves[p][b]["inputs"], first[b]["inputs"][rows])


def test_markov_source_has_its_stated_entropy(tmp_path):
    ds = make_datasets(
        cfg(tmp_path, source="synthetic", synthetic_kind="markov", seq_len=256, batch=64)
    )
    assert 1.0 < ds.entropy_rate < 2.5
    counts = np.zeros((259, 259))
    for b in take(ds.train_iterator(), 12):
        np.add.at(counts, (b["inputs"].ravel(), b["targets"].ravel()), 1)
        assert np.all(b["weights"] == 1) and np.all(b["segment_ids"] == 1)
    # Plug-in conditional entropy of ~200k transitions; its bias is about
    # (transitions - states) / (2 N) ~ 0.005 nats, so 0.03 is a safe tolerance.
    p = counts / counts.sum(1, keepdims=True).clip(1)
    h = -(counts * np.log(np.where(p > 0, p, 1))).sum() / counts.sum()
    assert abs(h - ds.entropy_rate) < 0.03
    assert (counts > 0).sum(1).max() <= 8  # each state has its 8 successors and no others
    uniform = make_datasets(cfg(tmp_path, source="synthetic", synthetic_kind="uniform"))
    assert uniform.entropy_rate == pytest.approx(math.log(259))
    assert next(uniform.train_iterator())["inputs"].max() < 259


def dense_markov_reference(vocab_size: int, seed: int):
    """The chain built as a dense float64 [V, V] matrix, sampled by inverse CDF over all V
    states: the construction the sparse chain must reproduce draw for draw."""
    rng = np.random.default_rng([seed, 0x4D41524B])
    v, k = vocab_size, MARKOV_SUCCESSORS
    trans = np.zeros((v, v))
    for i in range(v):
        others = rng.choice(np.delete(np.arange(v), (i + 1) % v), size=k - 1, replace=False)
        trans[i, np.concatenate([[(i + 1) % v], others])] = rng.dirichlet(np.ones(k))
    pi = np.linalg.matrix_power(trans.T, 256) @ np.full(v, 1.0 / v)
    pi /= pi.sum()
    plogp = np.where(trans > 0, trans * np.log(np.where(trans > 0, trans, 1)), 0)
    return trans, pi, -(pi * plogp.sum(1)).sum()


def test_markov_chain_matches_its_dense_construction_and_is_read_only():
    chain = markov_chain(259, 3)
    trans, pi, entropy = dense_markov_reference(259, 3)
    dense = np.zeros((259, 259))
    probs = np.diff(chain.cum_probs, prepend=0.0, axis=1)
    np.put_along_axis(dense, chain.successors, probs, axis=1)
    # float64, the same Dirichlet draws; cumulative sums and differences round at ~1e-16.
    np.testing.assert_allclose(dense, trans, rtol=0, atol=1e-15)
    np.testing.assert_allclose(chain.stationary, pi, rtol=1e-10)
    assert chain.entropy_rate == pytest.approx(entropy, rel=1e-12)
    # Sampling: inverse CDF over the dense rows gives the same tokens.
    ids = np.arange(16)
    got = markov_windows(ids, 65, 259, 3, 0)
    u = np.stack([np.random.default_rng([3, 0, int(i)]).random(65) for i in ids])
    cum = np.cumsum(trans, axis=1)
    want = np.empty_like(got)
    start = np.cumsum(pi)
    start[-1] = 1.0
    want[:, 0] = np.searchsorted(start, u[:, 0], side="right")
    for t in range(1, 65):
        want[:, t] = (cum[want[:, t - 1]] <= u[:, t, None]).sum(1)
    np.testing.assert_array_equal(got, want)
    for array in (chain.successors, chain.cum_probs, chain.stationary):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0


def test_markov_chain_scales_to_large_vocabularies():
    # Dense, this chain would be a 34 GB [65536, 65536] float64 matrix.
    chain = markov_chain(65536, 0)
    assert chain.successors.shape == chain.cum_probs.shape == (65536, MARKOV_SUCCESSORS)
    assert np.all(np.diff(chain.successors, axis=1) > 0)  # distinct successors, ascending
    assert np.all((chain.successors == (np.arange(1, 65537) % 65536)[:, None]).any(1))
    assert np.isclose(chain.stationary.sum(), 1.0) and 1.0 < chain.entropy_rate < 2.5
    tokens = markov_windows(np.arange(4), 33, 65536, 0, 1)
    nxt = chain.successors[tokens[:, :-1]]
    assert np.all((nxt == tokens[:, 1:, None]).any(-1))  # every step follows an edge


def test_tiny_config_trains_on_the_standard_library(tmp_path):
    files = resolve_inputs(["stdlib:**/*.py"])
    assert stdlib_root() / "os.py" in files
    assert not any("site-packages" in f.parts for f in files)
    config = load_config(REPO / "configs/tiny.yaml", [f"data.cache_dir={tmp_path}"])
    assert config.data.paths == ["stdlib:**/*.py"] and config.data.tokenizer == "byte"
    ds = make_datasets(config)
    assert ds.describe()["train_tokens"] > 5_000_000
    batch = next(ds.train_iterator())
    shape = (config.train.global_batch_size, config.data.seq_len)
    assert batch["inputs"].shape == shape and batch["weights"].dtype == np.float32
    assert ds.eval_batches(1)[0]["inputs"].shape == shape


# ---------------------------------------------------------------------------------------------
# kiln prepare


def many_files(tmp_path: Path, n: int = 24, size: int = 6000) -> list[Path]:
    d = tmp_path / "in"
    d.mkdir()
    for i in range(n):
        (d / f"f{i:02d}.txt").write_text(doc_text(i % 26, size // 2))
    return sorted(d.iterdir())


def shard_bytes(out: Path) -> bytes:
    manifest = json.loads((out / "manifest.json").read_text())
    return b"".join((out / f"{s['name']}.bin").read_bytes() for s in manifest["shards"])


def test_prepare_is_parallel_idempotent_and_the_same_for_any_worker_count(tmp_path):
    files = many_files(tmp_path)
    tok = load_tokenizer("byte")
    one, did = prepare(files, "text", "text", tok, tmp_path / "one", workers=1)
    assert did and one["num_documents"] == 24 and one["num_tokens"] == 24 * 6001
    two, _ = prepare(files, "text", "text", tok, tmp_path / "two", workers=2)
    assert len(two["shards"]) > 1 and two["workers"] == 2
    assert shard_bytes(tmp_path / "one") == shard_bytes(tmp_path / "two")
    before = (tmp_path / "two" / "manifest.json").stat().st_mtime_ns
    again, did = prepare(files, "text", "text", tok, tmp_path / "two", workers=2)
    assert not did and again == two
    assert (tmp_path / "two" / "manifest.json").stat().st_mtime_ns == before

    # The command line, in a process of its own (worker processes, not threads).
    out = tmp_path / "cli"
    cmd = ["prepare", "--input", str(tmp_path / "in" / "*.txt")]
    cmd += ["--format", "text", "--output", str(out), "--workers", "2"]
    run = kiln(*cmd)
    assert run.returncode == 0, run.stderr
    assert shard_bytes(out) == shard_bytes(tmp_path / "one")
    assert "up to date" in kiln(*cmd).stdout


def test_failed_prepare_leaves_no_output_that_looks_valid(tmp_path):
    good = [{"text": "x" * 50_000}] * 3
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in good))
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    out = tmp_path / "out"
    with pytest.raises(KilnError, match=r"b\.jsonl:2: no field 'text'"):
        prepare(
            [tmp_path / "a.jsonl", tmp_path / "b.jsonl"],
            "jsonl",
            "text",
            load_tokenizer("byte"),
            out,
            workers=2,
        )
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl"]  # no staging left


def test_killed_prepare_leaves_only_a_staging_directory_the_next_run_removes(tmp_path):
    fifo = tmp_path / "blocks.txt"
    os.mkfifo(fifo)  # reading it blocks until a writer comes: the run is caught mid-way
    out = tmp_path / "out"
    cmd = ["prepare", "--format", "text", "--output", str(out)]
    proc = start_kiln(*cmd, "--input", str(fifo))
    try:
        wait_until(lambda: any(tmp_path.glob(".out.partial-*")), proc, "the staging directory")
        staging = list(tmp_path.glob(".out.partial-*"))
    finally:
        proc.kill()
        proc.wait()
    assert staging and not out.exists()
    (tmp_path / "fine.txt").write_text("hello")
    run = kiln(*cmd, "--input", str(tmp_path / "fine.txt"))
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "manifest.json").read_text())["num_tokens"] == 6
    assert not list(tmp_path.glob(".out.partial-*"))


# ---------------------------------------------------------------------------------------------
# Bad input: one clear KilnError naming the file or field


def test_empty_glob_names_the_pattern(tmp_path):
    with pytest.raises(KilnError, match=r"data\.paths: '.*nothing-\*\.txt' matches no files"):
        make_datasets(cfg(tmp_path, paths=[str(tmp_path / "nothing-*.txt")]))


def test_unreadable_file_is_named(tmp_path):
    (tmp_path / "gone.txt").symlink_to(tmp_path / "missing-target")
    with pytest.raises(KilnError, match=r"cannot read .*gone\.txt"):
        prepare([tmp_path / "gone.txt"], "text", "text", load_tokenizer("byte"), tmp_path / "o")
    if os.geteuid() != 0:  # root reads any file, whatever its mode
        (tmp_path / "locked.txt").write_text("secret")
        (tmp_path / "locked.txt").chmod(0)
        with pytest.raises(KilnError, match=r"cannot read .*locked\.txt"):
            prepare(
                [tmp_path / "locked.txt"], "text", "text", load_tokenizer("byte"), tmp_path / "o"
            )


def test_corrupt_files_are_named(tmp_path, trained_tokenizers):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(KilnError, match=r"bad\.parquet: not a valid Parquet file"):
        make_datasets(cfg(tmp_path, source="parquet", paths=[str(tmp_path / "bad.parquet")]))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "unterminated\n')
    with pytest.raises(KilnError, match=r"bad\.jsonl:2: invalid JSON"):
        make_datasets(cfg(tmp_path, source="jsonl", paths=[str(tmp_path / "bad.jsonl")]))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    spec = str(trained_tokenizers["sp"])
    with pytest.raises(KilnError, match=r"latin1\.txt: not UTF-8"):
        make_datasets(cfg(tmp_path, paths=[str(tmp_path / "latin1.txt")], tokenizer=spec))
    # The byte tokenizer reads the same file as it is.
    assert make_datasets(cfg(tmp_path, paths=[str(tmp_path / "latin1.txt")])).train.num_tokens == 5


def test_jsonl_without_the_field_names_file_line_and_field(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"content": "hello"}\n')
    with pytest.raises(KilnError, match=r"d\.jsonl:1: no field 'text' \(data\.field"):
        make_datasets(cfg(tmp_path, source="jsonl", paths=[str(tmp_path / "d.jsonl")]))


def test_shards_from_another_tokenizer_are_refused(tmp_path, corpus, trained_tokenizers):
    out = tmp_path / "shards"
    prepare(sorted(tmp_path.glob("*.txt")), "text", "text", load_tokenizer("byte"), out)
    config = cfg(
        tmp_path, source="tokens", paths=[str(out)], tokenizer=str(trained_tokenizers["hf"])
    )
    with pytest.raises(
        KilnError, match=r"shards/manifest\.json: shards were tokenized with 'byte'"
    ):
        make_datasets(config)
    # A shard cut short (as by a crash of something else writing there) is refused too.
    first = out / "shard-00000.bin"
    first.write_bytes(first.read_bytes()[:-3])
    with pytest.raises(KilnError, match=r"shard-00000\.bin: \d+ bytes, the manifest says"):
        make_datasets(cfg(tmp_path, source="tokens", paths=[str(out)]))
    with pytest.raises(KilnError, match="already holds shards prepared from other inputs"):
        prepare([tmp_path / "doc0.txt"], "text", "text", load_tokenizer("byte"), out)


def test_vocab_too_small_and_bad_tokenizer_name_the_field(tmp_path, corpus):
    with pytest.raises(KilnError, match=r"model\.vocab_size: 256 .* 259 tokens .*384"):
        make_datasets(cfg(tmp_path, vocab=256))
    with pytest.raises(KilnError, match=r"data\.tokenizer: file not found: 'nope\.json'"):
        make_datasets(cfg(tmp_path, tokenizer="nope.json"))
    (tmp_path / "vocab.txt").write_text("x")
    with pytest.raises(KilnError, match=r"data\.tokenizer: got .*vocab\.txt'; allowed: 'byte'"):
        make_datasets(cfg(tmp_path, tokenizer=str(tmp_path / "vocab.txt")))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--input", "{tmp}/none-*.txt", "--format", "text"],
            "--input: '{tmp}/none-*.txt' matches no files",
        ),
        (["--input", "{tmp}/d.jsonl", "--format", "jsonl"], "{tmp}/d.jsonl:1: no field 'text'"),
        (
            [
                "--input",
                "{tmp}/d.jsonl",
                "--format",
                "jsonl",
                "--field",
                "content",
                "--tokenizer",
                "x.model",
            ],
            "--tokenizer: file not found: 'x.model'",
        ),
        (
            ["--input", "{tmp}/d.jsonl", "--format", "jsonl", "--workers", "0"],
            "argument --workers: got '0'; allowed: an integer >= 1",
        ),
        (
            ["--input", "{tmp}/d.jsonl", "--format", "jsonl", "--workers", "-3"],
            "argument --workers: got '-3'; allowed: an integer >= 1",
        ),
    ],
)
def test_cli_prepare_bad_input_exits_2_with_one_line(tmp_path, args, message):
    (tmp_path / "d.jsonl").write_text('{"content": "hello"}\n')
    out = tmp_path / "out"
    args = [a.format(tmp=tmp_path) for a in args]
    run = kiln("prepare", *args, "--output", out)
    assert_user_error(run)
    assert run.stderr.startswith(f"kiln: error: {message.format(tmp=tmp_path)}")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# Token ids beyond model.vocab_size are refused, never trained on


def flip_token(shard: Path, position: int, value: int) -> None:
    tokens = np.fromfile(shard, np.uint16)
    tokens[position] = value
    tokens.tofile(shard)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, corpus):
    out = tmp_path / "shards"
    manifest, _ = prepare(
        sorted(tmp_path.glob("*.txt")), "text", "text", load_tokenizer("byte"), out
    )
    # The recorded maximum is the shard's own (numpy reference), here EOS.
    assert manifest["max_token_id"] == int(np.fromfile(out / "shard-00000.bin", np.uint16).max())
    assert manifest["shards"][0]["max_token_id"] == EOS
    for suffix in ("bin", "idx"):  # checksums of the files as written (zlib over whole files)
        data = (out / f"shard-00000.{suffix}").read_bytes()
        assert manifest["shards"][0][f"{suffix}_crc32"] == f"{zlib.crc32(data):08x}"
    config = cfg(tmp_path, source="tokens", paths=[str(out)])
    bad = r"shard-00000\.bin: holds token id {}, but model\.vocab_size is 384"

    # Prepared for a larger vocabulary: refused from the manifest alone, before any read.
    entry = json.loads((out / "manifest.json").read_text())
    entry["shards"][0]["max_token_id"] = 384
    (out / "manifest.json").write_text(json.dumps(entry))
    with pytest.raises(KilnError, match=bad.format(384)):
        make_datasets(config)

    # A manifest of an older kiln (no recorded maximum or checksums): the shard is scanned at open.
    del entry["shards"][0]["max_token_id"], entry["max_token_id"]
    del entry["shards"][0]["bin_crc32"], entry["shards"][0]["idx_crc32"]
    (out / "manifest.json").write_text(json.dumps(entry))
    assert make_datasets(config).train.num_tokens == 125
    flip_token(out / "shard-00000.bin", 40, 0xFFFF)
    with pytest.raises(KilnError, match=bad.format(65535)):
        make_datasets(config)

    # Damaged after prepare (the recorded maximum is right, the bytes are not): the batch that
    # reads the bad token is refused, for training and evaluation alike.
    entry["shards"][0]["max_token_id"] = EOS
    (out / "manifest.json").write_text(json.dumps(entry))
    datasets = make_datasets(config)
    with pytest.raises(KilnError, match=bad.format(65535)):
        take(datasets.train_iterator(), 2)  # 8 windows, 4 a batch: one epoch
    split = make_datasets(cfg(tmp_path, source="tokens", paths=[str(out)], eval_fraction=0.5))
    refused = []
    for windows in (split.train, split.eval):  # token 40 is in exactly one of them
        with contextlib.suppress(KilnError):
            windows.batch(np.arange(windows.num_windows))
            continue
        refused.append(windows)
    assert len(refused) == 1
    with pytest.raises(KilnError, match=bad.format(65535)):
        refused[0].batch(np.arange(refused[0].num_windows))


def test_cli_train_on_out_of_range_shards_exits_2_before_writing(tmp_path, corpus):
    out = tmp_path / "shards"
    prepare(sorted(tmp_path.glob("*.txt")), "text", "text", load_tokenizer("byte"), out)
    flip_token(out / "shard-00000.bin", 3, 4000)
    entry = json.loads((out / "manifest.json").read_text())
    for key in ("max_token_id", "bin_crc32", "idx_crc32"):  # a manifest of an older kiln
        del entry["shards"][0][key]
    (out / "manifest.json").write_text(json.dumps(entry))
    config = tmp_path / "c.yaml"
    raw = {"data": {"source": "tokens", "paths": [str(out)]}, "model": {"vocab_size": 384}}
    config.write_text(json.dumps(raw))  # JSON is YAML
    runs = tmp_path / "runs"
    run = kiln_main("train", config, f"train.output_dir={runs}")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.splitlines() == [
        f"kiln: error: {out}/shard-00000.bin: holds token id 4000, but model.vocab_size is "
        "384; allowed: ids below it (the shard is damaged or was prepared for another "
        "vocabulary; re-run kiln prepare with data.tokenizer)"
    ]
    assert not runs.exists()


def test_cli_train_on_shards_damaged_after_prepare_is_refused(tmp_path, corpus):
    out = tmp_path / "shards"
    prepare(sorted(tmp_path.glob("*.txt")), "text", "text", load_tokenizer("byte"), out)
    flip_token(out / "shard-00000.bin", 3, 4000)  # right byte count; the manifest says max 257
    model = {"vocab_size": 384, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32}
    raw = {
        "data": {"source": "tokens", "paths": [str(out)], "seq_len": 16},
        "model": {**model, "max_seq_len": 16},
        "train": {"global_batch_size": 8, "steps": 3},  # 8 windows: every batch holds token 3
        "optim": {"warmup_steps": 0},
    }
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(raw))  # JSON is YAML
    runs = tmp_path / "runs"
    # Refused at open: the shard's bytes do not have the checksum kiln prepare recorded.
    run = kiln_main("train", config, f"train.output_dir={runs}")
    assert_user_error(run, f"{out}/shard-00000.bin: its bytes do not match the CRC-32 in ")
    assert not runs.exists()
    # Not checked at open (data.verify_shards: false): the batch holding the id is refused,
    # in a process of its own (what it shows: one line, no traceback).
    run = kiln("train", config, f"train.output_dir={runs}", "data.verify_shards=false")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert [line for line in run.stderr.splitlines() if line.startswith("kiln: error:")] == [
        f"kiln: error: {out}/shard-00000.bin: holds token id 4000, but model.vocab_size is "
        "384; allowed: ids below it (the shard is damaged or was prepared for another "
        "vocabulary; re-run kiln prepare with data.tokenizer)"
    ]
    # The first batch is read before the run directory is written: nothing of the run is.
    assert not (runs / "tiny").exists()
