"""The figures the docs quote from `kiln compile` and `kiln config --summary`, measured again.

Each entry is a kiln command; its output is recorded in docs/figures.json, and `quotes()`
renders from the recorded outputs every text the pages quote. An entry too slow for the test
suite (a full-size model) has a canary recorded beside it: the same command on the model cut to
2 layers and small widths (CANARY), whose figures change when a change to kiln changes the
full-size ones. A `kiln config --summary` and a `--fit` of a full-size model are not compiled
again either: `disagreements()` checks them against the compile of the same model. The test
suite runs `--check`: a figure that went stale fails it without compiling a full-size model.

python scripts/docs_figures.py              # run every entry and canary (the full-size
                                            # compiles take minutes), rewrite the JSON and the
                                            # quoted texts in the pages
python scripts/docs_figures.py NAME ...     # only these entries (and their canaries)
python scripts/docs_figures.py --check      # every quote on its page; small entries and every
                                            # canary run again and compared with the JSON (TPU
                                            # ones skipped without libtpu); exit 1
python scripts/docs_figures.py --programs   # the same re-runs; where the figures match, record
                                            # the program fingerprints, with which the test
                                            # suite checks them without compiling
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# This checkout's kiln, for rendering recorded outputs as kiln prints them (imported where used).
sys.path.insert(0, str(REPO / "src"))
RECORD = REPO / "docs" / "figures.json"
GB = 1e9
# A full-size model cut so that it compiles in seconds: 2 layers (XLA compiles a 1-layer scan
# without its loop), small widths and vocabulary; one sequence of 1024 tokens (two query
# blocks of 512) per device per micro-batch on 8 devices, the vocabulary tiling kept.
CANARY = (
    "model.num_layers=2",
    "model.d_model=256",
    "model.d_ff=512",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.vocab_size=2048",
    "data.seq_len=1024",
    "model.max_seq_len=1024",
    "train.global_batch_size=16",
    "train.gradient_accumulation_steps=2",
)
# A Mixture-of-Experts model cut as CANARY cuts a dense one, its experts too (16 of 128), with a
# batch that two micro-batches split over the 32 devices of a v5p-64; sequences of 256 tokens
# (libtpu takes half the time it takes at 1024, and the expert exchange is the same program).
MOE_CANARY = (
    *(item for item in CANARY if not item.startswith(("train.global_batch_size=", "data.seq_len"))),
    "data.seq_len=256",
    "train.global_batch_size=64",
    "model.head_dim=64",
    "model.moe.num_experts=16",
    "model.moe.d_ff_expert=128",
)
# A pipelined model cut as CANARY cuts a dense one, to 8 layers (2 per stage on 4 stages) and
# the 4 micro-batches of 16 sequences that 4 stages x fsdp 16 need.
PIPELINE_CANARY = (
    *(item for item in CANARY if not item.startswith(("model.num_layers=", "train."))),
    "model.num_layers=8",
    "train.global_batch_size=64",
    "train.gradient_accumulation_steps=4",
)
B1 = "configs/models/llama3-1b.yaml"
B8 = "configs/models/llama3-8b.yaml"
B8_128K = "configs/models/llama3-8b-128k.yaml"
B70 = "configs/models/llama3-70b.yaml"
GEMMA3_1B = "configs/models/gemma3-1b.yaml"
GPT_OSS_20B = "configs/models/gpt-oss-20b.yaml"
QWEN = "configs/models/qwen3-30b-a3b.yaml"
DEEPSEEK = "configs/models/deepseek-v3-671b.yaml"
TINY = "configs/tiny.yaml"
# The small models of docs/scaling.md's collectives section (tests/test_compile.py's).
TENSOR_PARALLEL = (
    *("model.num_layers=2", "model.d_model=128", "model.d_ff=256", "model.vocab_size=512"),
    *("model.num_heads=4", "model.num_kv_heads=2", "model.attention=xla", "data.seq_len=64"),
    *("train.global_batch_size=8", "mesh.fsdp=4", "mesh.tensor=2"),
)
SEQUENCE_PARALLEL = (
    *("model.num_layers=2", "model.d_model=64", "model.d_ff=128", "model.vocab_size=256"),
    *("model.num_heads=4", "model.num_kv_heads=2", "model.attention=xla"),
    *("train.global_batch_size=4", "mesh.fsdp=4", "mesh.sequence=2"),
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A kiln command whose output the docs quote."""

    args: tuple[str, ...]  # after `kiln`; a compile gets --json
    canary: bool = False  # slow: the test runs the command with CANARY instead
    derived: bool = False  # slow: the test checks it against other records (disagreements)
    tpu: bool = False  # needs libtpu (--topology)
    cut: tuple[str, ...] = CANARY  # the canary's overrides

    def command(self, canary: bool = False) -> list[str]:
        """`kiln`'s arguments; for the canary, the entry's overrides of what the cut sets go."""
        cut = {item.split("=", 1)[0] for item in self.cut}
        args = [*(a for a in self.args if not canary or a.split("=", 1)[0] not in cut)]
        args += self.cut if canary else ()
        return [*args, "--json"] if args[0] == "compile" else args


