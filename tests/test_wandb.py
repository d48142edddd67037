"""logging.wandb: every logged metric mirrored to Weights & Biases (offline mode, no network)."""

import json
import struct
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from kiln.cli import main
from kiln.config import config_from_dict
from kiln.training.metrics import MetricsLogger

wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK, HEADER = 32768, 7  # W&B's transaction log: LevelDB-style 32 KiB blocks, 7-byte headers
FULL, LAST = 1, 4


def history(path: Path) -> list[dict]:
    """The history rows of an offline run-*.wandb file (W&B's own record protobufs)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunk, rows = HEADER, b"", []
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:
            break
        chunk += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return rows


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))


def config(tmp_path, **wandb):
    return config_from_dict(
        {
            "train": {"steps": 20, "output_dir": str(tmp_path), "run_name": "r"},
            "logging": {"progress": False, "wandb": {"project": "kiln-test", **wandb}},
        }
    )


def test_offline_run_mirrors_every_metric_and_a_resume_continues_it(tmp_path, wandb_home):
    cfg = config(tmp_path, mode="offline")
    run_dir = cfg.run_dir
    run_dir.mkdir()
    logged = []
    for start, steps in ((0, range(1, 4)), (3, [4])):  # a run, then its resume from step 3
        logger = MetricsLogger(run_dir, cfg, enabled=True, start_step=start)
        for step in steps:
            values = {"learning/loss": 1.0 / step, "perf/tokens_per_sec": 1000.0 * step}
            logger.write(step, values)
            logged.append({"step": step, **values})
        logger.close()

    # W&B's service process writes the offline file; on a loaded machine its last records can
    # land just after finish() returns, so read until they are there.
    def segments() -> list[Path]:
        return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))

    def mirrored() -> list[dict]:
        rows = [r for p in segments() for r in history(p)]
        return [{"step": r["_step"], **{k: v for k, v in r.items() if "/" in k}} for r in rows]

    wait_until(lambda: mirrored() == logged, what="W&B's offline file to hold every row")
    runs = segments()
    assert len(runs) == 2 and len({p.name for p in runs}) == 1  # one W&B run id, two segments
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert jsonl == logged


def test_without_wandb_installed_train_exits_2_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    path = tmp_path / "c.yaml"
    path.write_text(config(tmp_path).to_yaml())
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logging.wandb" in err[0] and "kiln[wandb]" in err[0], err
    assert not (tmp_path / "r").exists()
