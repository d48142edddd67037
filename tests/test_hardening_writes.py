"""Attacks on what kiln writes: outputs that cannot be written, a disk that fills up while
writing, a second writer on one store, malformed URLs, a first batch that cannot be trained on
and a damaged tokenized cache. Bad input is one line and exit 2 with nothing written; a fault is
one line and exit 1 with nothing half-written and nothing lost."""

import errno
import importlib
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import kiln_env, kiln_main, make_config, write_config
from kiln.data import make_datasets
from kiln.data.prepare import prepare
from kiln.data.tokenizers import load_tokenizer
from kiln.distill.store import shard_complete
from kiln.runs.checkpoint import Checkpointer
from kiln.training import train
from kiln.training.loop import checkpoint_tree
from kiln.util.files import write_array

SEQ, BATCH = 16, 8
MODEL = {"vocab_size": 384, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32,
         "max_seq_len": SEQ}  # fmt: skip
ROOT = pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
ALLOWED_URLS = (
    "allowed: a local path, file:///absolute/path, or a URL of a scheme fsspec knows with a "
    "path after it (gs://bucket/dir, s3://bucket/dir, hf://..., memory://dir)"
)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A teacher run directory: config.yaml and a checkpoint (step 2) of an initialised model."""
    root = tmp_path_factory.mktemp("teacher")
    config = make_config(
        model=MODEL, data={"source": "synthetic", "seq_len": SEQ}, mesh={"fsdp": -1},
        train={"run_name": "teacher", "global_batch_size": BATCH, "steps": 2},
        checkpoint={"async_save": False}, output_dir=root / "runs",
    )  # fmt: skip
    ckpt = Checkpointer(config.run_dir, config.checkpoint)
    ckpt.save(2, checkpoint_tree(train.init_state(config)), {})
    ckpt.close()
    (config.run_dir / "config.yaml").write_text(config.to_yaml())
    return config.run_dir


def student(tmp_path: Path, teacher: Path | str, compile_cache: Path, **data) -> Path:
    """The config file of a 2-step student of `teacher` (synthetic data unless `data` says)."""
    return write_config(
        tmp_path / "student.yaml",
        model=MODEL,
        data={"source": "synthetic", "seq_len": SEQ, **data},
        mesh={"fsdp": -1},
        optim={"warmup_steps": 0},
        train={
            "global_batch_size": BATCH,
            "steps": 2,
            "output_dir": str(tmp_path / "runs"),
            "compilation_cache_dir": str(compile_cache),
        },
        distillation={"teacher_run_dir": str(teacher)},
    )


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    """The `kiln: error:` lines of a command, after checking it printed no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("kiln: error:")]


