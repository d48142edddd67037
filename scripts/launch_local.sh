#!/usr/bin/env bash
# Start N kiln processes on this machine, as N hosts of one multi-host run would be started.
#
#   scripts/launch_local.sh [--distill | --teacher-logits] [--devices-per-process K] N CONFIG [ARGS ...]
#
# Each process gets K simulated CPU devices (default 8/N), the coordinator is process 0 on
# 127.0.0.1 and a free port, and process i's output goes to the console prefixed "[i]".
# Exits with the first non-zero exit code; the other processes are then killed at once.
# Runs kiln with $PYTHON, else the repository's .venv/bin/python, else python3 on PATH.
set -euo pipefail

usage() {
  echo "usage: $0 [--distill | --teacher-logits] [--devices-per-process K] N CONFIG [ARGS ...]" >&2
  exit 2
}

command=train
per_process=
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --distill) command=distill; shift ;;
    --teacher-logits) command=teacher-logits; shift ;;
    --devices-per-process) [[ $# -ge 2 ]] || usage; per_process=$2; shift 2 ;;
    *) usage ;;
  esac
done
[[ $# -ge 2 ]] || usage
n=$1 config=$2
shift 2
[[ $n =~ ^[1-9][0-9]*$ ]] || { echo "launch_local: N must be a positive integer, got '$n'" >&2; exit 2; }
if [[ -z $per_process ]]; then
  (( 8 % n == 0 )) || { echo "launch_local: 8 devices do not split over $n processes; give --devices-per-process" >&2; exit 2; }
  per_process=$(( 8 / n ))
fi
[[ $per_process =~ ^[1-9][0-9]*$ ]] || { echo "launch_local: --devices-per-process must be a positive integer" >&2; exit 2; }

repo=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n ${PYTHON:-} ]]; then
  python=$PYTHON
elif [[ -x $repo/.venv/bin/python ]]; then
  python=$repo/.venv/bin/python
else
  python=$(command -v python3 || echo python3)
fi
"$python" -c 'import kiln' 2>/dev/null || {
  echo "launch_local: $python cannot import kiln; install kiln into $repo/.venv (see README.md), activate the environment that has it, or set PYTHON=/path/to/python" >&2
  exit 2
}
# This script decides the device count: drop one that the environment may already set.
xla_flags=$(sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g' <<< "${XLA_FLAGS:-}")
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}
# Ctrl-C or SIGTERM: every process gets SIGTERM, they agree on a step, save and exit 0.
# A second one kills them.
signalled=0
on_signal() {
  signalled=$(( signalled + 1 ))
  if (( signalled == 1 )); then
    echo "launch_local: stopping; all processes save a checkpoint at one step (again to kill)" >&2
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  else
    stop_all
  fi
}
trap on_signal INT TERM

for (( i = 0; i < n; i++ )); do
  XLA_FLAGS="$xla_flags --xla_force_host_platform_device_count=$per_process" \
  JAX_PLATFORMS=cpu \
    "$python" -u -m kiln.cli "$command" "$config" "$@" \
      "distributed.coordinator_address=127.0.0.1:$port" \
      "distributed.num_processes=$n" \
      "distributed.process_id=$i" \
      > >(sed -u "s/^/[$i] /") 2> >(sed -u "s/^/[$i] /" >&2) &
  pids+=("$!")
done

status=0
running=("${pids[@]}")
while (( ${#running[@]} > 0 )); do
  finished=
  set +e
  wait -n -p finished "${running[@]}"
  code=$?
  set -e
  [[ -n ${finished:-} ]] || continue  # woken by a signal, not by a process
  rest=()
  for pid in "${running[@]}"; do
    if [[ $pid != "$finished" ]]; then rest+=("$pid"); fi
  done
  running=("${rest[@]}")
  for (( i = 0; i < n; i++ )); do
    if [[ ${pids[i]} == "$finished" ]]; then index=$i; fi
  done
  if (( code != 0 && status == 0 )); then
    status=$code
    echo "launch_local: process $index exited with code $code; stopping the others" >&2
    stop_all
  fi
done
exit "$status"
