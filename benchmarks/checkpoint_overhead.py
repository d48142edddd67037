"""What checkpoints cost a run: step time with async saves every 5 steps vs none, and
save/restore seconds per GB of train state, with the cost of the checksum manifest at save and
its verification at restore. Prints JSON.

    python benchmarks/checkpoint_overhead.py [--steps 30] [--every 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import jax

from kiln.config import CheckpointConfig, config_from_dict
from kiln.runs.checkpoint import Checkpointer
from kiln.runs.restore import abstract_like, restore
from kiln.training import train
from kiln.training.batches import place_batch
from kiln.training.loop import checkpoint_tree
from kiln.util import checksums
from step_throughput import make_batch  # a sibling script: benchmarks/ is on sys.path

SEQ, BATCH = 256, 4


def make_config():
    return config_from_dict(
        {
            "model": {"vocab_size": 8192, "d_model": 512, "num_layers": 4, "num_heads": 8, "d_ff": 1408, "max_seq_len": SEQ},
            "data": {"seq_len": SEQ},
            "mesh": {"fsdp": -1},
            "optim": {"schedule": "constant", "warmup_steps": 0},
            "train": {"global_batch_size": BATCH, "steps": 10_000},
        }
    )  # fmt: skip


def run_steps(step_fn, state, batch, steps, ckpt=None, every=0, blocking=None):
    """Per-step wall times as a training loop sees them (metrics fetched each step)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        step = int(state.step)
        if ckpt is not None and step % every == 0:
            t_save = time.perf_counter()
            ckpt.save(step, checkpoint_tree(state), {"next_index": step})
            blocking.append(time.perf_counter() - t_save)
        times.append(time.perf_counter() - t0)
    if ckpt is not None:
        ckpt.wait()
    return state, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()

    config = make_config()
    state = train.init_state(config)
    mesh = jax.tree.leaves(state.params)[0].sharding.mesh
    step_fn = train.make_train_step(config, mesh, train.shardings_of(state))
    batch = place_batch(make_batch(BATCH, SEQ, 8192), mesh, config)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(checkpoint_tree(state)))

    state, _ = run_steps(step_fn, state, batch, 2)  # compile
    with tempfile.TemporaryDirectory() as tmp:
        async_ckpt = Checkpointer(Path(tmp) / "async", CheckpointConfig(keep=2, async_save=True))
        # Alternate the two conditions so both see the same machine load.
        plain, saving, blocking = [], [], []
        for _ in range(2):
            state, t = run_steps(step_fn, state, batch, args.steps // 2)
            plain += t
            state, t = run_steps(
                step_fn, state, batch, args.steps // 2, async_ckpt, args.every, blocking
            )
            saving += t
        async_ckpt.close()

        sync_ckpt = Checkpointer(Path(tmp) / "sync", CheckpointConfig(keep=1, async_save=False))
        t0 = time.perf_counter()
        sync_ckpt.save(int(state.step), checkpoint_tree(state), {"next_index": 0})
        sync_ckpt.wait()
        save_s = time.perf_counter() - t0
        sync_ckpt.close()
        directory = Path(tmp) / "sync" / "checkpoints"
        step_dir = directory / str(int(state.step))
        files_gb = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()) / 1e9
        # The manifest again (the save above wrote it once): its cost alone, and the check.
        t0 = time.perf_counter()
        checksums.write_manifest(step_dir)
        manifest_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        checksums.verify(step_dir)
        verify_s = time.perf_counter() - t0
        restore_s = {}
        for verify in (False, True, False, True):  # alternated: both see the same page cache
            t0 = time.perf_counter()
            restored, _ = restore(
                directory, int(state.step), abstract_like(checkpoint_tree(state)), checksums=verify
            )
            jax.block_until_ready(restored)
            restore_s.setdefault(verify, []).append(time.perf_counter() - t0)

    # Checksums of 256 MB in memory, one core: the rate the manifest could reach without disks.
    block = os.urandom(256 << 20)
    rates = {}
    for name, fn in (("crc32", zlib.crc32), ("blake2b", lambda b: hashlib.blake2b(b).digest())):
        t0 = time.perf_counter()
        fn(block)
        rates[f"{name}_gb_per_second"] = round(len(block) / (time.perf_counter() - t0) / 1e9, 2)

    gb = state_bytes / 1e9
    plain_s, saving_s = statistics.median(plain), statistics.median(saving)
    print(
        json.dumps(
            {
                "benchmark": "checkpoint_overhead",
                "state_gb": round(gb, 4),
                "steps_each": len(plain),
                "save_every_steps": args.every,
                "median_step_seconds_no_saves": round(plain_s, 4),
                "median_step_seconds_async_saves": round(saving_s, 4),
                "mean_step_seconds_no_saves": round(statistics.mean(plain), 4),
                "mean_step_seconds_async_saves": round(statistics.mean(saving), 4),
                "median_ratio": round(saving_s / plain_s, 4),
                "mean_ratio": round(statistics.mean(saving) / statistics.mean(plain), 4),
                "async_save_call_blocking_seconds": round(statistics.median(blocking), 4),
                "checkpoint_files_gb": round(files_gb, 4),
                "save_seconds_per_gb": round(save_s / gb, 3),
                "of_which_manifest_seconds_per_gb": round(manifest_s / files_gb, 3),
                "restore_seconds_per_gb_no_checksums": round(min(restore_s[False]) / gb, 3),
                "restore_seconds_per_gb": round(min(restore_s[True]) / gb, 3),
                "of_which_verify_seconds_per_gb": round(verify_s / files_gb, 3),
                **rates,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