def text_inputs(tmp_path: Path) -> Path:
    """A directory of three small text files."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(3):
        (inputs / f"doc{i}.txt").write_text(f"document {i} of the kiln corpus\n" * 40)
    return inputs


# ---------------------------------------------------------------------------------------------
# Unwritable outputs: refused before any work, in one line naming the option


def read_only_out(tmp_path: Path) -> Path:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH)
    return ro / "out"


def file_in_the_way(tmp_path: Path) -> Path:
    (tmp_path / "afile").write_text("")
    return tmp_path / "afile" / "out"


@pytest.mark.parametrize("command", ["prepare", "teacher-logits"])
@pytest.mark.parametrize(
    "where, why",
    [
        pytest.param(read_only_out, "cannot be created or written (Permission denied in {tmp}/ro)",
                     marks=ROOT, id="read-only"),
        pytest.param(lambda _: Path("/proc/kiln-out"),
                     "cannot be created or written (No such file or directory in /proc)", id="proc"),
        pytest.param(file_in_the_way, "cannot be created: {tmp}/afile is not a directory",
                     id="file-in-the-way"),
    ],
)  # fmt: skip
def test_unwritable_output_is_refused_before_any_work(tmp_path, command, where, why):
    out = where(tmp_path)
    if command == "prepare":
        args = ("prepare", "--input", text_inputs(tmp_path), "--format", "text", "--output", out)
        option = "--output"
    else:  # the teacher is not even read: --out is checked first
        config = student(tmp_path, tmp_path / "no-teacher", tmp_path / "jax")
        args, option = ("teacher-logits", config, "--out", out), "--out"
    before = sorted(tmp_path.rglob("*"))
    proc = kiln_main(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"kiln: error: {option}: {out} {why.format(tmp=tmp_path)}; allowed: a directory kiln "
        "can create or write"
    ]
    assert sorted(tmp_path.rglob("*")) == before


# ---------------------------------------------------------------------------------------------
# A full disk while writing: one line, exit 1, nothing half-written, nothing already written lost


def test_arrays_written_to_a_full_device_keep_the_errno():
    # numpy's own writers report a full disk without an errno ("N requested and 0 written").
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    with pytest.raises(OSError) as e:
        write_array(Path("/dev/full"), np.arange(100_000, dtype=np.uint16), npy=True)
    assert e.value.errno == errno.ENOSPC


def fills_up_after(calls: int):
    """A `write_array` whose disk is full from call number `calls` on: that call writes half its
    bytes, then fails as a full disk does."""
    count = [0]

    def write(path, array, **options):
        count[0] += 1
        if count[0] < calls:
            return write_array(path, array, **options)
        Path(path).write_bytes(np.ascontiguousarray(array).tobytes()[: array.nbytes // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write


@pytest.mark.parametrize("command", ["prepare", "teacher-logits"])
def test_full_disk_while_writing_keeps_nothing_half_written(
    tmp_path, monkeypatch, teacher, compile_cache, command
):
    if command == "prepare":
        out = tmp_path / "new" / "shards"  # its parent is made by the command, and removed again
        inputs = text_inputs(tmp_path)
        module = importlib.import_module("kiln.data.prepare")  # kiln.data.prepare is a function
        monkeypatch.setattr(module, "write_array", fills_up_after(2))  # the .idx
        proc = kiln_main("prepare", "--input", inputs, "--format", "text", "--output", out)
        then = "prepare it"
    else:
        out = tmp_path / "store"
        config = student(tmp_path, teacher, compile_cache)
        # Four arrays per shard: the disk fills up inside the second shard.
        monkeypatch.setattr("kiln.distill.store.write_array", fills_up_after(6))
        args = ("teacher-logits", config, "--out", out, "--top-k", "4", "--shard-steps", "1")
        proc = kiln_main(*args)
        first, second = "steps-00000000-00000001.rows-000000-000008", "steps-00000001-00000002.rows-000000-000008"  # fmt: skip
        then, kept = (
            "finish the store (the shards written so far are kept)",
            ["manifest.json", first],
        )
    assert proc.returncode == 1, proc.stderr[-3000:]
    where = out if command == "prepare" else out / second
    assert errors(proc) == [
        f"kiln: error: no space left on device writing {where}; nothing half-written was kept: "
        f"free space, then run the same command again to {then}"
    ]
    if command == "prepare":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no staging, no new/
        return
    assert sorted(p.name for p in out.iterdir()) == kept  # no staging, no lock, shard 0 whole
    assert shard_complete(out / first)
    monkeypatch.undo()
    proc = kiln_main(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 shard of" in proc.stderr and "already written; resuming" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [*kept, second]
    assert shard_complete(out / second)


# ---------------------------------------------------------------------------------------------
# A second writer on one store: refused naming the holder; a dead holder's lock is taken over

HOLDER = """
import sys, time
from pathlib import Path
from kiln.runs.lock import RunLock
lock = RunLock(Path(sys.argv[1]), "kiln teacher-logits", field="--out", kind="store")
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("holder_alive", [True, False], ids=["running", "killed"])
def test_second_teacher_logits_writer_on_one_store(tmp_path, teacher, compile_cache, holder_alive):
    out = tmp_path / "store"
    out.mkdir()
    config = student(tmp_path, teacher, compile_cache)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=kiln_env()
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        if not holder_alive:
            holder.kill()  # kill -9: its lock file stays, the kernel drops the lock
            holder.wait()
        proc = kiln_main("teacher-logits", config, "--out", out, "--top-k", "4")
    finally:
        holder.kill()
        holder.wait()
    if holder_alive:
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = proc.stderr.splitlines()
        assert line.startswith(
            f"kiln: error: --out: the store directory {out} is in use by pid {holder.pid} on host "
            f"{socket.gethostname()} (`kiln teacher-logits`, since "
        )
        assert line.endswith(
            f"one process writes a store at a time (its lock: {out}/kiln.lock); wait for it to "
            "end, stop it, or use another --out"
        )
        assert sorted(p.name for p in out.iterdir()) == ["kiln.lock"]  # the holder's, untouched
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"took over the stale lock of pid {holder.pid}" in proc.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "manifest.json" and len(names) == 2 and shard_complete(out / names[1])


