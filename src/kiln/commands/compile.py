"""`kiln compile`: the real train step compiled ahead of time, without allocating a parameter.

The step is `kiln.training.train.make_step` of the objective `kiln train` (or `kiln distill`) builds,
lowered with the train state and a global batch as sharded ShapeDtypeStructs and compiled for
N simulated CPU devices or for a TPU topology (libtpu's compiler runs without a TPU). Every
figure comes from the compiled executable: memory from `memory_analysis()`, collectives from
its HLO; FLOPs from kiln's formula beside XLA's `cost_analysis` (which counts the body of a
`scan`, such as the layer loop, once).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import math
import os
import re
import time
from typing import Any

import jax

from kiln.commands import buffers
from kiln.commands.hlo import collective_summary
from kiln.config import MESH_AXES, Config, pipeline_split
from kiln.distill.offline import abstract_offline, abstract_teacher_rows
from kiln.distill.online import abstract_distillation
from kiln.distill.reader import check
from kiln.errors import KilnError, RunStopped, first_line
from kiln.parallel.mesh import make_mesh
from kiln.parallel.pipeline import Schedule
from kiln.training.batches import abstract_batch
from kiln.training.train import abstract_pretraining, make_step, shardings_of
from kiln.util.humanize import plural
from kiln.util.platforms import tpu_attached

GB = 1e9  # --hbm-gb is in decimal gigabytes, as accelerator memory is sold
# The most devices a step is compiled for: the largest slice --topology knows (v4-4096 and
# v5p-4096 TensorCores). Each simulated CPU device costs host memory and compile time.
MAX_DEVICES = 4096


def use_cpu_devices(count: int, what: str = "--devices") -> list[Any]:
    """`count` simulated CPU devices; set before JAX's backend starts (else it must have enough).

    At most MAX_DEVICES (KilnError naming `what`), refused before any device is simulated.
    """
    if not 1 <= count <= MAX_DEVICES:
        raise KilnError(
            f"{what}: {count} devices; allowed: 1..{MAX_DEVICES} (the largest slice kiln "
            f"compiles for, v5p-{MAX_DEVICES})"
        )
    # Refused once the backend has started: then its devices are used, if there are enough.
    # CPU only, so that an installed libtpu or CUDA plugin is not started for nothing.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", count)
        jax.config.update("jax_platforms", "cpu")
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise KilnError(
            f"--devices: {count} requested, but JAX's CPU backend already started with "
            f"{len(devices)}; run `kiln compile` in a fresh process (or set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={count} before JAX starts)"
        )
    return devices[:count]


def tpu_topology(name: str) -> dict[str, Any]:
    """libtpu's arguments for a slice name: v4-N and v5p-N (N TensorCores), v5e-N and v6e-N (N chips)."""
    match = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name)
    size = int(match.group(2)) if match else 0
    megacore = bool(match) and match.group(1) in ("v4", "v5p")
    low, high = (8, MAX_DEVICES) if megacore else (4, 256)
    if not match or size < low or size > high or size & (size - 1):
        raise KilnError(
            f"--topology: unknown TPU slice {name!r}; allowed: v4-N or v5p-N (N TensorCores, "
            f"a power of 2 from 8 to {MAX_DEVICES}), v5e-N or v6e-N (N chips, a power of 2 from 4 "
            "to 256)"
        )
    # Slices grow by doubling their shortest side (the last of equals): 2x2x1, 2x2x2, 2x2x4, ...
    dims = [2, 2, 1] if megacore else [2, 2]
    while math.prod(dims) < (size // 2 if megacore else size):
        shortest = min(dims)
        last = max(i for i, d in enumerate(dims) if d == shortest)
        dims[last] *= 2
    if megacore:  # a full 4x4x4 cube and larger are tori
        wrap = tuple(all(d >= 4 for d in dims) for _ in dims)
    else:
        wrap = (*(d >= 16 for d in dims), False)
    generation = {"v4": "v4", "v5p": "v5", "v5e": "v5e", "v6e": "v6e"}[match.group(1)]
    return {
        "topology_name": f"{generation}:{'x'.join(map(str, dims))}",
        "chip_config_name": "megacore" if megacore else "default",
        "chips_per_host_bounds": (2, 2, 1),
        "num_slices": 1,
        "wrap": wrap,
    }


def topology_devices(name: str) -> list[Any]:
    """The compile-only devices of a TPU slice (libtpu, the `kiln[tpu]` extra)."""
    args = tpu_topology(name)
    if importlib.util.find_spec("libtpu") is None:
        raise KilnError(
            f"--topology {name}: compiling for TPU needs libtpu; install the extra: "
            "pip install 'kiln[tpu]'"
        )
    from jax.experimental.topologies import get_topology_desc

    # Compile-only devices hold no chip: libtpu's one-process-per-TPU lock does not apply.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not tpu_attached():
        # Without a TPU (nor its metadata server) libtpu reads the host's slice and workers from
        # these, and prints errors to stderr when they are unset; compile-only devices use neither.
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", name)
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

    return list(get_topology_desc(platform="tpu", **args).devices)


def abstract_run(config: Config, mesh) -> tuple[Any, Any, str]:
    """(objective, abstract train state, command) of the step `kiln train`/`kiln distill` runs."""
    if config.distillation.teacher_logits_dir:
        return (*abstract_offline(config, mesh), "kiln distill")
    if config.distillation.teacher_run_dir:
        return (*abstract_distillation(config, mesh), "kiln distill")
    return (*abstract_pretraining(config, mesh), "kiln train")


@dataclasses.dataclass
class StepReport:
    """What the compiler says about one config's step, per device."""

    command: str
    platform: str
    devices: int
    mesh: dict[str, int]
    compile_seconds: float
    memory: dict[str, int]  # bytes per device: arguments, outputs, temporaries, aliased, peak
    peak_source: str
    flops: dict[str, float]
    # kind -> {"ops", "bytes"} static, {"ops_per_step", "bytes_per_step"} as run (see collectives)
    collectives: dict[str, dict[str, int | None]]
    # The largest buffers live at the peak (--peak-buffers); None when not asked for.
    peak_buffers: list[buffers.PeakBuffer] | None = None
    # What was compiled (`program_fingerprint`): two reports with one fingerprint come from one
    # compile, so their figures are equal. Empty in reports recorded before it existed.
    program: str = ""
    # With pipeline stages: stages, repeats, microbatches, iterations and bubble (the fraction
    # of stage-iterations in the bubble, (S-1)/(R·M+S-1)); None (left out of the JSON) without.
    pipeline: dict[str, float] | None = None
    # Where a loop's trip count is not in the HLO (the TPU compiler's): kind -> {"ops_per_step",
    # "bytes_per_step"} with each such loop counted once, a lower bound (hlo.collective_summary);
    # None (left out of the JSON) when `collectives` has every per-step figure.
    collectives_per_step_at_least: dict[str, dict[str, int]] | None = None

    def fits(self, hbm_gb: float | None) -> bool:
        return hbm_gb is None or self.memory["peak"] <= hbm_gb * GB

    def to_json(self) -> dict[str, Any]:
        # Without --peak-buffers the key is left out: a report's JSON stays what the records
        # of docs/figures.json (compared whole by scripts/docs_figures.py) hold.
        out = dataclasses.asdict(self)
        for key in ("peak_buffers", "pipeline", "collectives_per_step_at_least"):
            if out[key] is None:
                del out[key]
        return out


def lower_step(config: Config, devices: list[Any]):
    """(lowered step, command, objective, mesh): the step of `kiln.training.train.make_step`, abstract inputs."""
    mesh = make_mesh(config, devices)
    objective, state, command = abstract_run(config, mesh)
    step = make_step(objective, shardings_of(state))
    batch = abstract_batch(config, mesh)
    if config.distillation.teacher_logits_dir:  # the store's top-k rows ride in the batch
        batch.update(abstract_teacher_rows(config, mesh, check(config)["top_k"]))
    return step.lower(state, batch), command, objective, mesh


def program_fingerprint(lowered, mesh) -> str:
    """A fingerprint of what a compile of `lowered` for `mesh` depends on: the program as
    lowered (StableHLO without source locations), the devices of the mesh in order and their
    kind, and the versions of JAX, jaxlib and the TPU compiler. Compiling is deterministic, so
    an equal fingerprint means an equal compiled step (with the same XLA flags); the docs'
    recorded figures are checked by it without compiling (scripts/docs_figures.py)."""
    devices = list(mesh.devices.flat)
    parts = [
        without_paths(lowered.as_text(debug_info=False)),
        str(dict(mesh.shape)),
        ",".join(str(d.id) for d in devices),
        devices[0].device_kind,
        jax.__version__,
        importlib.metadata.version("jaxlib"),
    ]
    if devices[0].platform == "tpu":
        parts.append(importlib.metadata.version("libtpu"))
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:20]


