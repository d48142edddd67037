"""Paths that are URLs (fsspec's in-memory filesystem and file:// stand in for gs:// or s3://),
and Parquet files read one bounded batch at a time."""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path

import fsspec
import fsspec.implementations.memory
import numpy as np
import pytest

from conftest import MEMORY, assert_user_error, kiln, make_config
from kiln.data import load_tokenizer, make_datasets
from kiln.data.eval_tasks import load_perplexity, parse_task
from kiln.data.prepare import run_prepare
from kiln.data.remote_tokens import RemoteTokens
from kiln.data.sources import plan_tasks, read_documents, resolve_inputs
from kiln.errors import KilnError
from kiln.runs.remote import local_run

WORDS = ["the", "of", "kiln", "model", "token", "loss", "shard", "mesh", "step", "batch", "layer"]  # fmt: skip


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(3, 40))) for _ in range(n)]


def write_inputs(put, docs: list[str]) -> None:
    """The same documents as text files, one JSONL file and one Parquet file, through `put`."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, d in enumerate(docs):
        put(f"txt/doc{i:02d}.txt", d.encode())
    put("data.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, row_group_size=4)
    put("data.parquet", buf.getvalue())


def shard_bytes(fs, root: str) -> dict[str, bytes]:
    manifest = json.loads(fs.cat_file(f"{root}/manifest.json"))
    names = [e["name"] + s for e in manifest["shards"] for s in (".bin", ".idx")]
    return {n: fs.cat_file(f"{root}/{n}") for n in names}


def test_prepare_reads_memory_and_file_urls_and_writes_a_memory_url(tmp_path, mem):
    docs = texts(12)
    local = tmp_path / "in"

    def put_both(name, data):
        MEMORY.pipe_file(f"{mem}/in/{name}", data)
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)

    write_inputs(put_both, docs)
    lfs = fsspec.filesystem("file")
    for fmt, name in (("text", "txt"), ("jsonl", "data.jsonl"), ("parquet", "data.parquet")):
        ref = tmp_path / f"ref-{fmt}"
        run_prepare([str(local / name)], fmt, "text", "byte", str(ref))
        out = f"memory://{mem}/out-{fmt}"
        line = run_prepare([f"memory://{mem}/in/{name}"], fmt, "text", "byte", out)
        assert line.startswith(f"{out}: 12 documents"), line
        assert shard_bytes(MEMORY, f"{mem}/out-{fmt}") == shard_bytes(lfs, str(ref))
        manifest = json.loads(MEMORY.cat_file(f"{mem}/out-{fmt}/manifest.json"))
        assert all(i["path"].startswith("memory://") for i in manifest["inputs"])
        # Same inputs, same tokenizer: nothing to do; a file:// URL names the local inputs.
        assert "up to date" in run_prepare([f"memory://{mem}/in/{name}"], fmt, "text", "byte", out)
        via_file = tmp_path / f"file-{fmt}"
        run_prepare([(local / name).as_uri()], fmt, "text", "byte", via_file.as_uri())
        assert shard_bytes(lfs, str(via_file)) == shard_bytes(lfs, str(ref))
    # A perplexity task (train.eval_tasks, kiln eval) reads a URL too.
    task = load_perplexity(
        parse_task(f"perplexity:memory://{mem}/in/data.parquet"), load_tokenizer("byte"), 384, 16
    )
    assert task.num_documents == 12 and task.num_bytes == sum(len(d) for d in docs)
    # An object replaced by one of the same size is another input (the store's version tag).
    MEMORY.pipe_file(f"{mem}/in/data.jsonl", MEMORY.cat_file(f"{mem}/in/data.jsonl").upper())
    with pytest.raises(KilnError, match="already holds shards prepared from other inputs"):
        run_prepare(
            [f"memory://{mem}/in/data.jsonl"], "jsonl", "text", "byte", f"memory://{mem}/out-jsonl"
        )
    # What an interrupted upload leaves (shards, no manifest) is replaced; anything else is not.
    MEMORY.pipe_file(f"{mem}/cut/shard-00003.bin", b"stale")
    run_prepare([f"memory://{mem}/in/txt"], "text", "text", "byte", f"memory://{mem}/cut")
    assert shard_bytes(MEMORY, f"{mem}/cut") == shard_bytes(lfs, str(tmp_path / "ref-text"))
    assert sorted(MEMORY.ls(f"{mem}/cut", detail=False)) == [
        f"{mem}/cut/{n}" for n in ("manifest.json", "shard-00000.bin", "shard-00000.idx")
    ]
    MEMORY.pipe_file(f"{mem}/busy/notes.txt", b"mine")
    with pytest.raises(KilnError, match=r"holds 'notes\.txt', so it is not empty"):
        run_prepare([f"memory://{mem}/in/txt"], "text", "text", "byte", f"memory://{mem}/busy")
    assert len(resolve_inputs([f"memory://{mem}/in/txt"])) == 12  # a directory: every file
    with pytest.raises(KilnError, match="matches no files"):
        resolve_inputs([f"memory://{mem}/in/*.md"])


@pytest.fixture
def shards(tmp_path, mem):
    """The same `kiln prepare` output on the local disk and at a memory:// URL."""
    for i, d in enumerate(texts(30, seed=1)):
        (tmp_path / f"doc{i:02d}.txt").write_text(d)
    local = tmp_path / "shards"
    run_prepare([str(tmp_path / "*.txt")], "text", "text", "byte", str(local))
    MEMORY.put(str(local), f"{mem}/shards", recursive=True)
    return local, f"memory://{mem}/shards"