# ---------------------------------------------------------------------------------------------
# Malformed URLs: refused at validation, naming the field and what is allowed


@pytest.mark.parametrize(
    "args, line",
    [
        (("train.output_dir=file://relative/runs",),
         "train.output_dir: got 'file://relative/runs'; a file:// URL takes an absolute path "
         f"(file:///...), but 'relative' stands where its host would be; {ALLOWED_URLS}"),
        (("train.output_dir=://x",),
         f"train.output_dir: got '://x'; no URL scheme before '://'; {ALLOWED_URLS}"),
        (("train.output_dir=nosuch://bucket/runs",),
         "train.output_dir: got 'nosuch://bucket/runs'; fsspec knows no URL scheme nosuch://; "
         f"{ALLOWED_URLS}"),
        (("train.output_dir=gs://",),
         f"train.output_dir: got 'gs://'; the gs:// URL names no path after its scheme; {ALLOWED_URLS}"),
        (("data.paths=://x",),
         f"data.paths: got '://x'; '://x': no URL scheme before '://'; {ALLOWED_URLS}"),
        (("data.eval_paths=[file://host/held.txt]",),
         "data.eval_paths: got ['file://host/held.txt']; 'file://host/held.txt': a file:// URL "
         f"takes an absolute path (file:///...), but 'host' stands where its host would be; {ALLOWED_URLS}"),
        (("data.cache_dir=file://",),
         "data.cache_dir: got 'file://'; the file:// URL names no path; allowed: a local path "
         "or file:///absolute/path"),
        (("train.mirror_dir=1x://m",),
         "train.mirror_dir: got '1x://m'; '1x' before '://' is not a URL scheme; allowed: a "
         "local path or file:///absolute/path"),
        (("checkpoint.load_params_from=memory://",),
         "checkpoint.load_params_from: got 'memory://'; the memory:// URL names no path after "
         f"its scheme; {ALLOWED_URLS}"),
        (("distillation.teacher_run_dir=://teacher",),
         f"distillation.teacher_run_dir: got '://teacher'; no URL scheme before '://'; {ALLOWED_URLS}"),
        (("train.eval_tasks=[perplexity:://x]",),
         "train.eval_tasks: got ['perplexity:://x']; 'perplexity:://x': no URL scheme before "
         f"'://'; {ALLOWED_URLS}"),
        (("--output", "://x"), f"--output: '://x': no URL scheme before '://'; {ALLOWED_URLS}"),
        (("--input", "file://relative/in.txt"),
         "--input: 'file://relative/in.txt': a file:// URL takes an absolute path (file:///...), "
         f"but 'relative' stands where its host would be; {ALLOWED_URLS}"),
    ],
)  # fmt: skip
def test_malformed_urls_are_refused_naming_the_field(tmp_path, args, line):
    inputs = text_inputs(tmp_path)
    if args[0].startswith("--"):  # kiln prepare's options
        given = {"--input": str(inputs), "--output": str(tmp_path / "out"), args[0]: args[1]}
        args = ("prepare", "--format", "text", *(x for kv in given.items() for x in kv))
    else:
        config = write_config(
            tmp_path / "c.yaml",
            model=MODEL,
            data={"source": "text", "paths": [str(inputs)], "seq_len": SEQ},
        )
        args = ("train", config, *args)
    before = sorted(tmp_path.rglob("*"))
    proc = kiln_main(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"kiln: error: {line}"]
    assert sorted(tmp_path.rglob("*")) == before


