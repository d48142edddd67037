"""Data throughput: `kiln prepare` MB/s per core, pipeline tokens/s against the trainer's; JSON.

1. prepare: the running Python's standard-library .py files, tokenized with the byte
   tokenizer and with a BPE tokenizer.json trained here (on the top-level modules), with
   one worker and with every core. `mb_per_cpu_second` (MB of input per second of CPU time,
   workers and native tokenizer threads included) is the per-core figure: one worker of
   the `tokenizers` library already runs on every core through its own threads.
2. pipeline: batches/s of `Datasets.train_iterator()` for configs/tiny.yaml (the stdlib
   corpus), the same at seq_len 512 / batch 8, the synthetic Markov source, and a 3-source
   mixture (data.sources: the stdlib's .py, .decTest and .txt files, weights 0.6/0.25/0.15);
   first-use tokenization time of the stdlib cache included.
   corpus), the same at seq_len 512 / batch 8, the synthetic Markov source, and the chat
   set of configs/sft_tiny.yaml (chat template and loss weights); first-use tokenization
   time of each cache included.
   `*_per_cpu_second` figures divide by CPU time instead, which stays put when other jobs
   share the machine.
3. trainer: tokens/s of the jitted train step of the same configs on the default devices
   (`trainer_tokens_per_s`), and `pipeline_over_trainer` = pipeline / trainer (target >= 20).

Prepare runs first, before anything loads JAX, so that it uses worker processes as
`kiln prepare` does.

    nice python benchmarks/data_pipeline.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "tiny": [],
    "seq512_batch8": ["data.seq_len=512", "model.max_seq_len=512", "train.global_batch_size=8"],
    "synthetic_markov_tiny": ["data.source=synthetic", "data.synthetic_kind=markov"],
    # configs/sft_tiny.yaml's data: chat records rendered and weighted on first use.
    "chat_sft_tiny": [
        "data.source=jsonl",
        "data.format=chat",
        "data.paths=[kiln:stdlib_chat.jsonl]",
        "data.seq_len=256",
        "train.global_batch_size=16",
    ],
}
# configs/tiny.yaml with data.sources in place of its one source: two parts of the stdlib and
# the chat set of configs/sft_tiny.yaml (rendered and weighted on first use).
MIXTURE = {
    "mixture3_tiny": [
        {"name": "code", "source": "text", "paths": ["stdlib:**/*.py"], "weight": 0.6},
        {"name": "prose", "source": "text", "paths": ["stdlib:**/*.txt"], "weight": 0.15},
        {
            "name": "chat",
            "source": "jsonl",
            "format": "chat",
            "paths": ["kiln:stdlib_chat.jsonl"],
            "weight": 0.25,
        },
    ]
}


def bench_prepare(tmp: Path, repeats: int) -> dict:
    """MB/s per worker of prepare on the stdlib, byte and BPE tokenizers, 1 and all workers."""
    from kiln.data.prepare import prepare
    from kiln.data.sources import default_workers, resolve_inputs
    from kiln.data.tokenizers import load_tokenizer

    files = resolve_inputs(["stdlib:**/*.py"])
    top = resolve_inputs(["stdlib:*.py"])
    bpe = train_bpe(top, tmp / "bpe.json")
    cores = default_workers()
    out: dict = {"cores": cores}
    for name, spec, inputs in (("byte", "byte", files), ("bpe_tokenizer_json", str(bpe), top)):
        tok = load_tokenizer(spec)
        for workers in sorted({1, cores}):
            times, cpu = [], []
            for r in range(repeats):
                target = tmp / f"{name}-{workers}-{r}"
                start, cpu_start = time.perf_counter(), cpu_seconds()
                manifest, _ = prepare(inputs, "text", "text", tok, target, workers=workers)
                times.append(time.perf_counter() - start)
                cpu.append(cpu_seconds() - cpu_start)
            mb = manifest["num_input_bytes"] / 1e6
            used = manifest["workers"]
            out[f"{name}_workers{used}"] = {
                "input_mb": round(mb, 2),
                "seconds": round(statistics.median(times), 3),
                "mb_per_s": round(mb / statistics.median(times), 2),
                "mb_per_s_per_worker": round(mb / statistics.median(times) / used, 2),
                "mb_per_cpu_second": round(mb / statistics.median(cpu), 2),
            }
    return out


def cpu_seconds() -> float:
    """CPU time of this process, its threads and its finished worker processes: unlike wall
    time, it does not grow when other jobs share the cores."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def train_bpe(files: list[Path], path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.read_text(errors="replace") for f in files[:60]), trainer)
    tok.save(str(path))
    return path