SUMMARY_8B = ("config", B8, "--summary", "--devices", "8", "--hbm-gb", "80")
SUMMARY_1B = ("config", B1, "--summary", "--hbm-gb", "16", "mesh.fsdp=8")
SUMMARY_QWEN = ("config", QWEN, "--summary", "--topology", "v5p-64", "--hbm-gb", "95")
SUMMARY_DEEPSEEK = ("config", DEEPSEEK, "--summary", "--topology", "v5p-512", "--hbm-gb", "95")
# DeepSeek-V3 cut as MOE_CANARY cuts Qwen3-MoE: 2 routed layers, 16 experts in 8 groups, a
# latent attention of width 256 (the latents are split 256 ways like embed over the 256 chips
# of a v5p-512), one sequence of 128 tokens per chip, one micro-batch. libtpu partitions for
# 256 devices, so the dense layers and the prediction module are cut too (14 s of compile,
# not 24 s; both run in tests/test_deepseek.py on CPU).
DEEPSEEK_CANARY = (
    "model.num_layers=2",
    "model.moe.first_dense_layers=0",
    "model.deepseek.mtp_num_layers=0",
    "model.d_model=256",
    "model.d_ff=512",
    "model.num_heads=4",
    "model.vocab_size=2048",
    "model.moe.num_experts=16",
    "model.moe.d_ff_expert=128",
    "model.deepseek.q_lora_rank=256",
    "model.deepseek.kv_lora_rank=256",
    "model.deepseek.qk_nope_head_dim=32",
    "model.deepseek.qk_rope_head_dim=16",
    "model.deepseek.v_head_dim=32",
    "data.seq_len=128",
    "train.global_batch_size=256",
    "train.gradient_accumulation_steps=1",
)


def small(overrides: tuple[str, ...], target: str) -> Entry:
    """A small model of configs/tiny.yaml compiled for 8 CPU devices ("cpu") or a TPU slice."""
    where = ("--devices", "8") if target == "cpu" else ("--topology", target)
    return Entry(("compile", TINY, *overrides, *where), tpu=target != "cpu")


