#!/usr/bin/env bash
# The prepared check of a GPU window: full-pi0 PPO update memory, pipeline efficiency and
# profile (with --steps, act latency and a PPO minibatch's MFU too), into one JSON file
# (jaxvla/bench/gpu_check.py says what each step measures and how long it may take: a
# window's default steps stay under 10 minutes).
#
#   bash launch/gpu_check.sh --prepare              # once, where pip can download
#   bash launch/gpu_check.sh --out=DIR              # on the GPU machine, offline
#   bash launch/gpu_check.sh --dry_run --out=DIR    # any machine: the tiny pi0, about a minute
#
# Other flags go to `python -m jaxvla.bench.gpu_check` (--steps, --profile_dir, --cache_dir,
# --pipeline_flag).
#
# Python: $PYTHON if set, else this checkout's .venv (launch/setup.sh, then
# launch/jax_plugin.sh cuda12|cuda13 on a GPU machine with a network), else python3: an
# accelerator image that already has JAX for its device, flax, optax and orbax. What the
# check needs beyond those (gpu_check.OFFLINE_PACKAGES) comes from third_party/wheels/,
# which --prepare fills with the versions this checkout's .venv runs. The wheels are put
# on PYTHONPATH from a temporary folder: nothing is installed into the interpreter and
# nothing is downloaded.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/third_party/wheels"
die() { printf 'gpu_check.sh: %s\n' "$*" >&2; exit 2; }
cd "$ROOT"

if [[ ${1:-} == --prepare ]]; then
  (($# == 1)) || die "--prepare takes no other arguments"
  [[ -x .venv/bin/python ]] || die ".venv missing: run 'bash launch/setup.sh' first"
  pins="$(.venv/bin/python -c '
from importlib import metadata
from jaxvla.bench import gpu_check
print(" ".join(f"{p}=={metadata.version(p)}" for p in gpu_check.OFFLINE_PACKAGES))')"
  mkdir -p "$WHEELS"
  # shellcheck disable=SC2086  # one word per pin
  .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps \
    --only-binary=:all: -d "$WHEELS" $pins
  printf '[gpu_check] wheels for %s in %s\n' "$pins" "$WHEELS" >&2
  exit 0
fi

if [[ -n ${PYTHON:-} ]]; then
  PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi
command -v "$PY" >/dev/null || die "no Python interpreter '$PY'"

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile \
    --target "$site" "${wheels[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
missing="$("$PY" -c '
import importlib.util
mods = ("jax", "flax", "optax", "orbax.checkpoint", "ml_collections", "absl")
print(" ".join(m for m in mods if importlib.util.find_spec(m.split(".")[0]) is None))')"
[[ -z $missing ]] || die "$PY lacks: $missing (where pip can download, run 'bash launch/gpu_check.sh --prepare' and bring third_party/wheels/ along)"

exec "$PY" -m jaxvla.bench.gpu_check "$@"