# ---------------------------------------------------------------------------------------------
# A first batch that cannot be trained on (data.verify_shards: false): nothing written


@pytest.fixture
def bad_shards(tmp_path) -> Path:
    """Prepared shards whose every token is 4000, beyond model.vocab_size (384), while their
    manifest records the ids they were written with (so only a batch shows it)."""
    out = tmp_path / "shards"
    prepare(sorted(text_inputs(tmp_path).iterdir()), "text", "text", load_tokenizer("byte"), out)
    shard = out / "shard-00000.bin"
    np.full(shard.stat().st_size // 2, 4000, np.uint16).tofile(shard)
    return out


@pytest.mark.parametrize("command", ["train", "teacher-logits"])
def test_a_bad_first_batch_is_refused_before_anything_is_written(
    tmp_path, teacher, compile_cache, bad_shards, command
):
    data = {"source": "tokens", "paths": [str(bad_shards)], "verify_shards": False}
    config = student(tmp_path, teacher, compile_cache, **data)
    out = tmp_path / ("runs" if command == "train" else "store")
    args = ("train", config) if command == "train" else ("teacher-logits", config, "--out", out)
    proc = kiln_main(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors(proc) == [
        f"kiln: error: {bad_shards}/shard-00000.bin: holds token id 4000, but model.vocab_size "
        "is 384; allowed: ids below it (the shard is damaged or was prepared for another "
        "vocabulary; re-run kiln prepare with data.tokenizer)"
    ]
    assert not out.exists()  # no run directory (config.yaml, inputs.json, metrics), no store


# ---------------------------------------------------------------------------------------------
# A damaged tokenized cache (data.cache_dir): rebuilt from the inputs, with a warning


def _flip_a_byte(cache: Path) -> str:
    shard = cache / "shard-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[4] ^= 0x01
    shard.write_bytes(bytes(raw))
    return f"{shard}: its bytes do not match the CRC-32 in {cache}/manifest.json"


def _truncate(cache: Path) -> str:
    shard = cache / "shard-00000.bin"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size - 2])
    return f"{shard}: {size - 2} bytes, the manifest says {size}"


def _garble_manifest(cache: Path) -> str:
    (cache / "manifest.json").write_text('{"version": 1, "tok')
    return f"data.cache_dir {cache}: its manifest.json is unreadable or not JSON"


def _remove_manifest(cache: Path) -> str:
    (cache / "manifest.json").unlink()
    return f"{cache}: no manifest.json"


def _remove_idx(cache: Path) -> str:
    (cache / "shard-00000.idx").unlink()
    return f"cannot read {cache}/shard-00000.idx: No such file or directory"


@pytest.mark.parametrize(
    "damage", [_flip_a_byte, _truncate, _garble_manifest, _remove_manifest, _remove_idx]
)
def test_a_damaged_cache_is_rebuilt_from_the_inputs(tmp_path, damage):
    inputs = text_inputs(tmp_path)
    config = make_config(
        model=MODEL, data={"source": "text", "paths": [str(inputs)], "seq_len": SEQ,
                           "cache_dir": str(tmp_path / "cache")},
        train={"global_batch_size": BATCH},
    )  # fmt: skip
    first = make_datasets(config)
    (cache,) = (tmp_path / "cache").iterdir()
    shards = {p.name: p.read_bytes() for p in cache.iterdir() if p.name != "manifest.json"}
    threads = set(threading.enumerate())
    iterator = first.train_iterator()
    want = next(iterator)
    # The read-ahead threads stopped first: one still reading the memory-mapped shard while
    # the damage truncates it would die of SIGBUS, and the test process with it.
    iterator.close()
    for thread in set(threading.enumerate()) - threads:
        thread.join(timeout=60)
    reason = damage(cache)
    again = make_datasets(config)
    assert again.warnings == [
        f"data.cache_dir: {cache} was damaged ({reason}); rebuilt it from data.paths"
    ]
    assert os.listdir(tmp_path / "cache") == [cache.name]  # nothing set aside or staged is left
    assert {p.name: p.read_bytes() for p in cache.iterdir() if p.name != "manifest.json"} == shards
    got = next(again.train_iterator())
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
