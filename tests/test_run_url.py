"""train.output_dir as a URL (fsspec's in-memory filesystem stands in for gs:// or s3://): the
run works in a local mirror, uploaded after each checkpoint and at the end, manifests last."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from conftest import MEMORY, assert_user_error, kiln_main, make_config, write_config
from kiln.errors import KilnError
from kiln.runs import sync as run_sync
from kiln.util import storage


def remote_files(root: str) -> dict[str, bytes]:
    return {h[len(root) + 1 :]: MEMORY.cat_file(h) for h in MEMORY.find(root)}


def write_mirror(local: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)


RUN = {
    "checkpoints/2/state/a": b"a2",
    "checkpoints/2/kiln_manifest.json": b"m2",
    "checkpoints/4/data/metadata": b"{}",
    "checkpoints/4/state/a": b"a4",
    "checkpoints/4/kiln_manifest.json": b"m4",
    "config.yaml": b"model: {}\n",
    "metrics.jsonl": b"{}\n",
    "tensorboard/events.out": b"e",
}


def test_uploads_put_each_manifest_last_and_a_cut_upload_is_not_fetched(tmp_path, mem, monkeypatch):
    local = tmp_path / "mirror" / "run"
    write_mirror(local, {**RUN, "kiln.lock": b"", "checkpoints/6.orbax-checkpoint-tmp-1/x": b"t"})
    write_mirror(local, {"damaged-checkpoints/3/x": b"d", "checkpoints/6/state/a": b"no manifest"})
    url = f"memory://{mem}/runs/run"
    sent, real = [], storage.upload

    def upload(src, dest, what):
        sent.append(dest.removeprefix(url + "/"))
        real(src, dest, what)

    monkeypatch.setattr(storage, "upload", upload)
    sync = run_sync.RunSync(url, local)
    sync.push()
    # Local-only files stay; step 6 (its save not sealed yet) waits for its manifest.
    assert remote_files(f"{mem}/runs/run") == RUN
    assert sent[:5] == list(RUN)[:5] and sorted(sent[5:]) == sorted(list(RUN)[5:])
    sync.push()  # nothing changed: nothing sent again
    assert len(sent) == len(RUN)
    (local / "metrics.jsonl").write_bytes(b"{}\n{}\n")
    sync.push()
    assert sent[len(RUN) :] == ["metrics.jsonl"]

    # An upload cut before step 8's manifest: the URL holds its files, never the step.
    write_mirror(local, {"checkpoints/8/state/a": b"a8", "checkpoints/8/kiln_manifest.json": b"m8"})

    def cut(src, dest, what):
        if dest.endswith("8/kiln_manifest.json"):
            raise KilnError(f"{what}: cannot write {dest}: connection reset")
        real(src, dest, what)

    monkeypatch.setattr(storage, "upload", cut)
    with pytest.raises(KilnError, match="connection reset"):
        sync.push()
    assert MEMORY.exists(f"{mem}/runs/run/checkpoints/8/state/a")
    fresh = tmp_path / "elsewhere" / "run"
    assert run_sync.RunSync(url, fresh).pull() == len(RUN)
    got = {p.relative_to(fresh).as_posix(): p.read_bytes() for p in fresh.rglob("*") if p.is_file()}
    assert got == {**RUN, "metrics.jsonl": b"{}\n{}\n"}

    # Old checkpoints deleted locally (checkpoint.max_to_keep) go on the URL, manifest first.
    monkeypatch.setattr(storage, "upload", real)
    shutil.rmtree(local / "checkpoints" / "2")
    removed, rm_file = [], MEMORY.rm_file
    monkeypatch.setattr(MEMORY, "rm_file", lambda path: removed.append(path) or rm_file(path))
    sync.push()
    assert removed[0].endswith("checkpoints/2/kiln_manifest.json") and len(removed) == 2
    assert MEMORY.exists(f"{mem}/runs/run/checkpoints/8/kiln_manifest.json")
    assert not MEMORY.exists(f"{mem}/runs/run/checkpoints/2/state/a")


def test_a_url_output_dir_runs_in_a_mirror(tmp_path):
    url = "memory://bucket/runs"
    config = make_config(train={"output_dir": url, "mirror_dir": str(tmp_path / "m")})
    assert config.train.output_dir == url and config.run_dir == tmp_path / "m" / "run"
    default = make_config(train={"output_dir": url + "/"}).local_output_dir
    assert default.parent == Path("~/.cache/kiln/runs").expanduser() and len(default.name) == 16


def test_a_url_whose_backend_is_missing_exits_2_writing_nothing(tmp_path):
    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed: the scheme's backend is not missing")
    cfg = write_config(
        tmp_path / "c.yaml",
        train={"output_dir": "s3://bucket/runs", "mirror_dir": str(tmp_path / "m"), "steps": 1},
    )
    proc = kiln_main("train", cfg)
    assert_user_error(proc, "train.output_dir: s3://bucket/runs needs s3fs")
    assert not (tmp_path / "m").exists()


def tiny(output_dir: str, cache: Path, steps: int, **train):
    return make_config(
        model={"vocab_size": 384, "d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "max_seq_len": 16},
        data={"source": "synthetic", "seq_len": 16, "eval_fraction": 0.0},
        mesh={"fsdp": -1},
        optim={"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 0},
        train={"output_dir": output_dir, "global_batch_size": 8, "log_every_steps": 1, "steps": steps,
               "compilation_cache_dir": str(cache), **train},
        checkpoint={"every_steps": 2},
    )  # fmt: skip


def losses(text: str) -> dict[int, float]:
    rows = map(json.loads, text.splitlines())
    return {r["step"]: r["learning/loss"] for r in rows if "learning/loss" in r}


@pytest.mark.slow
def test_a_run_at_a_url_resumes_from_it_on_another_machine(tmp_path, mem, compile_cache):
    from kiln.training import pretrain

    straight = tiny(str(tmp_path / "local"), compile_cache, steps=4)
    pretrain.run(straight)
    want = losses((straight.run_dir / "metrics.jsonl").read_text())
    url, mirror = f"memory://{mem}/runs", tmp_path / "mirror"
    pretrain.run(tiny(url, compile_cache, steps=2, mirror_dir=str(mirror)))
    on_url = remote_files(f"{mem}/runs/run")
    assert "checkpoints/2/kiln_manifest.json" in on_url and "inputs.json" in on_url
    assert sorted(losses(on_url["metrics.jsonl"].decode())) == [1, 2]
    assert any(r.startswith("tensorboard/") for r in on_url)

    shutil.rmtree(mirror)  # another machine: only the URL holds the run
    pretrain.run(tiny(url, compile_cache, steps=4, mirror_dir=str(mirror)))
    assert losses(MEMORY.cat_file(f"{mem}/runs/run/metrics.jsonl").decode()) == want  # bitwise

    # Step 4's upload cut before its manifest: a resume from the URL takes step 2, not 4.
    MEMORY.rm_file(f"{mem}/runs/run/checkpoints/4/kiln_manifest.json")
    shutil.rmtree(mirror)
    pretrain.run(tiny(url, compile_cache, steps=4, mirror_dir=str(mirror)))
    assert losses((mirror / "run" / "metrics.jsonl").read_text()) == want
    assert MEMORY.exists(f"{mem}/runs/run/checkpoints/4/kiln_manifest.json")  # saved again


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_upload_stops_the_run_in_one_line(tmp_path, async_save):
    import jax.numpy as jnp

    from kiln.config import CheckpointConfig
    from kiln.errors import RunStopped
    from kiln.runs.checkpoint import Checkpointer

    def refuse():
        raise KilnError("train.output_dir: cannot write memory://b/run/x: 403 Forbidden")

    (tmp_path / "run").mkdir()
    ckpt = Checkpointer(tmp_path / "run", CheckpointConfig(async_save=async_save))
    ckpt.after_seal = refuse
    with pytest.raises(RunStopped) as e:
        ckpt.save(1, {"w": jnp.ones(4)}, {})
        ckpt.wait()
    assert str(e.value).endswith(
        "cannot write memory://b/run/x: 403 Forbidden (last complete checkpoint: 1)"
    )
    assert "\n" not in str(e.value)
    ckpt.close()


def test_a_mirror_ahead_of_its_url_keeps_its_logs(tmp_path, mem):
    url = f"memory://{mem}/runs/run"
    for rel, data in RUN.items():
        MEMORY.pipe_file(f"{mem}/runs/run/{rel}", data)
    local = tmp_path / "mirror" / "run"
    ahead = {"checkpoints/6/state/a": b"a6", "checkpoints/6/kiln_manifest.json": b"m6"}
    write_mirror(local, {**ahead, "metrics.jsonl": b"{}\n{}\n{}\n", "config.yaml": b"x\n"})
    # Killed after sealing step 6, before uploading it: only the URL's checkpoints are fetched.
    run_sync.RunSync(url, local).pull()
    got = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert got == {
        **{k: v for k, v in RUN.items() if k.startswith("checkpoints/")},
        **ahead,
        "metrics.jsonl": b"{}\n{}\n{}\n",
        "config.yaml": b"x\n",
    }
    # Not ahead (the URL has step 4, the mirror nothing newer): the URL's files win.
    shutil.rmtree(local / "checkpoints" / "6")
    run_sync.RunSync(url, local).pull()
    assert (local / "metrics.jsonl").read_bytes() == RUN["metrics.jsonl"]
