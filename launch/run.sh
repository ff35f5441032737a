#!/usr/bin/env bash
# Train / evaluate with jaxvla.
#
#   bash launch/run.sh [--config=configs/X.py[:variant]] [--config.key=value ...] [--workdir=DIR]
#
# Runs the set-up (a few seconds when nothing changed), exports the run-time environment
# (launch/env.sh), then hands over to `python -m jaxvla.main`. Without --config the default
# config is used; without --workdir a fresh workdirs/<timestamp> is made. All other
# arguments go to jaxvla.main unchanged.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Stdin stays with the user's terminal for the training run, but the set-up never reads it.
bash "$ROOT/launch/setup.sh" </dev/null
# shellcheck source=launch/env.sh
source "$ROOT/launch/env.sh"

have_config=0
have_workdir=0
for arg in "$@"; do
  case "$arg" in
    --config=* | --config) have_config=1 ;;  # not --config.key=value overrides
    --workdir=* | --workdir) have_workdir=1 ;;
  esac
done

defaults=()
if ((!have_config)); then
  defaults+=("--config=$ROOT/configs/default.py")
fi
if ((!have_workdir)); then
  defaults+=("--workdir=$ROOT/workdirs/$(date +%Y%m%d-%H%M%S)")
fi

# Relative paths in the user's arguments keep meaning what they meant in their cwd.
exec "$ROOT/.venv/bin/python" -m jaxvla.main "${defaults[@]}" "$@"
