#!/usr/bin/env bash
# A jaxvla job on a Cloud TPU VM slice, from a machine with gcloud: creates or reuses
# the slice, puts this checkout on every worker, runs the set-up there, starts
# launch/run.sh on all workers at once (joined by JAX's TPU detection,
# --config.distributed.cluster_auto=True) and streams worker 0's log.
#
#   bash launch/tpu_pod.sh up --name=NAME --zone=ZONE --accelerator_type=TYPE \
#       --workdir=DIR [options] [-- RUN_ARGS ...]
#   bash launch/tpu_pod.sh logs   --name=NAME --zone=ZONE   # stream worker 0's log again
#   bash launch/tpu_pod.sh kill   --name=NAME --zone=ZONE   # Ctrl-C the run on every worker
#   bash launch/tpu_pod.sh stop   --name=NAME --zone=ZONE   # stop the slice (gcloud ... stop)
#   bash launch/tpu_pod.sh delete --name=NAME --zone=ZONE   # delete the slice
#
# Example (a v5p slice of 8 VMs, the workdir on a Filestore share):
#   bash launch/tpu_pod.sh up --name=vla --zone=us-east5-a --accelerator_type=v5p-64 \
#     --spot --nfs=10.0.0.2:/share --workdir=runs/pi0-libero -- \
#     --config=configs/tpu.py:pi0 \
#     --config.model.tokenizer_path=/mnt/jaxvla/paligemma_tokenizer.model
#
# `up`, step by step (every step is idempotent, so `up` again continues where it stopped):
#   1. gcloud compute tpus tpu-vm describe: READY is reused (its accelerator type must
#      match), STOPPED is started, PREEMPTED or TERMINATED (spot / preemptible slices
#      cannot restart) is deleted and created again, absent is created.
#   2. The code: by default the checkout's tracked files as they are now, uncommitted
#      changes included (`git stash create` + `git archive`; untracked files are not
#      sent), copied with `gcloud ... scp --worker=all` and unpacked into --remote_dir
#      (its .venv is kept). With --git_url, every worker clones or fetches that URL and
#      checks out --ref instead.
#   3. On every worker: the NFS share mounted (with --nfs), launch/setup.sh, and
#      launch/jax_plugin.sh tpu (libtpu for the venv's jax).
#   4. Worker 0 looks for a finished checkpoint in the workdir: if there is one, every
#      worker gets --config.resume=True (a slice recreated after a preemption continues).
#   5. On every worker at once: launch/run.sh RUN_ARGS --config.distributed.cluster_auto=True
#      --workdir=DIR, detached (setsid nohup), its log in <remote_dir>/.cache/tpu_pod/run.log.
#   6. Worker 0's log is streamed until the run ends (exit status: the run's). Ctrl-C
#      stops the streaming only; the run goes on.
#
# Flags (--key=value):
#   --name=NAME               the slice (TPU node) name                        [required]
#   --zone=ZONE               its zone                                         [required]
#   --project=PROJECT         its project (default: gcloud's configured one)
#   --accelerator_type=TYPE   e.g. v5p-64, v5litepod-16, v6e-32, v4-32          [required by up]
#   --version=RUNTIME         TPU software version (default by TYPE: v2-alpha-tpuv6e,
#                             v2-alpha-tpuv5, v2-alpha-tpuv5-lite, tpu-ubuntu2204-base)
#   --spot                    create a spot slice (preemptible, no time limit)
#   --preemptible             create a preemptible slice (time-limited)
#   --create_flag=FLAG        one more flag for `tpu-vm create`, e.g. --create_flag=--network=NET
#                             (repeatable)
#   --workdir=DIR             the run's workdir, on a file system every worker mounts
#                             (absolute, or relative to --mount with --nfs). gs:// is
#                             refused: jaxvla's workdir is a POSIX directory  [required by up]
#   --nfs=SERVER:/EXPORT      mount this NFS share (e.g. Filestore) on every worker at --mount
#   --mount=DIR               where (default /mnt/jaxvla)
#   --remote_dir=DIR          the checkout on each worker (default jaxvla, in the home directory)
#   --git_url=URL             clone this repository on the workers instead of copying
#   --ref=REF                 the commit to run (default: the working tree; with --git_url,
#                             this checkout's HEAD commit, which must be pushed)
#   --detach                  start the run and return without streaming its log
#   --dry_run                 print every command instead of running it (gcloud not needed)
#   -h, --help                this text
# RUN_ARGS (after --) go to launch/run.sh; without --config there, configs/tpu.py is used.
# --workdir, --config.resume and --config.distributed.{cluster_auto,coordinator_address,
# num_processes,process_id} are the launcher's and refused there.
#
# gcloud runs a --worker=all command on every worker concurrently; for that it wants your
# key in an ssh agent (`ssh-add ~/.ssh/google_compute_engine`). The workers must share
# one uid (gcloud's ssh keys give them the same user) to write one workdir.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE_DIR=".cache/tpu_pod"  # On each worker, under the checkout: pid, log, exit status.