ENTRIES = {
    "8b": Entry(("compile", B8, "--devices", "8"), canary=True),
    "8b-summary": Entry(SUMMARY_8B, derived=True),
    "8b-fit": Entry(("compile", B8, "--devices", "8", "--fit", "--hbm-gb", "80"), derived=True),
    "8b-2-layers": Entry(("compile", B8, "--devices", "8", "model.num_layers=2"), canary=True),
    "8b-4-layers": Entry(("compile", B8, "--devices", "8", "model.num_layers=4"), canary=True),
    "8b-v5p-16": Entry(("compile", B8, "--topology", "v5p-16"), canary=True, tpu=True),
    "8b-sequence": Entry(
        ("compile", B8, "mesh.fsdp=4", "mesh.sequence=2", "--devices", "8"), canary=True
    ),
    "8b-sequence-v5p-16": Entry(
        ("compile", B8, "mesh.fsdp=4", "mesh.sequence=2", "--topology", "v5p-16"),
        canary=True,
        tpu=True,
    ),
    "8b-128k-v5p-16": Entry(("compile", B8_128K, "--topology", "v5p-16"), canary=True, tpu=True),
    "70b-v5p-128": Entry(
        ("compile", B70, "--topology", "v5p-128"), canary=True, tpu=True, cut=PIPELINE_CANARY
    ),
    "gemma3-1b-v5e-8": Entry(
        ("compile", GEMMA3_1B, "--topology", "v5e-8"),
        canary=True,
        tpu=True,
        cut=(*CANARY, "model.layer_types=[sliding_attention,full_attention]"),  # both kinds
    ),
    "gpt-oss-20b-v5p-64": Entry(
        ("compile", GPT_OSS_20B, "--topology", "v5p-64"), canary=True, tpu=True, cut=MOE_CANARY
    ),
    "1b": Entry(("compile", B1, "--devices", "8"), canary=True),
    "1b-summary": Entry(SUMMARY_1B, derived=True),
    "1b-2-layers": Entry(("compile", B1, "--devices", "8", "model.num_layers=2"), canary=True),
    "1b-4-layers": Entry(("compile", B1, "--devices", "8", "model.num_layers=4"), canary=True),
    "1b-v5e-8": Entry(("compile", B1, "--topology", "v5e-8"), canary=True, tpu=True),
    "qwen3-30b-a3b-v5p-64": Entry(
        ("compile", QWEN, "--topology", "v5p-64"), canary=True, tpu=True, cut=MOE_CANARY
    ),
    "qwen3-30b-a3b-summary": Entry(SUMMARY_QWEN, derived=True, tpu=True),
    "deepseek-v3-671b-v5p-512": Entry(
        ("compile", DEEPSEEK, "--topology", "v5p-512"), canary=True, tpu=True, cut=DEEPSEEK_CANARY
    ),
    "deepseek-v3-671b-summary": Entry(SUMMARY_DEEPSEEK, derived=True, tpu=True),
    "qwen3-30b-a3b-fit": Entry(
        ("compile", QWEN, "--topology", "v5p-64", "--fit", "--hbm-gb", "90"),
        derived=True,
        tpu=True,
    ),
    **{
        f"sequence-{s}": small(
            (*SEQUENCE_PARALLEL, f"data.seq_len={s}", f"model.max_seq_len={s}"), "cpu"
        )
        for s in (1024, 2048)
    },
    **{
        f"tensor-{rule}-{target}": small((*TENSOR_PARALLEL, *extra), target)
        for rule, extra in (("default", ()), ("before", ("mesh.rules.act_length=[sequence]",)))
        for target in ("v5e-8", "cpu")
    },
}


def run(args: list[str]) -> Any:
    """The output of `kiln ARGS` from this checkout: JSON when it prints JSON, else its lines."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"kiln {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return parse(proc.stdout)


def parse(stdout: str) -> Any:
    """A kiln command's output: JSON when it printed JSON, else its lines."""
    text = stdout.strip()
    return json.loads(text) if text.startswith("{") else text.splitlines()


def figures(output: Any) -> Any:
    """An output without what varies between runs of one program (compile times) and without
    the program's fingerprint (another program may give the same figures)."""
    if isinstance(output, dict):
        return {k: figures(v) for k, v in output.items() if k not in ("compile_seconds", "program")}
    if isinstance(output, list):
        return [figures(v) for v in output]
    return output


def measure(name: str) -> dict[str, Any]:
    """An entry's record: its command and output, and its canary's."""
    entry = ENTRIES[name]
    record = {"command": "kiln " + " ".join(entry.command()), "output": run(entry.command())}
    if entry.canary:
        canary = entry.command(canary=True)
        record["canary"] = {"command": "kiln " + " ".join(canary), "output": run(canary)}
    return record


# ---------------------------------------------------------------------------------------------
# What the pages quote


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def _report_lines(output: dict[str, Any], path: str) -> list[str]:
    """`kiln compile`'s text report of a recorded --json output."""
    from kiln.commands.compile import StepReport, format_report

    return format_report(StepReport(**output), path).splitlines()


def _per_step(output: dict[str, Any], kind: str, unit: str = "B") -> str:
    """`ops / bytes` per step of one kind of collective: bytes in full, or in GB."""
    c = output["collectives"][kind]
    size = f"{c['bytes_per_step']:,}" if unit == "B" else f"{c['bytes_per_step'] / GB:,.1f} GB"
    return f"{c['ops_per_step']:,} / {size}"


def _static(output: dict[str, Any], kind: str) -> str:
    c = output["collectives"][kind]
    return f"{c['ops']} / {c['bytes']:,}"


def _compiled(output: dict[str, Any]) -> str:
    return f"{_gb(output['memory']['peak'])} (compile {output['compile_seconds']:.0f} s)"


def _extrapolated(out: dict[str, Any], size: str, layers: int) -> tuple[str, float]:
    """memory(L) = a + b L through the compiled peaks of 2 and 4 layers, at `layers`: the
    sum as written, and its bytes."""
    two, four = (out[f"{size}-{n}-layers"]["memory"]["peak"] for n in (2, 4))
    per_layer = (four - two) / 2
    at = two + per_layer * (layers - 2)
    return f"{two / GB:.2f} + {per_layer / GB:.3f} x {layers - 2} = {_gb(at)}", at