# A Pallas kernel's custom call carries its Mosaic module serialized (base64 MLIR bytecode),
# whose source locations name the file the kernel came from: where JAX is installed.
_KERNEL_BODY = re.compile(r"(\\22body\\22: \\22)([A-Za-z0-9+/=]+)(\\22)")


def without_paths(text: str) -> str:
    """The lowered program with each kernel's body replaced by a digest of it without source
    locations, so that the fingerprint does not depend on where the environment lives."""

    def neutral(match: re.Match) -> str:
        # Only programs with a TPU kernel get here; jaxlib carries the dialect on any platform.
        from jax._src.interpreters import mlir
        from jax._src.lib import tpu
        from jax._src.lib.mlir import ir

        context = mlir.make_ir_context()
        tpu.register_dialect(context)
        context.allow_unregistered_dialects = True  # the kernel's version marker dialect
        with context:
            module = ir.Module.parse(base64.b64decode(match.group(2)))
            asm = module.operation.get_asm(enable_debug_info=False)
        return match.group(1) + hashlib.sha256(asm.encode()).hexdigest() + match.group(3)

    return _KERNEL_BODY.sub(neutral, text)


class OutOfMemory(RunStopped):
    """The compiler refused the step: it needs more memory than a device has (the TPU
    compiler checks its buffers against the HBM of the slice's chips; XLA:CPU never refuses)."""


