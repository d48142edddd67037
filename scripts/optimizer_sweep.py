"""Each optimizer (optim.name) on the tiny model, over a small learning-rate sweep: held-out loss
at equal steps and at equal training time, step time and optimizer-state bytes; JSON out.

    python scripts/optimizer_sweep.py [--out-dir runs/optimizers] [--plot docs/img/optimizers.png]
                                      [override ...]

Every run is `kiln train configs/tiny.yaml` (the same data, tokens, seed and schedule) with
`optim.name` and `optim.learning_rate` set and `train.eval_every_steps=25`; overrides (e.g.
`train.seed=1`) go to every run. A finished run is not trained again, so running the script
again only summarises and redraws. Runs are trained one after another: step times are medians
of the logged steps, so another job on the machine slows them all alike, not one optimizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import jax

from kiln.commands.compare import read_run
from kiln.config import load_config
from kiln.model import abstract_state, state_bytes_per_device
from kiln.training.optim import make_optimizer

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny.yaml"
# Learning rates per optimizer: the tiny config's AdamW rate (3e-3) with one step of ~3x either
# side; Lion's updates are +-1 per entry, so its grid sits 3-10x lower, as its authors advise.
GRID = {
    "adamw": (1e-3, 3e-3, 1e-2),
    "muon": (1e-3, 3e-3, 1e-2),
    "adafactor": (1e-3, 3e-3, 1e-2),
    "lion": (1e-4, 3e-4, 1e-3),
}
EVAL_EVERY = 25


def run_name(name: str, lr: float) -> str:
    return f"{name}_lr{lr:g}"


def train(out_dir: Path, name: str, lr: float, overrides: list[str]) -> Path:
    run = run_name(name, lr)
    argv = [
        sys.executable, "-m", "kiln.cli", "train", str(CONFIG),
        f"optim.name={name}", f"optim.learning_rate={lr}", f"train.run_name={run}",
        f"train.output_dir={out_dir}", f"train.eval_every_steps={EVAL_EVERY}",
        "checkpoint.every_steps=0", *overrides,
    ]  # fmt: skip
    subprocess.run(argv, check=True)
    return out_dir / run


def state_bytes(name: str, overrides: list[str]) -> int:
    """Optimizer-state bytes of the tiny model on one device."""
    config = load_config(CONFIG, [f"optim.name={name}", *overrides])
    params = abstract_state(config.model)
    state = jax.eval_shape(make_optimizer(config.optim).init, params)
    return state_bytes_per_device(state, config, {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1})


def summarise(run_dir: Path) -> dict:
    series = read_run(run_dir)
    step_time = float(statistics.median(series["perf/step_time_seconds"][1]))
    evals = {int(s): float(v) for s, v in zip(*series["eval/loss"])}
    steps, losses = series["learning/loss"]
    last = max(evals)
    return {
        "run": run_dir.name,
        "eval_loss": evals[last],
        "eval_step": last,
        "train_loss": float(losses[-1]),
        "train_step": int(steps[-1]),
        "median_step_seconds": step_time,
        "evals": evals,
    }


def at_time(result: dict, seconds: float) -> tuple[int, float]:
    """(step, eval loss) of the last evaluation reached within `seconds` of training."""
    reached = [s for s in result["evals"] if s * result["median_step_seconds"] <= seconds]
    step = max(reached) if reached else min(result["evals"])
    return step, result["evals"][step]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("runs/optimizers"))
    parser.add_argument("--plot", type=Path, default=None, help="kiln compare of the best runs")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = {}
    for name, rates in GRID.items():
        runs = [summarise(train(args.out_dir, name, lr, args.overrides)) for lr in rates]
        for lr, r in zip(rates, runs):
            r["learning_rate"] = lr
        best = min(runs, key=lambda r: r["eval_loss"])
        results[name] = {
            "sweep": {r["run"]: r["eval_loss"] for r in runs},
            "best": best,
            "state_bytes": state_bytes(name, args.overrides),
        }
    # Equal training time: the budget of the fastest best run's last evaluation.
    budget = min(
        r["best"]["eval_step"] * r["best"]["median_step_seconds"] for r in results.values()
    )
    for r in results.values():
        r["equal_time"] = dict(zip(("step", "eval_loss"), at_time(r["best"], budget)))
        del r["best"]["evals"]
    report = {
        "config": str(CONFIG.relative_to(REPO)),
        "overrides": args.overrides,
        "equal_time_budget_seconds": budget,
        "optimizers": results,
    }
    print(json.dumps(report, indent=1))
    if args.plot is not None:
        best_dirs = [str(args.out_dir / r["best"]["run"]) for r in results.values()]
        subprocess.run(
            [sys.executable, "-m", "kiln.cli", "compare", *best_dirs, "--smooth", "3",
             "--metrics", "learning/loss,eval/loss", "--out", str(args.plot)],
            check=True,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
