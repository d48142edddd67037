#!/usr/bin/env bash
# z-loss A/B on the tiny model: train configs/experiments/zloss_ab/{zloss_off,zloss_1e-4}.yaml
# on the embedded corpus (the Python stdlib) and plot loss, z-loss, LM-head norm and
# final-norm scale of both runs in one figure.
#
#   scripts/zloss_ab.sh [OUT.png] [override ...]    # default OUT: runs/zloss_ab.png
#
# Overrides (e.g. train.seed=1) go to both runs. A finished run is not trained again, so
# running the script again only redraws the plot. Runs kiln with $PYTHON, else the
# repository's .venv/bin/python, else python3 on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n ${PYTHON:-} ]]; then
  python=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  python=.venv/bin/python
else
  python=$(command -v python3 || echo python3)
fi
"$python" -c 'import kiln' 2>/dev/null || {
  echo "zloss_ab: $python cannot import kiln; install kiln into $PWD/.venv (see README.md), activate the environment that has it, or set PYTHON=/path/to/python" >&2
  exit 2
}
kiln=("$python" -m kiln.cli)
out=${1:-runs/zloss_ab.png}
shift || true
runs=()
for arm in zloss_off zloss_1e-4; do
  config=configs/experiments/zloss_ab/$arm.yaml
  "${kiln[@]}" train "$config" "$@"
  # The run directory is {train.output_dir}/{train.run_name} of the resolved config.
  runs+=("$("${kiln[@]}" config "$config" "$@" | awk '
    /^[a-z]/ { section = $1 }
    section == "train:" && $1 == "run_name:" { name = $2 }
    section == "train:" && $1 == "output_dir:" { dir = $2 }
    END { print dir "/" name }')")
done
"${kiln[@]}" compare "${runs[@]}" \
  --metrics learning/loss,learning/z_loss,learning/lm_head_norm,learning/final_norm_scale \
  --smooth 5 --out "$out"
echo "wrote $out"
