# shellcheck shell=bash
# Run-time environment of jaxvla: the one place where it is defined.
#
#   source launch/env.sh          # from any cwd, in bash
#
# Sourced by launch/setup.sh, launch/run.sh and launch/test.sh. It only exports
# variables (no `set -e`, no installs), so sourcing it into an interactive shell is safe.
# Values the user has already exported win, except the library paths that point into
# this checkout. Nothing here depends on the machine beyond what setup.sh wrote into
# the checkout (third_party/prefix/, .cache/).

JAXVLA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export JAXVLA_ROOT
_jaxvla_prefix="$JAXVLA_ROOT/third_party/prefix"

# --- Vulkan (SAPIEN / ManiSkill3) ------------------------------------------------------
# SAPIEN needs a Vulkan device even for state observations. On a machine without a GPU
# that is Mesa's lavapipe; Debian 12's own (Mesa 22) lacks descriptorBindingPartiallyBound,
# so setup.sh unpacks Mesa 25's lavapipe from bookworm-backports into the prefix and
# writes an ICD json with the absolute library path. A GPU machine with its own ICD can
# override VK_ICD_FILENAMES before sourcing this file.
if [[ -f "$_jaxvla_prefix/lvp_icd.json" ]]; then
  export VK_ICD_FILENAMES="${VK_ICD_FILENAMES:-$_jaxvla_prefix/lvp_icd.json}"
fi
# The prefix's newer libdrm must be found before the system's; the dynamic loader only
# reads LD_LIBRARY_PATH at process start, so this has to be set before Python starts.
if [[ -d "$_jaxvla_prefix/lib" ]]; then
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$_jaxvla_prefix/lib:"*) ;;  # already there (file sourced twice)
    *) export LD_LIBRARY_PATH="$_jaxvla_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
fi

# --- OpenGL (MuJoCo / robosuite / LIBERO) ------------------------------------------------
# Headless rendering: EGL (Mesa llvmpipe on CPU, the vendor driver on a GPU). setup.sh
# probes EGL once and records "osmesa" instead only if EGL cannot create a context.
_jaxvla_gl=egl
if [[ -f "$_jaxvla_prefix/mujoco_gl" ]]; then
  _jaxvla_gl="$(<"$_jaxvla_prefix/mujoco_gl")"
fi
export MUJOCO_GL="${MUJOCO_GL:-$_jaxvla_gl}"
export PYOPENGL_PLATFORM="${PYOPENGL_PLATFORM:-$MUJOCO_GL}"  # must match MUJOCO_GL

# --- Simulators' prompts -----------------------------------------------------------------
# LIBERO asks on stdin where its datasets go unless $LIBERO_CONFIG_PATH/config.yaml
# exists; setup.sh pre-writes it inside the checkout (.cache/ is gitignored).
export LIBERO_CONFIG_PATH="${LIBERO_CONFIG_PATH:-$JAXVLA_ROOT/.cache/libero}"
# ManiSkill asks before downloading assets; offline tasks need none, so never ask.
export MS_SKIP_ASSET_DOWNLOAD_PROMPT=1

# --- Threads and memory ------------------------------------------------------------------
# Simulators run one env per worker process; one OpenMP thread each avoids
# oversubscribing the cores (XLA's CPU backend uses its own thread pool, not OpenMP).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Rollout and learner may share one accelerator: allocate on demand, not 75% up front.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"

unset _jaxvla_prefix _jaxvla_gl
