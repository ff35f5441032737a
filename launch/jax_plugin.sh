#!/usr/bin/env bash
# Installs JAX's accelerator backend into this checkout's .venv, matching the venv's jax.
#
#   bash launch/jax_plugin.sh tpu       # libtpu (Cloud TPU VMs)
#   bash launch/jax_plugin.sh cuda12    # NVIDIA GPUs, driver >= 525
#   bash launch/jax_plugin.sh cuda13    # NVIDIA GPUs, driver >= 580
#   bash launch/jax_plugin.sh none      # CPU only: nothing to do
#
# launch/setup.sh installs jax for the CPU (what the tests and the default run need);
# the cluster launchers (launch/tpu_pod.sh, launch/slurm.sbatch) call this after it, on
# the machines that have the accelerator. Idempotent: a second call only checks that
# the plugin's module imports (about a second). The extra is pinned to the installed
# jax version, so pip never up- or downgrades jax and jaxlib under the rest of the venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"

die() { printf 'jax_plugin.sh: %s\n' "$*" >&2; exit 2; }

(($# == 1)) || die "expected one argument: tpu, cuda12, cuda13 or none (got $#)"
case "$1" in
  tpu) module=libtpu ;;
  cuda12) module=jax_cuda12_plugin ;;
  cuda13) module=jax_cuda13_plugin ;;
  none) exit 0 ;;
  *) die "unknown plugin '$1': expected tpu, cuda12, cuda13 or none" ;;
esac
[[ -x $PY ]] || die "$PY missing: run 'bash launch/setup.sh' first"

if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
  exit 0
fi
version="$("$PY" -c 'import jax; print(jax.__version__)')"
printf '[jax_plugin] installing jax[%s]==%s into %s\n' "$1" "$version" "$ROOT/.venv" >&2
"$PY" -m pip install --disable-pip-version-check -q "jax[$1]==$version"
"$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" ||
  die "jax[$1]==$version installed but '$module' does not import"