def compile_report(config: Config, devices: list[Any], peak_buffers: int = 0) -> StepReport:
    """Compile `config`'s train step for `devices` and report its memory, FLOPs and collectives.

    `peak_buffers` > 0: also the largest buffers live at the step's peak (kiln.commands.buffers).
    """
    start = time.perf_counter()
    lowered, command, objective, mesh = lower_step(config, devices)
    largest = None
    with contextlib.ExitStack() as stack:
        options = None
        if peak_buffers > 0:
            dump = stack.enter_context(buffers.dump_directory())
            options = buffers.compiler_options(dump)
        compiled = _compile(lowered, command, devices, options)
        if peak_buffers > 0:
            largest = buffers.peak_buffers(dump, peak_buffers)
    seconds = time.perf_counter() - start
    memory, peak_source = memory_figures(compiled.memory_analysis(), devices[0].platform)
    tokens = config.train.global_batch_size * config.data.seq_len
    kiln_flops = objective.flops_per_token() * tokens
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    per_kind, at_least = collective_summary(compiled.as_text())
    return StepReport(
        command=command,
        platform=devices[0].platform,
        devices=len(devices),
        mesh=dict(mesh.shape),
        compile_seconds=round(seconds, 2),
        memory=memory,
        peak_source=peak_source,
        flops={
            "kiln_per_step": kiln_flops,
            "kiln_per_device": kiln_flops / len(devices),
            "xla_cost_analysis_per_device": float((cost or {}).get("flops", float("nan"))),
        },
        collectives=per_kind,
        peak_buffers=largest,
        program=program_fingerprint(lowered, mesh),
        pipeline=_pipeline_figures(config, dict(mesh.shape)),
        collectives_per_step_at_least=at_least,
    )


def _pipeline_figures(config: Config, mesh: dict[str, int]) -> dict[str, float] | None:
    if mesh.get("stage", 1) == 1:
        return None
    _, pieces = pipeline_split(config, mesh["stage"])
    schedule = Schedule(mesh["stage"], config.pipeline.repeats, pieces)
    return {
        **schedule._asdict(),
        "iterations": schedule.iterations,
        "bubble": round(schedule.bubble, 6),
    }


def _compile(lowered, command: str, devices: list[Any], options: dict[str, Any] | None):
    """`lowered.compile(options)`; OutOfMemory (one line) when the compiler refuses it for memory."""
    try:
        return lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        where = plural(len(devices), devices[0].platform + " device")
        said = first_line(e).rstrip(".")
        raise OutOfMemory(
            f"compiling the `{command}` step for {where}: {said}; search settings that fit "
            "with `kiln compile CONFIG --fit --hbm-gb X`"
        ) from None


def memory_figures(stats, platform: str) -> tuple[dict[str, int], str]:
    """Per-device bytes of `memory_analysis()` and how the peak was found.

    TPU and GPU compilers report the peak of their buffer assignment; XLA:CPU's
    `peak_memory_in_bytes` leaves the temporaries out, so on CPU the peak is the sum.
    """
    memory = {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "temporaries": int(stats.temp_size_in_bytes),
        "aliased": int(stats.alias_size_in_bytes),
    }
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if peak > 0 and platform != "cpu":
        memory["peak"] = peak
        return memory, "the compiler's peak_memory_in_bytes"
    # Donated inputs reused as outputs are counted once.
    memory["peak"] = memory["arguments"] + memory["outputs"] + memory["temporaries"]
    memory["peak"] -= memory["aliased"]
    return memory, "arguments + outputs + temporaries - aliased"


