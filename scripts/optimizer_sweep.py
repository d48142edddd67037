"""Each optimizer (optim.name) on the tiny model, over a small learning-rate sweep: held-out loss
at equal steps and, given step times, at equal training time; JSON out.

    python benchmarks/optimizer_step.py > step_times.json
    python scripts/optimizer_sweep.py [--out-dir runs/optimizers] [--plot FILE.png]
                                      [--step-times step_times.json] [override ...]

Every run is `kiln train configs/tiny.yaml` (the same data, tokens, seed and schedule) with
`optim.name` and `optim.learning_rate` set and `train.eval_every_steps=25`; overrides (e.g.
`train.seed=1`) go to every run. A finished run is not trained again, so running the script
again only summarises and redraws. The runs are trained one after another, so their logged
step times depend on whatever else the machine did meanwhile; equal training time is taken
from `benchmarks/optimizer_step.py`, which times the optimizers' steps in alternating rounds
of one process.
"""

from __future__ import annotations

import argparse
import json
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
# Learning rates per optimizer, steps of ~3x around the tiny config's AdamW rate (3e-3); Lion's
# updates are +-1 per entry, so its grid sits 3-10x lower, as its authors advise.
GRID = {
    "adamw": (3e-4, 1e-3, 3e-3, 1e-2),
    "muon": (1e-3, 3e-3, 1e-2, 3e-2),
    "adafactor": (3e-4, 1e-3, 3e-3, 1e-2),
    "lion": (1e-4, 3e-4, 1e-3, 3e-3),
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
    subprocess.run(argv, check=True, stdout=sys.stderr)  # stdout holds only the JSON
    return out_dir / run


def state_bytes(name: str, overrides: list[str]) -> int:
    """Optimizer-state bytes of the tiny model on one device."""
    config = load_config(CONFIG, [f"optim.name={name}", *overrides])
    params = abstract_state(config.model)
    state = jax.eval_shape(make_optimizer(config.optim).init, params)
    return state_bytes_per_device(state, config, {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1})


def summarise(run_dir: Path) -> dict:
    series = read_run(run_dir)
    evals = {int(s): float(v) for s, v in zip(*series["eval/loss"])}
    steps, losses = series["learning/loss"]
    last = max(evals)
    return {
        "run": run_dir.name,
        "eval_loss": evals[last],
        "eval_step": last,
        "train_loss": float(losses[-1]),
        "train_step": int(steps[-1]),
        "evals": evals,
    }


def at_time(evals: dict[int, float], step_seconds: float, seconds: float) -> dict:
    """Step and eval loss of the last evaluation reached within `seconds` of training."""
    reached = [s for s in evals if s * step_seconds <= seconds]
    step = max(reached) if reached else min(evals)
    return {"step": step, "eval_loss": evals[step]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("runs/optimizers"))
    parser.add_argument("--plot", type=Path, default=None, help="kiln compare of the best runs")
    parser.add_argument(
        "--step-times", type=Path, default=None, help="benchmarks/optimizer_step.py's JSON"
    )
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
    report = {"config": str(CONFIG.relative_to(REPO)), "overrides": args.overrides}
    if args.step_times is not None:
        # Equal training time: what the fastest of the best runs takes to its last evaluation.
        timed = json.loads(args.step_times.read_text())["optimizers"]
        seconds = {name: timed[name]["step_seconds"] for name in results}
        budget = min(r["best"]["eval_step"] * seconds[n] for n, r in results.items())
        report["equal_time_budget_seconds"] = budget
        for name, r in results.items():
            r["step_seconds"] = seconds[name]
            r["equal_time"] = at_time(r["best"]["evals"], seconds[name], budget)
    for r in results.values():
        del r["best"]["evals"]
    report["optimizers"] = results
    print(json.dumps(report, indent=1))
    if args.plot is not None:
        best_dirs = [str(args.out_dir / r["best"]["run"]) for r in results.values()]
        subprocess.run(
            [sys.executable, "-m", "kiln.cli", "compare", *best_dirs, "--smooth", "3",
             "--metrics", "learning/loss,eval/loss", "--out", str(args.plot)],
            check=True, stdout=sys.stderr,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
