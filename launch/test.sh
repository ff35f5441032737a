#!/usr/bin/env bash
# The test suite. `bash launch/test.sh` (the README's test command, what .ci/run calls) runs
# four steps that must all pass, 20 to 23 minutes on a 2-core CPU machine (set-up included):
#   (a) fast       pytest -m "not sim and not slow and not multihost and not learning" -n WORKERS
#                  the unit and integration tests (CPU, tiny models)
#   (b) multihost  pytest -m multihost        2 processes joined by jax.distributed
#   (c) slow       pytest -m slow -n WORKERS  runs of a minute or more: fault injection, replay,
#                  the installed package, the notebook, and the learner check (a broken
#                  learner fails it in minutes)
#   (d) sim        pytest -m sim -n WORKERS   real simulators (ManiSkill3, LIBERO), tests/sim/
# `bash launch/test.sh --only=learning` runs the fifth step, apart from the others:
#   (e) learning   pytest -m learning -n WORKERS
#                  the long learning runs (ManiSkill3 SFT -> residual RL from state and
#                  SFT -> latent-head RL from the camera, async parity, the planner's
#                  measured check), about 36 minutes alone on 2 cores.
#                  Run it before calling done a change to models/, learner/, algorithms/, rollout/,
#                  runtime/ or a recipe config (docs/guides/contributing.md).
# Steps (a), (c), (d) and (e) run their tests in parallel processes (pytest-xdist), one per
# core up to 4; (b)'s tests each start two processes of their own, so they run one at a time.
#
#   bash launch/test.sh [--only=fast|multihost|slow|sim|learning] [pytest arguments ...]
#
# Extra arguments go to every pytest run, from the repository root: options (-x, -v,
# -k EXPR, --durations=0) and, if given, test paths, which then replace the step's default
# path (pytest only falls back to `testpaths` when no path is given). So to run just the
# simulator tests use --only=sim: `test.sh tests/sim` would make steps (a) to (c) select nothing,
# which fails (see below).
# "No tests collected" (pytest exit code 5) counts as a failure, so a step whose tests
# vanished (bad marker, bad -k, an import-time skip) cannot pass silently.
# The last line printed is the time table: each step's wall time and CPU-seconds, the
# set-up's and the whole command's, also when a step failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

only=all
pytest_args=()
for arg in "$@"; do
  case "$arg" in
    --only=fast | --only=multihost | --only=slow | --only=sim | --only=learning)
      only="${arg#--only=}" ;;
    --only=*) echo "test.sh: --only takes fast, multihost, slow, sim or learning, not '${arg#--only=}'" >&2
      exit 2 ;;
    *) pytest_args+=("$arg") ;;
  esac
done

# The time table (printed on exit, whatever the exit): "name wall_s cpu_s" per step.
times_file=$(mktemp)
table=()
print_table() {
  local line="=== test.sh: times:" entry name wall cpu
  for entry in "${table[@]}"; do
    read -r name wall cpu <<<"$entry"
    line+=" $name ${wall} s / ${cpu} CPU-s;"
  done
  children_cpu_s
  echo "$line whole $SECONDS s / ${cpu_s} CPU-s" >&2
  rm -f "$times_file"
}
trap print_table EXIT

# children_cpu_s: sets cpu_s to the user + system CPU seconds of this shell's finished
# children (bash's `times`, second line "XmY.YYYs XmY.YYYs"), whole seconds. `times`
# must run in this shell (a subshell's children are its own), hence the file.
children_cpu_s() {
  times >"$times_file"
  cpu_s=$(awk 'NR == 2 {
    total = 0
    for (i = 1; i <= 2; i++) { split($i, p, "m"); total += p[1] * 60 + p[2] }
    printf "%d", total }' "$times_file")
}

bash "$ROOT/launch/setup.sh" </dev/null
children_cpu_s
table+=("set-up $SECONDS $cpu_s")
# shellcheck source=launch/env.sh
source "$ROOT/launch/env.sh"
cd "$ROOT"  # testpaths and the paths in pytest_args are relative to the root

# XLA programs are cached on disk, keyed by the program, jax's version and flags: one that
# many tests compile alike (the tiny policy's act, value and update) is compiled once, and
# the subprocesses of the resume and multi-host tests reuse it. A cache entry can only
# replace a compilation of the same program, so no test checks less.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$ROOT/.cache/jax}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1

# The fast, multi-host and simulator steps check programs against each other within one
# run, never their speed: XLA's backend optimisations only add compile time there (a
# third of the fast step), and so do XLA:CPU's MLIR fusion emitters (the tiny pi0's BC
# gradient compiled in 4.3 s with them, 1.5 s with the classic ones; the LIBERO training
# loop took 76 s instead of 98). The slow and learning steps keep the defaults (the learner
# check and the learning runs execute for minutes).
fast_xla_flags="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# The slow step's tests whose runs are short (fault injection, the installed package, the
# notebook) use them too (tests/conftest.py: fast_xla_env).
export JAXVLA_TEST_FAST_XLA_FLAGS=$fast_xla_flags
# pytest-xdist processes: one per core up to 4 (JAXVLA_TEST_WORKERS overrides; 0: in-process).
# The slow and sim steps are CPU-bound too (their runs use about 1.4 cores each): two at
# a time finish those steps 10-15% sooner on 2 cores.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # (env.sh sets OMP_NUM_THREADS=1)
workers="${JAXVLA_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"

failed=()

# run_step NAME PYTEST_ARGS...: runs pytest with stdin closed (a test that prompts fails
# instead of hanging) and records a failure for any non-zero exit, 5 included.
run_step() {
  local name=$1 rc=0 start=$SECONDS cpu0
  shift
  echo "=== test.sh: step '$name': pytest $*" >&2
  children_cpu_s
  cpu0=$cpu_s
  "$ROOT/.venv/bin/python" -m pytest "$@" </dev/null || rc=$?
  children_cpu_s
  echo "=== test.sh: step '$name' took $((SECONDS - start)) s, $((cpu_s - cpu0)) CPU-s" >&2
  table+=("$name $((SECONDS - start)) $((cpu_s - cpu0))")
  if ((rc == 5)); then
    echo "=== test.sh: step '$name' collected no tests; counted as a failure" >&2
  fi
  if ((rc != 0)); then
    failed+=("$name (exit $rc)")
  fi
}

if [[ $only == all || $only == fast ]]; then
  XLA_FLAGS=$fast_xla_flags run_step fast -m "not sim and not slow and not multihost and not learning" \
    -n "$workers" --dist worksteal "${pytest_args[@]}"
fi
if [[ $only == all || $only == multihost ]]; then
  XLA_FLAGS=$fast_xla_flags run_step multihost -m multihost "${pytest_args[@]}"
fi
if [[ $only == all || $only == slow ]]; then
  run_step slow -m slow -n "$workers" --dist worksteal "${pytest_args[@]}"
fi
if [[ $only == all || $only == sim ]]; then
  XLA_FLAGS=$fast_xla_flags run_step sim -m sim -o testpaths=tests/sim -n "$workers" \
    --dist worksteal "${pytest_args[@]}"
fi
# Only when asked for: the long learning runs keep XLA's default flags (they execute for
# minutes; unoptimised code runs them 1.6 times slower). -rP prints what each passed run
# printed (its SFT and final success, env steps, wall time): the figures, not only a pass.
if [[ $only == learning ]]; then
  run_step learning -m learning -n "$workers" --dist worksteal -rP "${pytest_args[@]}"
fi

if ((${#failed[@]})); then
  echo "=== test.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "=== test.sh: all steps passed" >&2