die() { printf 'tpu_pod.sh: %s\n' "$*" >&2; exit 2; }
log() { printf '[tpu_pod] %s\n' "$*" >&2; }

# Shell-quotes its arguments into one line (what --command and --dry_run print): words
# of plain characters as they are, others in single quotes.
quote() {
  local out="" a q="'"
  for a in "$@"; do
    if [[ -n $a && $a =~ ^[-A-Za-z0-9_./:=,@%+]+$ ]]; then
      out+="${out:+ }$a"
    else
      out+="${out:+ }'${a//$q/$q\\$q$q}'"
    fi
  done
  printf '%s' "$out"
}

# ============================================================ on a worker ==
# Subcommands the launcher runs on the workers through `gcloud ... ssh --command`, in the
# copied checkout. Not meant to be typed.

worker_setup() { # [--nfs=SERVER:/EXPORT --mount=DIR --workdir=DIR]
  local nfs="" mount="" workdir="" arg
  for arg in "$@"; do
    case "$arg" in
      --nfs=*) nfs="${arg#--nfs=}" ;;
      --mount=*) mount="${arg#--mount=}" ;;
      --workdir=*) workdir="${arg#--workdir=}" ;;
      *) die "_setup: unexpected argument $arg" ;;
    esac
  done
  if [[ -n $nfs ]]; then
    if ! command -v mount.nfs >/dev/null; then
      sudo DEBIAN_FRONTEND=noninteractive apt-get update -q
      sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q nfs-common
    fi
    sudo mkdir -p "$mount"
    mountpoint -q "$mount" || sudo mount -t nfs -o rw,hard,noatime "$nfs" "$mount"
  fi
  if [[ -n $workdir ]]; then
    # A fresh share's root belongs to root; the run writes as this worker's user.
    [[ -d $workdir && -w $workdir ]] ||
      { sudo mkdir -p "$workdir" && sudo chown "$(id -u):$(id -g)" "$workdir"; }
  fi
  # The lavapipe step of setup.sh fetches Mesa from Debian backports, which the TPU
  # images (Ubuntu) do not have; LIBERO renders through EGL and needs no Vulkan.
  JAXVLA_SKIP_LAVAPIPE="${JAXVLA_SKIP_LAVAPIPE:-1}" bash "$ROOT/launch/setup.sh" </dev/null
  bash "$ROOT/launch/jax_plugin.sh" tpu
}

