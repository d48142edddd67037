"""Pipeline stages, measured: the CPU step time of a 4-stage pipeline against the same model
without stages and its bubble against (S-1)/(R·M+S-1); Llama-3-70B compiled ahead of time for a
TPU v5p slice in pipeline stages by kiln and by MaxText, side by side. Prints JSON.

--cpu: a small llama (8 layers, d 128, 4/2 heads, SwiGLU 384, vocab 512, seq 64, float32, no
remat) on 8 simulated CPU devices, in this process. (1) One global batch (128 sequences) trained
without stages (fsdp 8, and fsdp 8 with the batch in M accumulation micro-batches) and in 4
stages x fsdp 2 with M = 4, 8, 16 pipeline micro-batches; (2) the bubble: micro-batches of a
fixed 8 sequences, M = 4, 8, 12, 16 (global batch 8·M), stages 4 with repeats 1 and 2; each
pipelined step's time is fitted as a·(R·M + S - 1) + b (a: one iteration, b: the embedding,
loss and update around the stack) and its idle share a·(S-1) / t is set against the formula;
beside it, 1 - t(no stages, accumulation M) / t(stages), the share of the pipelined step that
the same micro-batches without stages do not spend. Every variant is compiled once and run one
step; then rounds alternate all of them; medians of the timed steps. CPU-only figures: the 8
simulated devices share this machine's cores, so a stage in its bubble still computes (on
zeros) and its time is not idle time as on a TPU.

--aot: `kiln compile configs/models/llama3-70b.yaml --topology v5p-128 --json` (4 stages x
fsdp 16, 64 sequences of 8192 tokens, 4 micro-batches) against MaxText's `train_compile` of its
llama3-70b at ici_pipeline_parallelism=4 x ici_fsdp_parallelism=16, the same micro-batches,
repeats (num_layers_per_pipeline_stage = 80 / (4·R)), per-device batch, sequence, precision,
vocabulary tiling, z-loss and splash blocks; kiln at --kiln-remat, MaxText at each of
--maxtext-remat (its best that fits is the reference): the compilers' peaks, collectives (static
bytes and a lower bound per step, kiln's HLO parser on both) and compile seconds, one compile at
a time.

    nice python benchmarks/pipeline.py --cpu [--rounds 3] [--steps 3]
    nice python benchmarks/pipeline.py --aot --maxtext WORK [--topology v5p-128] [--fsdp 16] \\
        [--microbatches 4] [--repeats 1] [--per-device-batch 1] [--kiln-remat full] \\
        [--maxtext-remat full save_out_proj minimal]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--cpu" in sys.argv:  # before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from kiln.config import config_from_dict
from kiln.parallel.pipeline import Schedule
from kiln.training import train
from kiln.training.batches import place_batch

sys.path.insert(0, str(Path(__file__).parent))
import vs_maxtext as vs

STAGES = 4
CPU_MODEL = {
    "vocab_size": 512,
    "d_model": 128,
    "num_layers": 8,
    "num_heads": 4,
    "num_kv_heads": 2,
    "d_ff": 384,
    "max_seq_len": 64,
    "dtype": "float32",
    "remat": "none",
}
CPU_SEQ, CPU_BATCH, CPU_MICRO = 64, 128, 8


def med(xs):
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------
# --cpu


class Variant:
    """kiln's jitted train step for one mesh and schedule, on a fixed random batch."""

    def __init__(self, batch: int, mesh: dict, accum: int, pipe: dict):
        config = config_from_dict(
            {
                "model": CPU_MODEL,
                "data": {"seq_len": CPU_SEQ},
                "train": {"global_batch_size": batch, "gradient_accumulation_steps": accum},
                "optim": {"warmup_steps": 0},
                "mesh": {"fsdp": -1, **mesh},
                "pipeline": pipe,
            }
        )
        self.state = train.init_state(config)
        mesh = jax.tree.leaves(self.state.params)[0].sharding.mesh
        self.step = train.make_train_step(config, mesh, train.shardings_of(self.state))
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, CPU_MODEL["vocab_size"], (batch, CPU_SEQ + 1), dtype=np.int32)
        host = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.broadcast_to(np.arange(CPU_SEQ, dtype=np.int32), (batch, CPU_SEQ)),
            "segment_ids": np.ones((batch, CPU_SEQ), np.int32),
            "weights": np.ones((batch, CPU_SEQ), np.float32),
        }
        self.batch = place_batch(host, mesh, config)

    def steps(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready(metrics["learning/loss"])
            times.append(time.perf_counter() - t0)
        return times


def cpu_variants() -> dict[str, tuple[int, dict, int, dict]]:
    """name -> (global batch, mesh, accumulation, pipeline section)."""
    pipe = {"stage": STAGES, "fsdp": 2}
    out = {"flat": (CPU_BATCH, {"fsdp": 8}, 1, {})}
    for m in (4, 8, 16):
        out[f"flat_accum{m}"] = (CPU_BATCH, {"fsdp": 8}, m, {})
        out[f"stages4_m{m}"] = (CPU_BATCH, pipe, m, {})
    for m in (4, 8, 12, 16):  # fixed micro-batches of CPU_MICRO sequences
        b = CPU_MICRO * m
        out[f"fixed_flat_accum{m}"] = (b, {"fsdp": 8}, m, {})
        for r in (1, 2):
            out[f"fixed_stages4_r{r}_m{m}"] = (b, pipe, m, {"repeats": r})
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = a·x + b over (x, t)."""
    x, t = np.array(points, dtype=float).T
    a, b = np.polyfit(x, t, 1)
    return float(a), float(b)


def run_cpu(rounds: int, steps: int) -> dict:
    specs = cpu_variants()
    variants, setup = {}, {}
    for name, spec in specs.items():  # one compile at a time
        t0 = time.perf_counter()
        variants[name] = Variant(*spec)
        variants[name].steps(1)
        setup[name] = round(time.perf_counter() - t0, 2)
    times = {name: [] for name in specs}
    for _ in range(rounds):
        for name, v in variants.items():
            times[name] += v.steps(steps)
    t = {name: med(x) for name, x in times.items()}

    same_batch = {
        "what": f"{CPU_BATCH} sequences of {CPU_SEQ} a step; no stages (fsdp 8) against 4 "
        "stages x fsdp 2 with M pipeline micro-batches (and no stages with the batch in M "
        "accumulation micro-batches)",
        "flat_seconds": round(t["flat"], 4),
        "by_microbatches": {
            m: {
                "stages4_seconds": round(t[f"stages4_m{m}"], 4),
                "flat_accum_seconds": round(t[f"flat_accum{m}"], 4),
                "stages4_over_flat": round(t[f"stages4_m{m}"] / t["flat"], 3),
                "stages4_over_flat_accum": round(t[f"stages4_m{m}"] / t[f"flat_accum{m}"], 3),
                "bubble_formula": round(Schedule(STAGES, 1, m).bubble, 4),
            }
            for m in (4, 8, 16)
        },
    }
    bubble = {}
    for r in (1, 2):
        ms = (4, 8, 12, 16)
        points = [(Schedule(STAGES, r, m).iterations, t[f"fixed_stages4_r{r}_m{m}"]) for m in ms]
        a, b = fit(points)
        rows = {}
        for m in ms:
            piped, flat = t[f"fixed_stages4_r{r}_m{m}"], t[f"fixed_flat_accum{m}"]
            rows[m] = {
                "iterations": Schedule(STAGES, r, m).iterations,
                "stages4_seconds": round(piped, 4),
                "fit_seconds": round(a * Schedule(STAGES, r, m).iterations + b, 4),
                "flat_accum_seconds": round(flat, 4),
                "bubble_formula": round(Schedule(STAGES, r, m).bubble, 4),
                "idle_share_from_fit": round(a * (STAGES - 1) / piped, 4),
                "share_not_spent_without_stages": round(1 - flat / piped, 4),
            }
        bubble[f"repeats_{r}"] = {
            "fit": {"a_seconds_per_iteration": round(a, 5), "b_seconds": round(b, 5)},
            "by_microbatches": rows,
        }
    return {
        "figures": "CPU only (XLA:CPU, float32, 8 simulated devices sharing the host's cores); "
        "says nothing about TPU or GPU step times",
        "device": f"{jax.devices()[0].platform} x {jax.device_count()}, {os.cpu_count()} host cores",
        "model": CPU_MODEL,
        "timing": f"each variant compiled and run one step, then {rounds} rounds of {steps} "
        f"steps of every variant in turn; medians of the {rounds * steps} timed steps",
        "same_batch": same_batch,
        "bubble": {
            "what": f"micro-batches of {CPU_MICRO} sequences, global batch {CPU_MICRO}·M; "
            "t = a·(R·M + S - 1) + b fitted over M = 4, 8, 12, 16; idle share a·(S-1)/t "
            "against the formula (S-1)/(R·M+S-1)",
            **bubble,
        },
        "step_seconds": {n: round(v, 4) for n, v in t.items()},
        "compile_and_step1_seconds": setup,
    }


# ---------------------------------------------------------------------------------------------
# --aot

MT_70B = [
    "compile_topology_num_slices=1", "model_name=llama3-70b", "max_target_length=8192",
    "dtype=bfloat16", "weight_dtype=float32", "attention=flash", "num_vocab_tiling=4",
    "z_loss_multiplier=1e-4",
    *(f"sa_block_{b}=512" for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv",
                                    "kv_dkv_compute", "q_dq", "kv_dq")),
    "dataset_type=synthetic", "enable_checkpointing=false", "run_name=aot", "jax_cache_dir=",
]  # fmt: skip
CONFIG_70B = "configs/models/llama3-70b.yaml"
LAYERS_70B = 80


def permute_and_total(r: dict) -> dict:
    """The collective-permute and all collectives' GB, static and (at least) per step."""
    kinds = ("collective-permute", "reduce-scatter", "all-to-all", "ragged-all-to-all")
    kinds += ("all-gather", "all-reduce")
    out = {}
    for key, suffix in (("gb", ""), ("gb_per_step_at_least", "_per_step_at_least")):
        figures = None if r.get("out_of_memory") else [r[k][key] for k in kinds]
        known = figures is not None and None not in figures
        out[f"collective_permute_gb{suffix}"] = figures[0] if known else None
        out[f"total_collective_gb{suffix}"] = round(sum(figures), 3) if known else None
    return out


def run_aot(work: Path, args, tmp: Path) -> dict:
    devices = int(args.topology.split("-")[1]) // 2  # v5p-N: N TensorCores, two per chip
    stages, fsdp, m, r = STAGES, args.fsdp, args.microbatches, args.repeats
    if stages * fsdp != devices:
        raise SystemExit(f"--fsdp {fsdp}: {stages} stages x {fsdp} != {devices} chips")
    batch = args.per_device_batch * devices
    kiln_common = [
        f"mesh.stage={stages}",
        f"mesh.fsdp={fsdp}",
        f"train.global_batch_size={batch}",
        f"train.gradient_accumulation_steps={m}",
        f"pipeline.repeats={r}",
    ]
    mt_common = [
        *MT_70B,
        f"compile_topology={args.topology}",
        f"ici_pipeline_parallelism={stages}",
        f"ici_fsdp_parallelism={fsdp}",
        f"per_device_batch_size={args.per_device_batch}",
        f"num_pipeline_microbatches={m}",
        f"num_layers_per_pipeline_stage={LAYERS_70B // (stages * r)}",
    ]
    kiln, maxtext = {}, {}
    for remat in args.kiln_remat:
        overrides = [*kiln_common, f"model.remat={remat}"]
        kiln[remat] = vs.kiln_compile(
            overrides, tmp / f"kiln_{remat}.log", CONFIG_70B, args.topology
        )
        kiln[remat].update(permute_and_total(kiln[remat]))
    for remat in args.maxtext_remat:
        maxtext[remat] = vs.maxtext_compile(
            work, [f"remat_policy={remat}"], tmp / f"maxtext_{remat}.log", tmp / "hlo", mt_common
        )
        maxtext[remat].update(permute_and_total(maxtext[remat]))

    def peak(x):
        return x["compiler_peak_gb"] if x["compiler_peak_gb"] is not None else float("inf")

    fits = {k: v for k, v in maxtext.items() if peak(v) <= args.hbm_gb}
    best = min(fits, key=lambda k: peak(fits[k])) if fits else None
    targets = {}
    if best is not None:
        ref = maxtext[best]
        for remat, k in kiln.items():
            if k.get("out_of_memory"):
                targets[remat] = {"fits": False}
                continue
            targets[remat] = {
                "fits": peak(k) <= args.hbm_gb,
                "peak_le_maxtext": peak(k) <= peak(ref),
                "collective_permute_le_maxtext": k["collective_permute_gb"]
                <= ref["collective_permute_gb"],
                "total_collectives_le_maxtext": k["total_collective_gb"]
                <= ref["total_collective_gb"],
                "total_collectives_per_step_at_least_le_maxtext": None
                if None
                in (
                    k["total_collective_gb_per_step_at_least"],
                    ref["total_collective_gb_per_step_at_least"],
                )
                else k["total_collective_gb_per_step_at_least"]
                <= ref["total_collective_gb_per_step_at_least"],
                "compile_wall_le_maxtext": k["wall_seconds"] <= ref["wall_seconds"],
            }
    return {
        "target": f"TPU {args.topology} ({devices} chips: {stages} stages x fsdp {fsdp}), "
        f"compiled by libtpu without a TPU; Llama-3-70B, {batch} sequences of 8192 tokens a step "
        f"({args.per_device_batch} per chip), {m} pipeline micro-batches, {r} repeat(s), bf16 "
        "compute, f32 weights, tiling 4, z-loss 1e-4, splash 512 blocks; memory per device in "
        "GB (1e9 bytes), the compiler's peak_memory_in_bytes; collectives static (an op inside "
        "a loop counted once) and per step at least (loops of a trip count the HLO does not "
        "give taken once), both HLOs read by kiln.commands.hlo.collective_summary; compile "
        "seconds: wall time of each whole process (start-up, lowering, compile; MaxText also "
        "dumps its HLO)",
        "schedule": Schedule(stages, r, m)._asdict() | {"bubble": Schedule(stages, r, m).bubble},
        "kiln_overrides": kiln_common,
        "maxtext_flags": mt_common,
        "kiln": kiln,
        "maxtext": maxtext,
        "maxtext_best_that_fits": best,
        "targets_against_maxtext_best": targets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU step time and bubble")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--aot", action="store_true", help="Llama-3-70B AOT, kiln vs MaxText")
    parser.add_argument("--maxtext", type=Path, default=None, help="MaxText WORK dir (src, venv)")
    parser.add_argument("--topology", default="v5p-128")
    parser.add_argument("--fsdp", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--per-device-batch", type=int, default=1)
    parser.add_argument("--hbm-gb", type=float, default=95.0)
    parser.add_argument("--kiln-remat", nargs="*", default=["full"])
    parser.add_argument("--maxtext-remat", nargs="*", default=["full"])
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and HLO here")
    args = parser.parse_args()
    out = {"benchmark": "pipeline", "kiln_jax": jax.__version__}
    if args.cpu:
        jax.config.update("jax_enable_compilation_cache", False)
        out["cpu"] = run_cpu(args.rounds, args.steps)
    if args.aot:
        if args.maxtext is None:
            out["aot"] = {"skipped": "no --maxtext WORK given"}
        else:
            work = args.maxtext.resolve()
            commit = subprocess.run(
                ["git", "-C", str(work / "src"), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            tmp = Path(tempfile.mkdtemp(prefix="pipeline_")) if args.keep is None else args.keep
            tmp.mkdir(parents=True, exist_ok=True)
            out["maxtext_commit"] = commit
            out["aot"] = run_aot(work, args, tmp)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