def format_report(report: StepReport, config_path: str) -> str:
    """The human-readable report of `kiln compile`."""
    mesh = " x ".join(f"{a}={s}" for a, s in report.mesh.items())
    m, f = report.memory, report.flops
    lines = [
        f"compiled the `{report.command}` step of {config_path} for "
        f"{plural(report.devices, report.platform + ' device')} ({mesh}) in "
        f"{report.compile_seconds:.1f} s",
        "memory per device (memory_analysis):",
        f"  arguments    {_gb(m['arguments'])}  (state, batch)",
        f"  outputs      {_gb(m['outputs'])}",
        f"  temporaries  {_gb(m['temporaries'])}  (activations, gradients, loss chunks)",
        f"  aliased      {_gb(m['aliased'])}  (donated state reused for the new state)",
        f"  peak         {_gb(m['peak'])}  ({report.peak_source})",
        *_pipeline_lines(report.pipeline),
        *_peak_lines(report.peak_buffers),
        f"FLOPs per step: {f['kiln_per_step']:.4g} by kiln's formula "
        f"({f['kiln_per_device']:.4g} per device); XLA cost_analysis "
        f"{f['xla_cost_analysis_per_device']:.4g} per device (counts a scan body once)",
        "collectives between devices in the compiled HLO (static: an op inside a loop counted "
        "once; per step: as often as the loops around it run):",
    ]
    at_least = report.collectives_per_step_at_least or {}
    for kind, c in report.collectives.items():
        if c["ops_per_step"] is not None:
            per_step = f"per step {c['ops_per_step']:>5} ops  {_gb(c['bytes_per_step'])}"
        elif kind in at_least:
            b = at_least[kind]
            per_step = (
                f"per step >= {b['ops_per_step']:>5} ops  {_gb(b['bytes_per_step'])}  "
                "(loops of unknown trip count counted once)"
            )
        else:
            per_step = "per step: loop counts unknown"
        lines.append(f"  {kind:<19} {c['ops']:>4} ops  {_gb(c['bytes'])}    {per_step}")
    return "\n".join(lines)


def _pipeline_lines(p: dict[str, float] | None) -> list[str]:
    if p is None:
        return []
    return [
        f"pipeline: {p['stages']} stages x {p['repeats']} repeats, {p['microbatches']} "
        f"micro-batches: {p['iterations']} iterations, bubble {p['bubble']:.1%} of the "
        "stage-iterations ((stages - 1) / iterations; activations move by collective-permute)"
    ]


def _peak_lines(largest: list[buffers.PeakBuffer] | None) -> list[str]:
    if largest is None:
        return []
    return [
        f"  the {plural(len(largest), 'largest buffer')} live at the peak (XLA's buffer "
        "assignment): bytes, shape, HLO value, JAX op, source line",
        *buffers.format_buffers(largest),
    ]


def _gb(n: int | float) -> str:
    return f"{n / GB:9.3f} GB"


def target_devices(devices: int | None, topology: str | None) -> list[Any]:
    """The devices to compile for: N simulated CPU devices, a TPU slice, or the local devices."""
    if devices is not None and topology is not None:
        raise KilnError("kiln compile: give --devices N or --topology NAME, not both")
    if topology is not None:
        return topology_devices(topology)
    if devices is not None:
        return use_cpu_devices(devices)
    return jax.devices()


def check_fits(report: StepReport, hbm_gb: float | None, config_path: str) -> None:
    """RunStopped (exit 1, one line) when the compiled peak exceeds `hbm_gb`."""
    if not report.fits(hbm_gb):
        raise RunStopped(
            f"peak memory {report.memory['peak'] / GB:.2f} GB per device exceeds "
            f"--hbm-gb {hbm_gb:g}; search settings that fit with "
            f"`kiln compile {config_path} --fit --hbm-gb {hbm_gb:g}`"
        )


def summary_devices(config: Config, devices: int | None, topology: str | None) -> list[Any]:
    """Devices for `kiln config --summary`: as `kiln compile`, or as many as an explicit mesh has."""
    sizes = [getattr(config.mesh, a) for a in MESH_AXES]
    if devices is None and topology is None and -1 not in sizes:
        return use_cpu_devices(math.prod(sizes), "mesh (" + " x ".join(MESH_AXES) + ")")
    return target_devices(devices, topology)


def summary_lines(report: StepReport, hbm_gb: float | None) -> str:
    """The compiled memory of `kiln config --summary`: activations and whether the peak fits."""
    m = report.memory
    lines = [
        f"compiled step:     {plural(report.devices, report.platform + ' device')}, per device: "
        "arguments "
        f"{m['arguments'] / GB:.2f} GB + activations and temporaries {m['temporaries'] / GB:.2f} GB"
        f" -> peak {m['peak'] / GB:.2f} GB ({report.peak_source}; `kiln compile` for more)"
    ]
    if hbm_gb is None:
        lines.append("fits:              give --hbm-gb X to check the peak against X GB")
    else:
        verdict = "yes" if report.fits(hbm_gb) else "NO"
        lines.append(
            f"fits:              {verdict}, peak {m['peak'] / GB:.2f} GB per device vs {hbm_gb:g} GB"
            + ("" if report.fits(hbm_gb) else "; try `kiln compile --fit`")
        )
    return "\n".join(lines)