worker_has_checkpoint() { # WORKDIR: prints 'jaxvla-checkpoint=yes' or '=no'
  (($# == 1)) || die "_has_checkpoint: expected the workdir"
  if "$ROOT/.venv/bin/python" -c 'import sys
from jaxvla.storage.checkpoint import has_checkpoint
sys.exit(0 if has_checkpoint(sys.argv[1]) else 1)' "$1/checkpoints"; then
    echo "jaxvla-checkpoint=yes"
  else
    echo "jaxvla-checkpoint=no"
  fi
}

worker_running_pid() { # prints the pid of this worker's run if it is alive
  local pidfile="$ROOT/$STATE_DIR/run.pid" pid
  [[ -f $pidfile ]] || return 1
  pid="$(<"$pidfile")"
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

worker_start() { # -- RUN_ARGS: starts launch/run.sh detached from the ssh session
  [[ ${1:-} == -- ]] && shift
  local pid
  if pid="$(worker_running_pid)"; then
    die "$(hostname): a run is already going (pid $pid); 'tpu_pod.sh logs' follows it," \
      "'tpu_pod.sh kill' stops it"
  fi
  mkdir -p "$ROOT/$STATE_DIR"
  rm -f "$ROOT/$STATE_DIR/run.rc" "$ROOT/$STATE_DIR/run.pid"
  # Relative paths in RUN_ARGS (--config=configs/tpu.py) name files of the checkout;
  # ssh starts commands in the home directory.
  cd "$ROOT"
  # setsid + nohup: the run outlives the ssh connection that started it.
  setsid nohup bash "$ROOT/launch/tpu_pod.sh" _run -- "$@" \
    >"$ROOT/$STATE_DIR/run.log" 2>&1 </dev/null &
  local i started=0
  for i in $(seq 50); do # _run writes the pid of the training process
    if [[ -s $ROOT/$STATE_DIR/run.pid ]]; then
      started=1
      break
    fi
    sleep 0.1
  done
  ((started)) ||
    die "$(hostname): the run did not start within $((i / 10)) s; see $ROOT/$STATE_DIR/run.log"
  log "$(hostname): started (pid $(<"$ROOT/$STATE_DIR/run.pid"), log $ROOT/$STATE_DIR/run.log)"
}

worker_run() { # -- RUN_ARGS (in the detached session)
  [[ ${1:-} == -- ]] && shift
  local rc=0
  # Job control on: without it bash starts a background command with SIGINT ignored,
  # and `kill` (SIGINT: stop after the current update) must reach the trainer.
  set -m
  bash "$ROOT/launch/run.sh" "$@" &  # run.sh execs python: this pid is the trainer's
  echo "$!" >"$ROOT/$STATE_DIR/run.pid"
  wait "$!" || rc=$?
  echo "$rc" >"$ROOT/$STATE_DIR/run.rc"
  return "$rc"
}

worker_logs() { # streams this worker's log until its run ends; exits with the run's status
  local logfile="$ROOT/$STATE_DIR/run.log" pid
  [[ -f $logfile ]] || die "$(hostname): no run has been started here ($logfile missing)"
  if pid="$(worker_running_pid)"; then
    tail -n +1 -F --pid="$pid" "$logfile"
  else
    cat "$logfile"
  fi
  local rc
  rc="$(cat "$ROOT/$STATE_DIR/run.rc" 2>/dev/null || echo 1)"
  log "$(hostname): the run ended with exit status $rc"
  return "$rc"
}

worker_kill() { # SIGINT to the trainer: it stops after the current update, with a checkpoint
  local pid
  if pid="$(worker_running_pid)"; then
    kill -INT "$pid"
    log "$(hostname): sent SIGINT to the run (pid $pid)"
  else
    log "$(hostname): no run is going"
  fi
}

case "${1:-}" in
  _setup) shift; worker_setup "$@"; exit ;;
  _has_checkpoint) shift; worker_has_checkpoint "$@"; exit ;;
  _start) shift; worker_start "$@"; exit ;;
  _run) shift; worker_run "$@"; exit ;;
  _logs) shift; worker_logs; exit ;;
  _kill) shift; worker_kill; exit ;;
esac

# ======================================================= on your machine ==
usage() { # The header above, without the comment marks.
  sed -n '2,/^set -euo pipefail/{/^set -euo pipefail/d; s/^# \{0,1\}//; p}' "${BASH_SOURCE[0]}"
}

command="${1:-}"
case "$command" in
  -h | --help) usage; exit 0 ;;
  up | logs | kill | stop | delete) shift ;;
  "") die "no subcommand: expected up, logs, kill, stop or delete (see --help)" ;;
  *) die "unknown subcommand '$command': expected up, logs, kill, stop or delete (see --help)" ;;
esac