def quotes(records: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(page, text) of every figure the pages quote, rendered from the recorded outputs."""
    out = {name: record["output"] for name, record in records.items()}
    scaling = "docs/scaling.md"
    b8, b1, fit = out["8b"], out["1b"], out["8b-fit"]
    found = [(scaling, line) for line in _report_lines(b8, B8)]
    for page in ("README.md", "docs/sharding.md"):
        found += [(page, line) for line in out["8b-summary"]]
    found += [(scaling, line) for line in out["1b-summary"][-3:]]
    for trial in fit["trials"]:
        row = (
            f"| {trial['remat']} | {trial['num_vocab_tiling']} | "
            f"{trial['gradient_accumulation_steps']} | {_gb(trial['peak_bytes'])} | "
            f"{'yes' if trial['fits'] else 'no'} |"
        )
        found.append((scaling, row))
    found.append((scaling, f"Result: `{fit['overrides']}`."))
    line_1b, at_1b = _extrapolated(out, "1b", 16)
    line_8b, _ = _extrapolated(out, "8b", 32)
    found += [
        (
            scaling,
            f"The 1B config's compiled peak leaves {(16 * GB - b1['memory']['peak']) / GB:.2f} GB "
            f"of its 16 GB, and the straight line from 2 and 4\nlayers falls "
            f"{(b1['memory']['peak'] - at_1b) / GB:.2f} GB short of the full compile",
        ),
        (scaling, f"`, {b1['compile_seconds']:.0f} s here)."),
        (
            scaling,
            "| `llama3-1b.yaml` | TPU v5e-8, 8 chips x 16 GB | 256 x 4096 tokens, accumulation 32, "
            f"save_dots, tiling 4 | {_compiled(b1)} | {line_1b} | "
            f"`--topology v5e-8`: {_compiled(out['1b-v5e-8'])} |",
        ),
        (
            scaling,
            "| `llama3-8b.yaml` | 8 x 80 GB GPUs (one H100 node) | 512 x 8192 tokens, accumulation "
            f"64, save_dots, tiling 4 | {_compiled(b8)} | {line_8b} | "
            f"`--topology v5p-16` (8 chips): {_compiled(out['8b-v5p-16'])} |",
        ),
        (B1, f"with save_dots remat (base.yaml) {b1['memory']['peak'] / GB:.1f} GB per device."),
        (B8, f"with save_dots remat (base.yaml) {b8['memory']['peak'] / GB:.0f} GB per device."),
    ]
    seq, tpu_seq = out["8b-sequence"], out["8b-sequence-v5p-16"]
    found.append(
        (
            scaling,
            f"| now | {_per_step(seq, 'all-gather', 'GB')} | {_per_step(seq, 'reduce-scatter', 'GB')}"
            f" | {_per_step(seq, 'all-reduce', 'GB')} | {_gb(seq['memory']['temporaries'])} | "
            f"{_gb(seq['memory']['peak'])} |",
        )
    )
    found.append(
        (
            scaling,
            f"{_gb(tpu_seq['memory']['peak'])} now (temporaries 48.49 → "
            f"{_gb(tpu_seq['memory']['temporaries'])}; static all-reduces 9 → "
            f"{tpu_seq['collectives']['all-reduce']['ops']};",
        )
    )
    for s, blocks in ((1024, 2), (2048, 4)):
        small = out[f"sequence-{s}"]
        row = (
            f"| {s} ({blocks}) | now | {_per_step(small, 'all-gather')} | "
            f"{_per_step(small, 'all-reduce')} | 4 | {small['memory']['peak'] / 1e6:.2f} MB |"
        )
        found.append((scaling, row))
    for rule, label in (("before", "`[sequence]` (before)"), ("default", "`[sequence, tensor]`")):
        for target, shown in (("v5e-8", "v5e-8"), ("cpu", "8 CPU")):
            small = out[f"tensor-{rule}-{target}"]
            kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
            cells = " | ".join(_static(small, kind) for kind in kinds)
            peak = small["memory"]["peak"] / 1e6
            found.append((scaling, f"| {label} | {shown} | {cells} | {peak:.2f} MB |"))
    found += _moe_quotes(out)
    found += _deepseek_quotes(out)
    return found


def _deepseek_quotes(out: dict[str, Any]) -> list[tuple[str, str]]:
    """docs/deepseek.md's DeepSeek-V3 section and the config's target line."""
    page, compiled = "docs/deepseek.md", out["deepseek-v3-671b-v5p-512"]
    found = [(page, line) for line in out["deepseek-v3-671b-summary"]]
    found += [(page, line) for line in _report_lines(compiled, DEEPSEEK)]
    found.append((DEEPSEEK, f"peak {_gb(compiled['memory']['peak'])} per device"))
    return found


def _moe_quotes(out: dict[str, Any]) -> list[tuple[str, str]]:
    """docs/moe.md's Qwen3-30B-A3B section and the config's target line."""
    page, compiled = "docs/moe.md", out["qwen3-30b-a3b-v5p-64"]
    found = [(page, line) for line in out["qwen3-30b-a3b-summary"]]
    found += [(page, line) for line in _report_lines(compiled, QWEN)]
    for trial in out["qwen3-30b-a3b-fit"]["trials"]:
        peak = "out of memory" if trial["peak_bytes"] is None else _gb(trial["peak_bytes"])
        row = (
            f"| {trial['remat']} | {trial['num_vocab_tiling']} | "
            f"{trial['gradient_accumulation_steps']} | {peak} | "
            f"{'yes' if trial['fits'] else 'no'} |"
        )
        found.append((page, row))
    found += [
        (page, f"Result: `{out['qwen3-30b-a3b-fit']['overrides']}`."),
        (QWEN, f"peak {_gb(compiled['memory']['peak'])} per device"),
    ]
    return found


def missing_quotes(records: dict[str, dict[str, Any]]) -> list[str]:
    """The quotes a page does not hold, one line each."""
    return [
        f"{page}: no {text!r}"
        for page, text in quotes(records)
        if text not in (REPO / page).read_text()
    ]


# ---------------------------------------------------------------------------------------------
# Regenerate, check


def regenerate(names: list[str]) -> None:
    """Measure `names`, record them, and replace each quote that changed in its page."""
    records = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    old = quotes(records) if set(records) == set(ENTRIES) else []
    for name in names:
        start = time.perf_counter()
        records[name] = measure(name)
        seconds = time.perf_counter() - start
        print(f"{name}: {seconds:.0f} s, {records[name]['command']}", file=sys.stderr)
    records = {name: records[name] for name in ENTRIES if name in records}
    RECORD.write_text(json.dumps(records, indent=1) + "\n")
    if set(records) != set(ENTRIES):
        return
    new = quotes(records)
    for (page, before), (_, after) in zip(old, new) if len(old) == len(new) else ():
        path = REPO / page
        text = path.read_text()
        if before != after and text.count(before) == 1:
            path.write_text(text.replace(before, after))
    for line in missing_quotes(records):
        print(f"update by hand: {line}", file=sys.stderr)


def disagreements(records: dict[str, dict[str, Any]]) -> list[str]:
    """The derived entries against the compiles of their models, one line per difference.

    A summary is `kiln.model.summary` of the config (from shapes, nothing compiled) and the
    compiled lines of the model's compile record; the --fit trial of the config's own settings
    has that record's peak.
    """
    from kiln.commands.compile import StepReport, summary_lines
    from kiln.config import load_config
    from kiln.model import summary
    from kiln.training.optim import make_optimizer, state_name

    out = {name: record["output"] for name, record in records.items()}
    problems = []
    for name, args, compiled, hbm_gb in (
        ("8b-summary", SUMMARY_8B, "8b", 80.0),
        ("1b-summary", SUMMARY_1B, "1b", 16.0),
        ("qwen3-30b-a3b-summary", SUMMARY_QWEN, "qwen3-30b-a3b-v5p-64", 95.0),
        ("deepseek-v3-671b-summary", SUMMARY_DEEPSEEK, "deepseek-v3-671b-v5p-512", 95.0),
    ):
        overrides = [a for a in args if "=" in a]
        config = load_config(REPO / args[1], overrides)
        report = StepReport(**out[compiled])
        optimizer = make_optimizer(config.optim)
        want = summary(config, optimizer.init, state_name(config.optim), report.devices)
        want = want.splitlines()
        want += summary_lines(report, hbm_gb).splitlines()
        if out[name] != want:
            problems.append(f"{name}: the recorded summary is not the one of the {compiled} record")
    fits = (("8b-fit", B8, "8b"), ("qwen3-30b-a3b-fit", QWEN, "qwen3-30b-a3b-v5p-64"))
    for name, path, compiled in fits:
        own = load_config(REPO / path)
        train = own.train
        settings = (own.model.remat, own.loss.num_vocab_tiling, train.gradient_accumulation_steps)
        peaks = [
            t["peak_bytes"]
            for t in out[name]["trials"]
            if (t["remat"], t["num_vocab_tiling"], t["gradient_accumulation_steps"]) == settings
        ]
        if peaks != [out[compiled]["memory"]["peak"]]:
            problems.append(
                f"{name}: its trial of the config's own settings is not the {compiled} record's"
            )
    return [
        f"{line}; re-measure with `python scripts/docs_figures.py` and update what the pages quote"
        for line in problems
    ]


def reruns(tpu: bool) -> dict[tuple[str, ...], list[str]]:
    """The commands `--check` runs again (an entry's, or its canary's), each with the entries it
    checks: entries of one model share a canary. TPU entries only with `tpu`."""
    commands: dict[tuple[str, ...], list[str]] = {}
    for name, entry in ENTRIES.items():
        if not entry.derived and (tpu or not entry.tpu):
            commands.setdefault(tuple(entry.command(canary=entry.canary)), []).append(name)
    return commands


def rerun_problems(
    records: dict[str, dict[str, Any]], command: tuple[str, ...], names: list[str], output: Any
) -> list[str]:
    """Where `output`, of `kiln COMMAND` run again, differs from what `names` recorded."""
    problems = []
    for name in names:
        if figures(output) != figures(recorded_output(records, name)):
            problems.append(
                f"{name}: `kiln {' '.join(command)}` gives other figures than "
                f"docs/figures.json records; re-measure with `python scripts/docs_figures.py "
                f"{name}` and update what the pages quote"
            )
    return problems


def program(command: tuple[str, ...]) -> str:
    """The fingerprint of the step `kiln COMMAND` (a compile) compiles, lowered in this process
    and not compiled (`kiln.commands.compile.program_fingerprint`): lowering does not depend on
    XLA's flags, so a process with other flags than `kiln`'s gets the same one."""
    import jax

    from kiln.cli import parse_args
    from kiln.commands import compile as aot
    from kiln.config import load_config

    args = parse_args(list(command))
    devices = aot.target_devices(args.devices, args.topology)
    config = load_config(REPO / args.config, args.overrides)
    with jax.default_matmul_precision(None):  # kiln's own, whatever this process set
        lowered, _, _, mesh = aot.lower_step(config, devices)
    return aot.program_fingerprint(lowered, mesh)


def recorded_output(records: dict[str, dict[str, Any]], name: str) -> Any:
    """What `name` recorded of the command `reruns` runs again for it (its canary's output)."""
    record = records[name]
    return record["canary"]["output"] if ENTRIES[name].canary else record["output"]


def unchanged(records: dict[str, dict[str, Any]], names: list[str], fingerprint: str) -> bool:
    """Whether every entry of `names` recorded the figures of the program `fingerprint`: then
    compiling it again gives them (compiles are deterministic), and the check needs no compile."""
    return all(recorded_output(records, n).get("program") == fingerprint for n in names)


def record_programs(tpu: bool) -> list[str]:
    """Run every cheap command again; where its figures are the recorded ones, record its
    program's fingerprint too (the test suite then checks them without compiling). The
    commands whose figures differ, one line each (their records are left as they are)."""
    records = json.loads(RECORD.read_text())
    problems = []
    for command, names in reruns(tpu).items():
        output = run(list(command))
        found = rerun_problems(records, command, names, output)
        problems += found
        if not found:
            for name in names:
                recorded_output(records, name)["program"] = output["program"]
    RECORD.write_text(json.dumps(records, indent=1) + "\n")
    return problems


def check(tpu: bool) -> list[str]:
    """Every difference between the record and the pages or a cheap re-run, one line each."""
    records = json.loads(RECORD.read_text())
    problems = missing_quotes(records)
    problems += disagreements(records)
    for command, names in reruns(tpu).items():
        problems += rerun_problems(records, command, names, run(list(command)))
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(ENTRIES)}")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument(
        "--programs",
        action="store_true",
        help="re-run the cheap commands and record the program fingerprints of those whose "
        "figures are the recorded ones",
    )
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in ENTRIES]
    if unknown:
        parser.error(f"unknown entries {unknown}; allowed: {', '.join(ENTRIES)}")
    if args.check or args.programs:
        tpu = importlib.util.find_spec("libtpu") is not None
        problems = record_programs(tpu) if args.programs else check(tpu)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    regenerate(args.names or list(ENTRIES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