def data_config(tmp_path, path: str):
    return make_config(
        data={"source": "tokens", "paths": [path], "seq_len": 16, "eval_fraction": 0.2},
        model={"vocab_size": 384},
        train={"global_batch_size": 4, "eval_every_steps": 1},
        output_dir=tmp_path / "runs",
    )


def test_token_shards_at_a_url_give_the_batches_of_local_shards(tmp_path, shards):
    local, url = shards
    want, got = (
        make_datasets(data_config(tmp_path, str(local))),
        make_datasets(data_config(tmp_path, url)),
    )
    assert got.describe() == want.describe()
    assert isinstance(got.train.shards[0], RemoteTokens)
    a, b = want.train_iterator(), got.train_iterator()
    for _ in range(12):  # past one epoch (26 windows / 4 rows)
        x, y = next(a), next(b)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    for x, y in zip(want.eval_batches(2), got.eval_batches(2)):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    # A byte changed at the URL after prepare is refused by the recorded CRC-32.
    path = url.removeprefix("memory://") + "/shard-00000.bin"
    blob = bytearray(MEMORY.cat_file(path))
    blob[5] ^= 1
    MEMORY.pipe_file(path, bytes(blob))
    with pytest.raises(KilnError, match="do not match the CRC-32"):
        make_datasets(data_config(tmp_path, url))


def test_remote_tokens_index_like_the_array(mem):
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 60000, size=100_000).astype(np.uint16)
    MEMORY.pipe_file(f"{mem}/t.bin", ref.tobytes())
    tokens = RemoteTokens(f"memory://{mem}/t.bin", np.uint16, len(ref))
    # Windows far apart (separate ranges) and close together (merged), duplicates, any order.
    rows = np.array([99_900, 3, 70_000, 40, 5, 70_010])[:, None] + np.arange(17)
    np.testing.assert_array_equal(tokens[rows], ref[rows])
    idx = rng.integers(0, len(ref), size=500)
    np.testing.assert_array_equal(tokens[idx], ref[idx])
    np.testing.assert_array_equal(tokens[10:1000:7], ref[10:1000:7])
    assert len(tokens[5:5]) == 0 and len(tokens) == len(ref)
    with pytest.raises(IndexError):
        tokens[np.array([len(ref)])]
    MEMORY.pipe_file(f"{mem}/t.bin", ref[:-10].tobytes())  # cut short after it was opened
    with pytest.raises(KilnError, match="shorter than the 100000 tokens its manifest records"):
        tokens[np.array([3, len(ref) - 1])]