name="" zone="" project="" accelerator_type="" version="" spot=0 preemptible=0
workdir="" nfs="" mount="/mnt/jaxvla" remote_dir="jaxvla" git_url="" ref=""
detach=0 dry_run=0
create_flags=()
run_args=()
while (($#)); do
  case "$1" in
    --) shift; run_args=("$@"); break ;;
    --name=*) name="${1#*=}" ;;
    --zone=*) zone="${1#*=}" ;;
    --project=*) project="${1#*=}" ;;
    --accelerator_type=*) accelerator_type="${1#*=}" ;;
    --version=*) version="${1#*=}" ;;
    --spot) spot=1 ;;
    --preemptible) preemptible=1 ;;
    --create_flag=*) create_flags+=("${1#*=}") ;;
    --workdir=*) workdir="${1#*=}" ;;
    --nfs=*) nfs="${1#*=}" ;;
    --mount=*) mount="${1#*=}" ;;
    --remote_dir=*) remote_dir="${1#*=}" ;;
    --git_url=*) git_url="${1#*=}" ;;
    --ref=*) ref="${1#*=}" ;;
    --detach) detach=1 ;;
    --dry_run) dry_run=1 ;;
    -h | --help) usage; exit 0 ;;
    --name | --zone | --project | --accelerator_type | --version | --create_flag | --workdir | \
      --nfs | --mount | --remote_dir | --git_url | --ref)
      die "$1 needs a value: write $1=VALUE" ;;
    *) die "unknown flag '$1' (see --help; arguments for launch/run.sh go after --)" ;;
  esac
  shift
done

