"""`kiln compile --fit`: the settings with the least recompute whose compiled step fits in memory.

The search covers `model.remat` x `train.gradient_accumulation_steps` x `loss.num_vocab_tiling`
and compiles as few steps as it can, in this order:

1. Remat policies from the least recompute to the most: `none` first, `full` last, the
   schema's other policies in between in the order the schema lists them. The first policy
   with a fitting setting wins: remat costs recomputed FLOPs on every step, while
   accumulation only shrinks the micro-batch and vocabulary tiling only cuts the loss into
   chunks (no recompute).
2. For a policy, the largest valid accumulation with the largest tiling is compiled first: if
   that does not fit, nothing with this policy does. Otherwise a binary search finds the
   smallest accumulation that fits (memory falls as the micro-batch shrinks).
3. At that accumulation, a binary search finds the smallest tiling that fits.

Accumulations are the divisors of the global batch whose micro-batch splits over the batch
shards; tilings are the powers of two up to 32 that divide one shard's tokens (the checks of
the config itself decide what is valid).

With mesh axes to search (`--fit-mesh fsdp,tensor`), the other axes keep their resolved sizes
and the splits of the remaining devices over the named axes join step 1: for each remat policy,
each valid split is probed (step 2's first compile) in order, the config's own split first, then
the others with the first named axis largest; the first split that fits gets steps 2-3. A split
the config's rules refuse is skipped without a compile, with the reason: for a Mixture-of-Experts
model (`--fit-mesh fsdp,expert`) an `expert` size that does not divide `model.moe.num_experts`.

With pipeline stages among the splits (`--fit-mesh stage,fsdp`, or a config whose own
`mesh.stage` is above 1), `pipeline.repeats` is searched with the split: on S stages, the
repeats R that divide the staged stack evenly (its L / S layers, L = `model.num_layers`, or
the MoE layers after `model.moe.first_dense_layers`) up to REPEATS_CAP, most first, each
(split, R) probed as a split is. Most first: the bubble (S-1)/(R·M+S-1) shrinks with R, so the
first that fits idles least; fewer repeats are tried when more do not fit. On one stage R is 1.
A split with no valid R is skipped with the refusal of the configured one.

A setting the compiler refuses for want of memory (the TPU compiler, `--topology`, checks the
HBM of the slice's chips) does not fit, like one whose compiled peak exceeds `--hbm-gb`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from kiln.commands.compile import GB, OutOfMemory, compile_report
from kiln.config import Config, check_devices, config_from_dict, schema
from kiln.config.axes import MESH_AXES
from kiln.errors import KilnError

TILINGS = (1, 2, 4, 8, 16, 32)
# The most `pipeline.repeats` the search tries: past it the bubble is under (S-1)/(8·M) of
# the iterations, and each further repeat still adds M of them, each with its permute.
REPEATS_CAP = 8


# Policies that keep another's tensors (chosen by name): the search does not compile them.
SAME_AS = {"save_projections": "save_dots"}


def remat_policies() -> list[str]:
    """`model.remat` values from the schema the search tries, least recompute first (none ...
    full), without those of SAME_AS."""
    names = typing.get_args(schema.ModelConfig.model_fields["remat"].annotation)
    middle = [n for n in names if n not in ("none", "full", *SAME_AS)]
    return [n for n in ("none",) if n in names] + middle + [n for n in ("full",) if n in names]


@dataclasses.dataclass(frozen=True)
class Setting:
    remat: str
    num_vocab_tiling: int
    gradient_accumulation_steps: int
    mesh: tuple[tuple[str, int], ...] = ()  # every mesh axis's size when the mesh is searched
    repeats: int | None = None  # pipeline.repeats when searched (with pipeline stages)

    def overrides(self) -> str:
        mesh = "".join(f" mesh.{axis}={size}" for axis, size in self.mesh)
        repeats = "" if self.repeats is None else f" pipeline.repeats={self.repeats}"
        return (
            f"model.remat={self.remat} loss.num_vocab_tiling={self.num_vocab_tiling} "
            f"train.gradient_accumulation_steps={self.gradient_accumulation_steps}{mesh}{repeats}"
        )

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        del fields["mesh"]
        if self.repeats is None:
            del fields["repeats"]
        return {**fields, "mesh": dict(self.mesh)} if self.mesh else fields


@dataclasses.dataclass
class FitResult:
    hbm_gb: float
    # (setting, compiled peak bytes per device, None: the compiler ran out of memory), in order
    trials: list[tuple[Setting, int | None]]
    best: Setting | None
    mesh_axes: tuple[str, ...] = ()  # the searched axes; () = the config's mesh only
    # (split, pipeline.repeats or None when not searched, why the config's rules refuse it)
    skipped: list[tuple[dict[str, int], int | None, str]] = dataclasses.field(default_factory=list)
    searches_repeats: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {
            "hbm_gb": self.hbm_gb,
            "fits": self.best is not None,
            "overrides": None if self.best is None else self.best.overrides(),
            "best": None if self.best is None else self.best.to_json(),
            "trials": [
                {**s.to_json(), "peak_bytes": peak, "fits": _fits(peak, self.hbm_gb)}
                for s, peak in self.trials
            ],
        }
        if self.mesh_axes:
            out["mesh_axes"] = list(self.mesh_axes)
        if self.mesh_axes or self.searches_repeats:
            out["skipped_splits"] = [
                {"mesh": m, **({} if r is None else {"repeats": r}), "reason": why}
                for m, r, why in self.skipped
            ]
        return out


def _fits(peak: int | None, hbm_gb: float) -> bool:
    return peak is not None and peak <= hbm_gb * GB


def with_setting(config: Config, setting: Setting) -> Config:
    """`config` with the settings replaced (validated like any config)."""
    raw = config.model_dump(mode="json")
    raw["model"]["remat"] = setting.remat
    raw["loss"]["num_vocab_tiling"] = setting.num_vocab_tiling
    raw["train"]["gradient_accumulation_steps"] = setting.gradient_accumulation_steps
    for axis, size in setting.mesh:
        raw["mesh"][axis] = size
    if setting.repeats is not None:
        raw["pipeline"]["repeats"] = setting.repeats
    return config_from_dict(raw)


def check_mesh_axes(names: str) -> tuple[str, ...]:
    """`--fit-mesh a,b` as a tuple of distinct mesh axis names; KilnError otherwise."""
    axes = tuple(a.strip() for a in names.split(","))
    for axis in axes:
        if axis not in MESH_AXES:
            raise KilnError(
                f"kiln compile --fit-mesh: unknown mesh axis {axis!r} in {names!r}; "
                f"allowed: {', '.join(MESH_AXES)} (comma-separated)"
            )
    if len(set(axes)) != len(axes):
        raise KilnError(f"kiln compile --fit-mesh: {names!r} names an axis twice")
    return axes


def _factorizations(m: int, k: int) -> list[tuple[int, ...]]:
    """Every k-tuple of positive integers whose product is m, largest first element first."""
    if k == 1:
        return [(m,)]
    divisors = [d for d in range(m, 0, -1) if m % d == 0]
    return [(d, *rest) for d in divisors for rest in _factorizations(m // d, k - 1)]


def mesh_splits(config: Config, num_devices: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Sizes of every mesh axis: the config's own first, then the others (first named largest)."""
    own = check_devices(config, num_devices)
    fixed = math.prod(size for axis, size in own.items() if axis not in axes)
    splits = [own]
    for sizes in _factorizations(num_devices // fixed, len(axes)):
        split = {**own, **dict(zip(axes, sizes, strict=True))}
        if split != own:
            splits.append(split)
    return splits


def repeats_ladder(config: Config, stages: int) -> list[int]:
    """`pipeline.repeats` the search tries on `stages` stages, most first: those that split the
    staged stack evenly, at most REPEATS_CAP; [1] on one stage; the configured one if none does
    (so its refusal says why)."""
    if stages == 1:
        return [1]
    staged = config.model.staged_layers()
    top = min(REPEATS_CAP, staged // stages)
    ladder = [r for r in range(top, 0, -1) if staged % (stages * r) == 0]
    return ladder or [config.pipeline.repeats]


def _valid(config: Config, setting: Setting, num_devices: int) -> bool:
    try:
        check_devices(with_setting(config, setting), num_devices)
    except KilnError:
        return False
    return True


def fit(
    config: Config, devices: list[Any], hbm_gb: float, mesh_axes: tuple[str, ...] = ()
) -> FitResult:
    """Search the settings as the module docstring says; `best` is None if nothing fits."""
    n = len(devices)
    own = check_devices(config, n)
    splits = mesh_splits(config, n, mesh_axes) if mesh_axes else [own]
    searches_repeats = "stage" in mesh_axes or own["stage"] > 1
    layouts: list[tuple[tuple[tuple[str, int], ...], int | None]] = []
    skipped: list[tuple[dict[str, int], int | None, str]] = []
    batch = config.train.global_batch_size
    policy = (config.model.remat, config.loss.num_vocab_tiling)
    divisors = [a for a in range(1, batch + 1) if batch % a == 0]
    for split in splits:
        mesh = tuple(split.items()) if mesh_axes else ()
        for repeats in repeats_ladder(config, split["stage"]) if searches_repeats else [None]:
            if any(
                _valid(config, Setting(policy[0], t, a, mesh, repeats), n)
                for a in divisors
                for t in TILINGS
            ):
                layouts.append((mesh, repeats))
                continue
            reason = "no accumulation and tiling are valid on it"
            try:  # the config's own settings on this split say why
                accum = config.train.gradient_accumulation_steps
                check_devices(with_setting(config, Setting(*policy, accum, mesh, repeats)), n)
            except KilnError as e:
                reason = str(e).replace("\n", "; ")
            skipped.append((split, repeats, reason))
    peaks: dict[Setting, int] = {}
    trials: list[tuple[Setting, int]] = []

    def fits(setting: Setting) -> bool:
        if setting not in peaks:
            try:
                peak = compile_report(with_setting(config, setting), devices).memory["peak"]
            except OutOfMemory:
                peak = None
            peaks[setting] = peak
            trials.append((setting, peak))
        return _fits(peaks[setting], hbm_gb)

    for remat in remat_policies():
        for mesh, repeats in layouts:

            def tilings(accum: int, remat: str = remat, mesh: Any = mesh, r: Any = repeats):
                return [t for t in TILINGS if _valid(config, Setting(remat, t, accum, mesh, r), n)]

            accums = [a for a in range(1, batch + 1) if batch % a == 0 and tilings(a)]
            if not accums:
                continue
            if not fits(Setting(remat, tilings(accums[-1])[-1], accums[-1], mesh, repeats)):
                continue
            lo, hi = 0, len(accums) - 1  # accums[hi] fits
            while lo < hi:
                mid = (lo + hi) // 2
                if fits(Setting(remat, tilings(accums[mid])[-1], accums[mid], mesh, repeats)):
                    hi = mid
                else:
                    lo = mid + 1
            accum, ladder = accums[hi], tilings(accums[hi])
            lo, hi = 0, len(ladder) - 1  # ladder[hi] fits
            while lo < hi:
                mid = (lo + hi) // 2
                if fits(Setting(remat, ladder[mid], accum, mesh, repeats)):
                    hi = mid
                else:
                    lo = mid + 1
            best = Setting(remat, ladder[hi], accum, mesh, repeats)
            return FitResult(hbm_gb, trials, best, mesh_axes, skipped, searches_repeats)
    return FitResult(hbm_gb, trials, None, mesh_axes, skipped, searches_repeats)


def format_fit(result: FitResult) -> str:
    """Every compiled trial, then the settings to paste (or that nothing fits)."""
    lines = [
        f"compiled {len(result.trials)} settings (peak per device, --hbm-gb {result.hbm_gb:g}):"
    ]
    for split, repeats, reason in result.skipped:
        sizes = " x ".join(f"{axis}={size}" for axis, size in split.items())
        sizes += "" if repeats is None else f", pipeline.repeats={repeats}"
        lines.append(f"  skipped mesh {sizes}: {reason}")
    for s, peak in result.trials:
        if peak is None:
            lines.append(f"  {s.overrides():<80} the compiler ran out of device memory")
            continue
        verdict = "fits" if _fits(peak, result.hbm_gb) else "too big"
        lines.append(f"  {s.overrides():<80} {peak / GB:9.3f} GB  {verdict}")
    if result.best is not None:
        lines += ["fits with the least recompute:", result.best.overrides()]
    return "\n".join(lines)
