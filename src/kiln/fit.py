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
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from kiln import schema
from kiln.compile import GB, compile_report
from kiln.config import Config, check_devices, config_from_dict
from kiln.errors import KilnError

TILINGS = (1, 2, 4, 8, 16, 32)


def remat_policies() -> list[str]:
    """`model.remat` values from the schema, least recompute first (none ... full)."""
    names = typing.get_args(schema.ModelConfig.model_fields["remat"].annotation)
    middle = [n for n in names if n not in ("none", "full")]
    return [n for n in ("none",) if n in names] + middle + [n for n in ("full",) if n in names]


@dataclasses.dataclass(frozen=True)
class Setting:
    remat: str
    num_vocab_tiling: int
    gradient_accumulation_steps: int

    def overrides(self) -> str:
        return (
            f"model.remat={self.remat} loss.num_vocab_tiling={self.num_vocab_tiling} "
            f"train.gradient_accumulation_steps={self.gradient_accumulation_steps}"
        )


@dataclasses.dataclass
class FitResult:
    hbm_gb: float
    trials: list[tuple[Setting, int]]  # (setting, compiled peak bytes per device), in order
    best: Setting | None

    def to_json(self) -> dict[str, Any]:
        return {
            "hbm_gb": self.hbm_gb,
            "fits": self.best is not None,
            "overrides": None if self.best is None else self.best.overrides(),
            "best": None if self.best is None else dataclasses.asdict(self.best),
            "trials": [
                {**dataclasses.asdict(s), "peak_bytes": peak, "fits": peak <= self.hbm_gb * GB}
                for s, peak in self.trials
            ],
        }


def with_setting(config: Config, setting: Setting) -> Config:
    """`config` with the three settings replaced (validated like any config)."""
    raw = config.model_dump(mode="json")
    raw["model"]["remat"] = setting.remat
    raw["loss"]["num_vocab_tiling"] = setting.num_vocab_tiling
    raw["train"]["gradient_accumulation_steps"] = setting.gradient_accumulation_steps
    return config_from_dict(raw)


def _valid(config: Config, setting: Setting, num_devices: int) -> bool:
    try:
        check_devices(with_setting(config, setting), num_devices)
    except KilnError:
        return False
    return True


def fit(config: Config, devices: list[Any], hbm_gb: float) -> FitResult:
    """Search the settings as the module docstring says; `best` is None if nothing fits."""
    n = len(devices)
    peaks: dict[Setting, int] = {}
    trials: list[tuple[Setting, int]] = []

    def fits(setting: Setting) -> bool:
        if setting not in peaks:
            peaks[setting] = compile_report(with_setting(config, setting), devices).memory["peak"]
            trials.append((setting, peaks[setting]))
        return peaks[setting] <= hbm_gb * GB

    batch = config.train.global_batch_size
    for remat in remat_policies():

        def tilings(accum: int, remat: str = remat) -> list[int]:
            return [t for t in TILINGS if _valid(config, Setting(remat, t, accum), n)]

        accums = [a for a in range(1, batch + 1) if batch % a == 0 and tilings(a)]
        if not accums:
            continue
        if not fits(Setting(remat, tilings(accums[-1])[-1], accums[-1])):
            continue
        lo, hi = 0, len(accums) - 1  # accums[hi] fits
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(Setting(remat, tilings(accums[mid])[-1], accums[mid])):
                hi = mid
            else:
                lo = mid + 1
        accum, ladder = accums[hi], tilings(accums[hi])
        lo, hi = 0, len(ladder) - 1  # ladder[hi] fits
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(Setting(remat, ladder[mid], accum)):
                hi = mid
            else:
                lo = mid + 1
        return FitResult(hbm_gb, trials, Setting(remat, ladder[hi], accum))
    return FitResult(hbm_gb, trials, None)


def format_fit(result: FitResult) -> str:
    """Every compiled trial, then the settings to paste (or that nothing fits)."""
    lines = [
        f"compiled {len(result.trials)} settings (peak per device, --hbm-gb {result.hbm_gb:g}):"
    ]
    for s, peak in result.trials:
        verdict = "fits" if peak <= result.hbm_gb * GB else "too big"
        lines.append(f"  {s.overrides():<80} {peak / GB:9.3f} GB  {verdict}")
    if result.best is not None:
        lines += ["fits with the least recompute:", result.best.overrides()]
    return "\n".join(lines)