def test_parquet_is_read_one_row_group_batch_at_a_time(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = texts(120, seed=2)
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": docs, "n": np.arange(120)}), path, row_group_size=10)
    tasks = plan_tasks("parquet", [path], [path.stat().st_size], target_bytes=1)
    assert [t.row_groups for t in tasks] == [(g,) for g in range(12)]

    def whole(*args, **kwargs):
        raise AssertionError("read the whole file or whole row groups at once")

    for name in ("read", "read_row_groups", "read_row_group"):
        monkeypatch.setattr(pq.ParquetFile, name, whole)
    monkeypatch.setattr(pq, "read_table", whole)
    calls = []
    real = pq.ParquetFile.iter_batches

    def recorded(self, batch_size=65536, row_groups=None, columns=None, **kw):
        calls.append((batch_size, tuple(row_groups), tuple(columns)))
        return real(self, batch_size, row_groups=row_groups, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recorded)
    got = [d for t in tasks for d in read_documents(t, "text", want_bytes=False)[0]]
    assert got == docs
    # One group per task, the text column only, at most 1024 rows in memory at once.
    assert calls == [(1024, (g,), ("text",)) for g in range(12)]


def test_bad_urls_are_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    # A fresh process: its memory filesystem is empty, so the URL names nothing.
    proc = kiln("prepare", "--input", "memory://nowhere/*.txt", "--format", "text", "--output", out)
    assert_user_error(proc, "memory://nowhere/*.txt", "matches no files")
    assert not out.exists()
    with pytest.raises(KilnError, match=r"data.paths: .*manifest.json not found \(no such dir"):
        make_datasets(data_config(tmp_path, f"memory:///missing-{uuid.uuid4().hex}"))
    with pytest.raises(KilnError, match=r"not found \(no such directory\)"):
        make_datasets(data_config(tmp_path, (tmp_path / "none").as_uri()))
    with pytest.raises(KilnError, match=r"data\.paths: 'nosuch://x/y\.txt': fsspec knows no URL"):
        resolve_inputs(["nosuch://x/y.txt"])
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(
            KilnError,
            match=r"--input: gs://b/x.txt needs gcsfs, which is not installed \(pip install 'kiln\[gcs\]'",
        ):
            resolve_inputs(["gs://b/x.txt"], what="--input")

    # Whatever a store's backend raises (HTTP, credentials) is one line naming the URL.
    class Forbidden(fsspec.implementations.memory.MemoryFileSystem):
        protocol = "kilnforbidden"

        def info(self, path, **kwargs):
            raise RuntimeError(
                "403 Forbidden: kiln-test@example.iam lacks storage.objects.get\nbody"
            )

    fsspec.register_implementation("kilnforbidden", Forbidden, clobber=True)
    with pytest.raises(KilnError) as e:
        resolve_inputs(["kilnforbidden://bucket/x.txt"], what="--input")
    assert str(e.value) == (
        "--input: cannot list kilnforbidden://bucket/x.txt: 403 Forbidden: "
        "kiln-test@example.iam lacks storage.objects.get"
    )
    for field in ("train.mirror_dir", "data.cache_dir"):
        section, key = field.split(".")
        with pytest.raises(KilnError, match=rf"{field}: .*s3:// URL, but {field} needs a local"):
            make_config(**{section: {key: "s3://bucket/runs"}})
    config = make_config(train={"output_dir": (tmp_path / "r").as_uri()})
    assert config.run_dir == tmp_path / "r" / "run"


def run_config(data_path: str, output_dir: str, run_name: str, steps: int, **checkpoint):
    return make_config(
        model={"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "max_seq_len": 16},
        data={"source": "tokens", "paths": [data_path], "seq_len": 16, "eval_fraction": 0.0},
        mesh={"fsdp": -1},
        optim={"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0},
        train={"output_dir": output_dir, "run_name": run_name, "global_batch_size": 8, "log_every_steps": 1, "steps": steps},
        checkpoint={"every_steps": 2, "async_save": False, **checkpoint},
    )  # fmt: skip


def logged_losses(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["learning/loss"] for r in rows if "learning/loss" in r}


@pytest.mark.slow
def test_training_on_memory_shards_into_a_file_url_resumes_exactly(tmp_path, mem, shards):
    from kiln.training import pretrain

    local, url = shards
    # One output directory, so the runs share its compilation cache (one compile, not three).
    output = (tmp_path / "url runs").as_uri()  # file:///.../url%20runs
    straight = run_config(str(local), output, "straight", steps=4)
    assert straight.run_dir == tmp_path / "url runs" / "straight"
    pretrain.run(straight)
    want = logged_losses(straight.run_dir)
    first = run_config(url, output, "r", steps=2)
    pretrain.run(first)
    pretrain.run(run_config(url, output, "r", steps=4))
    got = logged_losses(first.run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    assert got == want  # bitwise: the same batches from the URL, the same resumed state
    assert (first.run_dir / "checkpoints" / "4").is_dir()

    # checkpoint.load_params_from a URL: the run is mirrored locally, then restored like a
    # local one (the first step's loss, before any update, is the same bitwise).
    MEMORY.put(str(first.run_dir), f"{mem}/runs/r", recursive=True)
    firsts = {}
    for name, source in (("ft-local", str(first.run_dir)), ("ft-url", f"memory://{mem}/runs/r")):
        pretrain.run(run_config(url, output, name, steps=1, load_params_from=source))
        firsts[name] = logged_losses(tmp_path / "url runs" / name)[1]
    assert firsts["ft-url"] == firsts["ft-local"] != want[1]
    mirrored = tmp_path / "url runs" / ".cache" / "remote-runs"
    assert sorted(p.name for p in mirrored.glob("*/r/checkpoints/[0-9]*")) == ["2", "4"]

    # distillation.teacher_run_dir at a URL: the teacher restored is the local run's, bitwise.
    import jax

    from kiln.distill.teacher import load_teacher
    from kiln.parallel.mesh import make_mesh

    teachers = []
    for source in (str(first.run_dir), f"memory://{mem}/runs/r"):
        student = run_config(url, output, "student", steps=1)
        student = student.model_copy(
            update={
                "distillation": student.distillation.model_copy(update={"teacher_run_dir": source})
            }
        )
        teachers.append(load_teacher(student, make_mesh(student)))
    assert [t.step for t in teachers] == [4, 4] and teachers[1].run_dir.is_relative_to(mirrored)
    for a, b in zip(
        jax.tree.leaves(teachers[0].params), jax.tree.leaves(teachers[1].params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_run_at_a_url_is_mirrored_without_its_logs_and_kept_in_step(tmp_path, mem):
    files = {
        "config.yaml": b"model: {}\n",
        "metrics.jsonl": b"{}\n",
        "tensorboard/events.out": b"e" * 10,
        "checkpoints/2/state/data": b"2" * (2 << 20),
        "checkpoints/4/state/data": b"4" * (2 << 20),
    }
    for rel, data in files.items():
        MEMORY.pipe_file(f"{mem}/run/{rel}", data)
    config = make_config(output_dir=tmp_path / "runs")
    local = local_run(f"memory://{mem}/run", "distillation.teacher_run_dir", config)
    assert local.name == "run" and local.parent.parent.name == "remote-runs"
    got = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert got == {k: v for k, v in files.items() if k.startswith(("config", "checkpoints"))}
    # The run moved on: a step removed there is removed here, a new one fetched.
    MEMORY.rm(f"{mem}/run/checkpoints/2", recursive=True)
    MEMORY.pipe_file(f"{mem}/run/checkpoints/6/state/data", b"6")
    MEMORY.pipe_file(f"{mem}/run/config.yaml", b"model: []\n")  # same size, new bytes
    assert local_run(f"memory://{mem}/run", "f", config) == local
    assert sorted(p.name for p in (local / "checkpoints").iterdir()) == ["4", "6"]
    assert (local / "config.yaml").read_bytes() == b"model: []\n"
    # kiln compile needs the teacher's config.yaml only.
    only = local_run(
        f"memory://{mem}/run", "f", make_config(output_dir=tmp_path / "c"), only=("config.yaml",)
    )
    assert [p.name for p in only.rglob("*")] == ["config.yaml"]
    MEMORY.pipe_file(f"{mem}/logs/metrics.jsonl", b"{}\n")
    with pytest.raises(KilnError, match=r"^f: memory://.*/logs has no config.yaml; is it a kiln"):
        local_run(f"memory://{mem}/logs", "f", config, only=("config.yaml",))
    with pytest.raises(
        KilnError, match=r"checkpoint.load_params_from: memory://.*/none is not a directory"
    ):
        local_run(f"memory://{mem}/none", "checkpoint.load_params_from", config)
