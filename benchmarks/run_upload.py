"""What syncing a run to a URL adds to a checkpoint: seconds to upload one sealed step (kiln's
walk, stat and read of the mirror plus the store's writes) beside the seconds of the save and
seal it follows, in the same process. The store is fsspec's in-process `memory://`, so the
figure is kiln's own overhead, not a network's. Prints JSON.

    python benchmarks/run_upload.py [--mb 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path

import fsspec
import jax.numpy as jnp

from kiln.config import CheckpointConfig
from kiln.runs.checkpoint import Checkpointer
from kiln.runs.sync import RunSync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64, help="float32 megabytes of train state")
    args = parser.parse_args()
    n = args.mb * (1 << 20) // 4
    state = {"step": jnp.int32(1), "params": {"w": jnp.arange(n, dtype=jnp.float32) / n}}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        ckpt = Checkpointer(run_dir, CheckpointConfig(async_save=False))
        start = time.perf_counter()
        ckpt.save(1, state, {"position": 0})
        saved = time.perf_counter() - start
        ckpt.close()
        root = f"/kiln-bench-{uuid.uuid4().hex[:8]}"
        sync = RunSync(f"memory://{root}/run", run_dir)
        start = time.perf_counter()
        sync.push()
        pushed = time.perf_counter() - start
        start = time.perf_counter()
        sync.push()  # nothing changed: the walk and stats only
        idle = time.perf_counter() - start
        fsspec.filesystem("memory").rm(root, recursive=True)
    result = {
        "state_mb": args.mb,
        "files_uploaded": sync.uploaded,
        "save_and_seal_seconds": round(saved, 3),
        "upload_seconds_memory": round(pushed, 3),
        "upload_over_save": round(pushed / saved, 3),
        "sync_nothing_changed_seconds": round(idle, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