def bench_pipeline(config, batches: int) -> dict:
    from kiln.data import make_datasets

    start = time.perf_counter()
    ds = make_datasets(config)
    first_use = time.perf_counter() - start
    it = ds.train_iterator()
    next(it)  # thread start-up and the first fill of the prefetch buffer
    start, cpu_start = time.perf_counter(), cpu_seconds()
    for _ in range(batches):
        batch = next(it)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    tokens = batches * batch["inputs"].size
    return {
        "make_datasets_seconds": round(first_use, 3),
        "pipeline_tokens_per_s": round(tokens / seconds),
        "pipeline_tokens_per_cpu_second": round(tokens / cpu),
        "pipeline_batches_per_s": round(batches / seconds, 1),
    }


def bench_trainer(config, steps: int) -> dict:
    """Tokens/s of the jitted train step on one fixed batch, after compilation."""
    import jax

    from kiln.data import make_datasets
    from kiln.parallel.mesh import make_mesh
    from kiln.training.batches import place_batch
    from kiln.training.train import init_state, make_train_step, shardings_of

    mesh = make_mesh(config)
    state = init_state(config, mesh)
    step = make_train_step(config, mesh, shardings_of(state))
    batch = place_batch(next(make_datasets(config).train_iterator()), mesh, config)
    for _ in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    tokens = steps * config.train.global_batch_size * config.data.seq_len
    return {"trainer_tokens_per_s": round(tokens / seconds), "devices": jax.device_count()}


def with_sources(config, sources: list[dict]):
    """`config` with data.sources in place of its single source (whose fields go back to
    their defaults: setting both is refused)."""
    from kiln.config import config_from_dict
    from kiln.config.schema.data import PER_SOURCE

    raw = config.model_dump(mode="json")
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in PER_SOURCE}
    raw["data"]["sources"] = sources
    return config_from_dict(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300, help="pipeline batches timed")
    parser.add_argument("--steps", type=int, default=10, help="train steps timed")
    parser.add_argument("--repeats", type=int, default=3, help="prepare runs (median)")
    parser.add_argument("--no-trainer", action="store_true", help="skip the train-step timing")
    a = parser.parse_args()

    from kiln.config import load_config

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        result: dict = {"python": platform.python_version(), "machine": platform.machine()}
        result["prepare"] = bench_prepare(tmp, a.repeats)
        result["pipeline"] = {}
        for name in (*CONFIGS, *MIXTURE):
            config = load_config(
                REPO / "configs/tiny.yaml",
                [
                    *CONFIGS.get(name, []),
                    f"data.cache_dir={tmp / 'cache'}",
                    f"train.output_dir={tmp}",
                ],
            )
            if name in MIXTURE:
                config = with_sources(config, MIXTURE[name])
            row = {
                "seq_len": config.data.seq_len,
                "global_batch_size": config.train.global_batch_size,
                **bench_pipeline(config, a.batches),
            }
            if not a.no_trainer:
                row.update(bench_trainer(config, a.steps))
                row["pipeline_over_trainer"] = round(
                    row["pipeline_tokens_per_s"] / row["trainer_tokens_per_s"], 1
                )
            result["pipeline"][name] = row
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