# ---------------------------------------------------------------- checks --
[[ -n $name ]] || die "--name is required (the slice's name)"
[[ $name =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
  die "--name=$name: lowercase letters, digits and hyphens, starting with a letter"
[[ -n $zone ]] || die "--zone is required (e.g. --zone=us-east5-a)"
if [[ $command == up ]]; then
  [[ -n $accelerator_type ]] ||
    die "--accelerator_type is required by up (e.g. v5p-64, v5litepod-16)"
  [[ $accelerator_type =~ ^v[0-9][a-z0-9]*-[0-9]+$ ]] ||
    die "--accelerator_type=$accelerator_type: expected a type such as v5p-64 or v5litepod-16"
  if [[ -z $version ]]; then
    case "$accelerator_type" in
      v6e-*) version=v2-alpha-tpuv6e ;;
      v5p-*) version=v2-alpha-tpuv5 ;;
      v5litepod-* | v5e-*) version=v2-alpha-tpuv5-lite ;;
      v2-* | v3-* | v4-*) version="tpu-ubuntu2204-base" ;;
      *) die "--accelerator_type=$accelerator_type: no default TPU software version;" \
        "pass --version" ;;
    esac
  fi
  ((spot + preemptible < 2)) || die "--spot and --preemptible exclude each other"
  [[ -n $workdir ]] || die "--workdir is required by up (a directory every worker mounts)"
  [[ $workdir != gs://* ]] ||
    die "--workdir=$workdir: gs:// is not supported (jaxvla's workdir is a POSIX directory:" \
      "lock, metrics and checkpoints by path); mount a shared file system with --nfs"
  if [[ -n $nfs ]]; then
    [[ $nfs =~ ^[^:/]+:/.* ]] || die "--nfs=$nfs: expected SERVER:/EXPORT, e.g. 10.0.0.2:/share"
    [[ $mount == /* ]] || die "--mount=$mount: must be an absolute path"
    [[ $workdir == /* ]] || workdir="${mount%/}/$workdir"
    [[ $workdir == "${mount%/}"/* ]] ||
      die "--workdir=$workdir is not under the NFS mount --mount=$mount"
  else
    [[ $workdir == /* ]] ||
      die "--workdir=$workdir: give an absolute path on a file system every worker mounts" \
        "(or --nfs, which makes it relative to --mount)"
  fi
  have_config=0
  for arg in "${run_args[@]}"; do
    case "$arg" in
      --workdir | --workdir=*) die "$arg after --: the workdir is tpu_pod.sh's --workdir" ;;
      --config.resume | --config.resume=*)
        die "$arg after --: resume is decided by the workdir's checkpoints" ;;
      --config.distributed.cluster_auto* | --config.distributed.coordinator_address* | \
        --config.distributed.num_processes* | --config.distributed.process_id*)
        die "$arg after --: the workers are joined by TPU detection (cluster_auto)" ;;
      --config=* | --config) have_config=1 ;;
    esac
  done
  ((have_config)) || run_args=(--config=configs/tpu.py "${run_args[@]}")
elif ((${#run_args[@]})); then
  die "$command takes no arguments after --"
fi
if ((!dry_run)); then
  command -v gcloud >/dev/null ||
    die "gcloud not found: install the Google Cloud CLI (or try --dry_run)"
fi

# ------------------------------------------------------------- commands --
tpu=(gcloud compute tpus tpu-vm)
where=("--zone=$zone")
[[ -z $project ]] || where+=("--project=$project")
remote_script="$(quote "$remote_dir/launch/tpu_pod.sh")"

# Runs a command, or prints it under --dry_run.
run() {
  if ((dry_run)); then
    printf '+ %s\n' "$(quote "$@")"
  else
    "$@"
  fi
}
note() { # A line of the plan under --dry_run (what depends on what the slice says).
  if ((dry_run)); then printf '# %s\n' "$*"; fi
}
on_workers() { # WORKERS COMMAND...: the command line, shell-quoted, on those workers
  local workers=$1
  shift
  run "${tpu[@]}" ssh "$name" "${where[@]}" "--worker=$workers" --quiet "--command=$*"
}

slice_state() { # prints 'STATE TYPE', or 'ABSENT' if there is no such slice
  local out err
  err="$(mktemp)"
  if out="$("${tpu[@]}" describe "$name" "${where[@]}" \
    --format='value(state,acceleratorType)' 2>"$err")"; then
    rm -f "$err"
    echo "$out"
  elif grep -qiE 'NOT_FOUND|not found' "$err"; then
    rm -f "$err"
    echo ABSENT
  else
    printf 'tpu_pod.sh: gcloud describe %s failed: %s\n' "$name" "$(tr '\n' ' ' <"$err")" >&2
    rm -f "$err"
    exit 1
  fi
}

create_slice() {
  local flags=("--accelerator-type=$accelerator_type" "--version=$version")
  ((spot)) && flags+=(--spot)
  ((preemptible)) && flags+=(--preemptible)
  run "${tpu[@]}" create "$name" "${where[@]}" "${flags[@]}" "${create_flags[@]}" --quiet
}

# Step 1: the slice.
ensure_slice() {
  if ((dry_run)); then
    run "${tpu[@]}" describe "$name" "${where[@]}" --format='value(state,acceleratorType)'
    note "READY with type $accelerator_type: reused. STOPPED: started. PREEMPTED or TERMINATED:"
    note "deleted, then created as below. Absent: created:"
    create_slice
    return
  fi
  local info state type waited=0
  while :; do
    info="$(slice_state)" || exit 1
    read -r state type <<<"$info"
    case "$state" in
      READY) break ;;
      ABSENT)
        log "creating $name ($accelerator_type, $version)"
        create_slice
        ;;
      STOPPED)
        log "$name is stopped: starting it"
        run "${tpu[@]}" start "$name" "${where[@]}" --quiet
        ;;
      PREEMPTED | TERMINATED)
        log "$name is $state (it cannot be restarted): deleting and creating it again"
        run "${tpu[@]}" delete "$name" "${where[@]}" --quiet
        create_slice
        ;;
      CREATING | STARTING | RESTARTING | REPAIRING | STOPPING)
        ((waited < 1800)) || die "$name still $state after 30 minutes"
        log "$name is $state: waiting"
        sleep 20
        waited=$((waited + 20))
        ;;
      *) die "$name is in state '$state'; cannot run on it" \
        "(see gcloud compute tpus tpu-vm describe)" ;;
    esac
  done
  [[ -z $type || ${type,,} == "${accelerator_type,,}" ]] ||
    die "$name exists as $type, not --accelerator_type=$accelerator_type;" \
      "delete it or change the flag"
  log "$name is READY ($type)"
}

# Step 2: the code on every worker.
ship_code() {
  local rdir
  rdir="$(quote "$remote_dir")"
  if [[ -n $git_url ]]; then
    local commit="${ref:-}"
    if [[ -z $commit ]]; then
      commit="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null)" ||
        die "--git_url without --ref needs this checkout's HEAD commit; pass --ref"
    fi
    local q_url q_ref
    q_url="$(quote "$git_url")"
    q_ref="$(quote "$commit")"
    on_workers all "if [ -d $rdir/.git ]; then git -C $rdir fetch -q origin;" \
      "else git clone -q $q_url $rdir; fi && git -C $rdir checkout -q --force $q_ref"
    return
  fi
  [[ -e $ROOT/.git ]] || # (a directory, or a file in a worktree)
    die "$ROOT is not a git checkout: pass --git_url to clone on the workers"
  local tree="$ref" tmp tarball
  if [[ -z $tree ]]; then
    if ((dry_run)); then
      run git -C "$ROOT" stash create
      note "the commit it prints (the working tree's tracked files), or HEAD if nothing changed:"
      tree=WORKTREE_COMMIT
    else
      tree="$(git -C "$ROOT" stash create)"  # a commit object; the stash list is untouched
      tree="${tree:-HEAD}"
      local untracked
      untracked="$(git -C "$ROOT" ls-files --others --exclude-standard | head -5)"
      [[ -z $untracked ]] ||
        log "untracked files are not sent (git add them): ${untracked//$'\n'/, }"
    fi
  fi
  if ((dry_run)); then
    tmp=/tmp/jaxvla-XXXXXX  # Dry run: shown in place of the directory mktemp -d would make.
  else
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064  # (expanded now: the path is fixed)
    trap "rm -rf '$tmp'" EXIT
  fi
  tarball="$tmp/jaxvla-src.tar.gz"
  run git -C "$ROOT" archive --format=tar.gz "--output=$tarball" "$tree"
  run "${tpu[@]}" scp "$tarball" "$name:jaxvla-src.tar.gz" "${where[@]}" --worker=all --quiet
  on_workers all "mkdir -p $rdir && tar -xzf jaxvla-src.tar.gz -C $rdir && rm -f jaxvla-src.tar.gz"
}

# Step 3: set-up (and the share) on every worker.
setup_workers() {
  local extra=()
  [[ -z $nfs ]] || extra+=("--nfs=$nfs" "--mount=$mount")
  extra+=("--workdir=$workdir")
  on_workers all "bash $remote_script _setup $(quote "${extra[@]}")"
}

# Steps 4 and 5: resume or not, decided once (on worker 0) for every worker, then the run.
start_run() {
  local args=("${run_args[@]}" --config.distributed.cluster_auto=True "--workdir=$workdir")
  local check out
  check="bash $remote_script _has_checkpoint $(quote "$workdir")"
  if ((dry_run)); then
    on_workers 0 "$check"
    note "if it prints jaxvla-checkpoint=yes, the run gets --config.resume=True as well:"
  else
    out="$(on_workers 0 "$check")"
    case "$out" in
      *jaxvla-checkpoint=yes*)
        log "the workdir holds a checkpoint: resuming it"
        args+=(--config.resume=True)
        ;;
      *jaxvla-checkpoint=no*) log "no checkpoint in the workdir: starting the run" ;;
      *) die "could not check $workdir for checkpoints on worker 0: $out" ;;
    esac
  fi
  on_workers all "bash $remote_script _start -- $(quote "${args[@]}")"
}

stream_log() {
  if ((!dry_run)); then
    log "streaming worker 0's log (Ctrl-C stops the streaming, not the run; 'logs' resumes it)"
  fi
  on_workers 0 "bash $remote_script _logs"
}

case "$command" in
  up)
    ensure_slice
    ship_code
    setup_workers
    start_run
    if ((detach)); then
      note "(--detach: the log is not streamed)"
      ((dry_run)) ||
        log "started; 'tpu_pod.sh logs --name=$name --zone=$zone' streams worker 0's log"
    else
      stream_log
    fi
    ;;
  logs) stream_log ;;
  kill) on_workers all "bash $remote_script _kill" ;;
  stop) run "${tpu[@]}" stop "$name" "${where[@]}" --quiet ;;
  delete) run "${tpu[@]}" delete "$name" "${where[@]}" --quiet ;;
esac
