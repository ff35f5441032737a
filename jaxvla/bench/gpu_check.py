"""The GPU session's prepared check: ``python -m jaxvla.bench.gpu_check --out=DIR``.

One command that spends a short GPU window on the figures docs/results/pipeline.md and
docs/results/policy.md need from full-size pi0 (``launch/gpu_check.sh`` wraps it with the
offline set-up). It runs, in order, each step in its own process (so one step's device
memory is free for the next) with a shared persistent compilation cache:

==============  ==========================================================================
``memory``      ``jaxvla.bench.policy --memory``: XLA's memory analysis of full pi0's PPO
                update, one minibatch of 32 chunks and the pipeline's 4, and of the
                streamed learner's micro-batch under its bfloat16 proximal snapshot with
                the Adam moments and rollout copy beside it (compiled only)
``pipeline``    ``jaxvla.bench.pipeline``: full pi0 on the built-in env, ``sync_colocated``
                and full async (``+streamer``), each traced with ``--profile``
``trace``       ``jaxvla.bench.trace_summary`` on each mode's trace, as text (the async
                row's is the one to read: where the device's time went and why it
                idled; the same summaries are in the pipeline step's JSON rows)
``act``         ``jaxvla.bench.policy``: full pi0's ``act`` latency at batch 1, 8 and 32
``ppo``         ``jaxvla.bench.policy``: one PPO minibatch of 32 chunks, with its MFU
==============  ==========================================================================

A GPU window runs ``memory``, ``pipeline`` and ``trace`` unless ``--steps`` names others
(:data:`WINDOW_STEPS`: ``act`` and ``ppo`` were measured on an H100 on 2026-11-23 and
2026-11-27, docs/results/policy.md); the dry run runs every step.

Every step has a time limit; a step that fails or runs out of time is recorded as such
and the next one still runs, so a window always returns what it measured. After each
step ``DIR/gpu_check.json`` is rewritten with everything so far: each step's command,
return code, wall time and parsed result (its last JSON line), and a ``summary`` with
the headline figures (the PPO updates' memory in GiB, full-async efficiency and
speedup, act milliseconds by batch, the PPO minibatch's milliseconds and MFU). Each
step's output is in ``DIR/<step>.log``, the trace summaries in ``DIR/trace_<mode>.txt``;
the traces themselves stay in ``--profile_dir`` (they are large).

``--dry_run`` runs the same steps on whatever device there is with the tiny pi0 and
budgets of seconds: the fast tests run it on the CPU, so the check a GPU window depends
on cannot rot between windows.

Exit status: 0 if every step succeeded, 1 otherwise.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

from absl import app, flags

STEPS = ("memory", "pipeline", "trace", "act", "ppo")
# What a GPU window runs by default: a cold full-pi0 pipeline run compiles for minutes
# (2026-11-27, H100: over 430 s for both modes), so the window goes to what is unmeasured.
WINDOW_STEPS = ("memory", "pipeline", "trace")
# The memory step's PPO updates: one minibatch (the policy benchmark's row) and the
# pipeline step's 4 (its learner batch: 32 envs x 4 steps).
MEMORY_MINIBATCHES = (1, 4)
# What the steps import beyond an accelerator image's JAX, flax, optax, orbax, chex, absl,
# numpy, msgpack, rich and PyYAML (measured: every module the dry run's processes had
# loaded). ``launch/gpu_check.sh --prepare`` downloads their wheels for a machine without
# a network.
OFFLINE_PACKAGES = ("ml-collections",)
# The modes the pipeline step compares (sync first, the full-async mode last).
MODES = ("sync_colocated", "+streamer")
ACT_BATCHES = (1, 8, 32)
PPO_BATCH = 32
# Full pi0 as openpi sizes it (docs/results/pipeline.md's H100 rows): bf16 compute, remat, 224 px
# images, PaliGemma's vocabulary, 32-dim padded state and actions; a bfloat16 rollout
# copy; learner micro-batches of 32 chunks.
FULL_PIPELINE = (
    "--updates=3", "--warmup=1", "--stage_seconds=4",
    "--config.model.variant=full", "--config.model.dtype=bfloat16", "--config.model.remat=True",
    "--config.model.image_size=224", "--config.model.vocab_size=257152",
    "--config.model.action_dim=32", "--config.model.state_dim=32",
    "--config.rl.num_minibatches=4", "--config.pipeline.micro_batch_segments=8",
    "--config.pipeline.rollout_dtype=bfloat16",
    # First-ready batches padded to 8, 16 or 32 rows: half the act / value programs.
    "--config.pipeline.min_bucket=8",
)
# The same run with the tiny pi0, 16 envs in 2 workers and three timed updates (one
# update's window can hold no usable rollout step on a loaded machine): seconds.
DRY_PIPELINE = (
    "--updates=3", "--warmup=1", "--stage_seconds=0.5", "--config.num_envs=16",
    "--config.env_workers=2", "--config.env.latency_ms=0", "--config.pipeline.b_max=4",
    "--config.pipeline.micro_batch_segments=4",
)
# Seconds each step may take. A window's steps (WINDOW_STEPS) stay under 10 minutes.
LIMITS_S = dict(memory=150, pipeline=420, trace=30, act=90, ppo=100)
DRY_LIMITS_S = dict(memory=150, pipeline=180, trace=60, act=90, ppo=90)

_OUT = flags.DEFINE_string("out", None, "Folder for gpu_check.json, the logs and the trace "
                           "summaries.", required=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "The same steps with the tiny pi0 in seconds "
                             "(CPU), to check the script itself.")
_STEPS = flags.DEFINE_list("steps", None, f"Steps to run, of {STEPS} (in that order; "
                           f"default: {WINDOW_STEPS}, the dry run every step).")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir", "", "Where the pipeline step's traces go ('': a folder in the temp dir).")
_PIPELINE_FLAGS = flags.DEFINE_multi_string(
    "pipeline_flag", [], "A flag added to the pipeline step's command after its own, so it "
    "wins (repeatable): e.g. --pipeline_flag=--config.model.lora=both where full "
    "fine-tuning does not fit, --pipeline_flag=--modes=+streamer for one mode.")
_CACHE_DIR = flags.DEFINE_string(
    "cache_dir", "", "Persistent compilation cache shared by the steps ('': the checkout's "
    ".cache/jax_gpu_check).")


def step_commands(dry_run: bool, profile_dir: str,
                  pipeline_flags: tuple[str, ...] = ()) -> dict[str, list[list[str]]]:
  """Each step's commands (argv lists after ``python -m``), in order; ``pipeline_flags``
  end the pipeline step's command (absl takes a flag's last value)."""
  py = [sys.executable, "-m"]
  pipeline = [*py, "jaxvla.bench.pipeline", f"--modes={','.join(MODES)}",
              f"--profile={profile_dir}", *(DRY_PIPELINE if dry_run else FULL_PIPELINE),
              *pipeline_flags]
  model = (["--variants=tiny", "--dtype=float32", "--repeats=2"] if dry_run
           else ["--variants=full", "--dtype=bfloat16", "--repeats=5"])
  policy = [*py, "jaxvla.bench.policy", "--models=pi0", *model]
  memory_of = [*py, "jaxvla.bench.policy", "--memory", "--memory_model=pi0",
               f"--memory_variant={'tiny' if dry_run else 'full'}",
               f"--memory_batch={4 if dry_run else PPO_BATCH}", "--memory_remat=on"]
  memory = [[*memory_of, "--memory_steps=ppo", f"--memory_minibatches={nm}"]
            for nm in MEMORY_MINIBATCHES]
  # The full-async pipeline's heaviest learner program, as FULL_PIPELINE configures it.
  memory.append([*memory_of, "--memory_steps=streamed",
                 f"--memory_minibatches={MEMORY_MINIBATCHES[-1]}",
                 "--memory_rollout_dtype=bfloat16"])
  act = [*policy, f"--batch_sizes={','.join(map(str, ACT_BATCHES))}", "--denoise_steps=4",
         "--learner_batch=0"]
  ppo = [*policy, "--batch_sizes=", "--denoise_steps=4", f"--learner_batch={PPO_BATCH}",
         "--learner_denoise_steps=4", "--learner_ops=ppo_minibatch"]
  trace = [[*py, "jaxvla.bench.trace_summary", os.path.join(profile_dir, m.lstrip("+"))]
           for m in MODES]
  return dict(memory=memory, pipeline=[pipeline], trace=trace, act=[act], ppo=[ppo])


def last_json(text: str) -> dict | None:
  """The last line of ``text`` that parses as a JSON object (the benchmarks' result)."""
  for line in reversed(text.splitlines()):
    line = line.strip()
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        continue
  return None


def run_step(name: str, commands: list[list[str]], limit_s: float, out: str,
             env: dict[str, str], stdout_paths: list[str] | None = None) -> dict:
  """Runs ``commands`` in order within ``limit_s`` seconds in all; logs to ``out/name.log``.

  Command ``i``'s standard output is also written to ``stdout_paths[i]`` when given.
  Returns ``dict(commands, rc, wall_s, result)``: ``rc`` is the first non-zero return
  code (124 when the limit ran out), ``result`` the last JSON object each command
  printed (a list for several commands, else the one).
  """
  start, rc, results = time.monotonic(), 0, []
  with open(os.path.join(out, f"{name}.log"), "w", encoding="utf-8") as log:
    for argv in commands:
      left = limit_s - (time.monotonic() - start)
      log.write(f"$ {shlex.join(argv)}\n")
      log.flush()
      if left <= 0:
        rc = 124
        break
      try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=left, env=env,
                              check=False)
      except subprocess.TimeoutExpired as e:
        log.write(_text(e.stdout) + _text(e.stderr) + f"\n# {name}: over its {limit_s:.0f} s\n")
        rc = 124
        break
      log.write(proc.stdout + proc.stderr)
      results.append(proc.stdout)
      if stdout_paths:
        with open(stdout_paths[len(results) - 1], "w", encoding="utf-8") as f:
          f.write(proc.stdout)
      if proc.returncode:
        rc = proc.returncode
        break
  parsed = [last_json(r) for r in results]
  return dict(commands=[shlex.join(a) for a in commands], rc=rc,
              wall_s=round(time.monotonic() - start, 1),
              result=parsed[0] if len(commands) == 1 and parsed else parsed)


def _text(b: bytes | str | None) -> str:
  return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def summarize(steps: dict[str, dict]) -> dict:
  """The headline figures of whatever steps produced a result."""
  s: dict = {}
  memory = steps.get("memory", {}).get("result") or []  # (one result per minibatch count)
  rows = [row for r in memory if r for row in r.get("rows", [])]
  ppo_rows = [r for r in rows if "live_gib" not in r]
  if ppo_rows:
    s["ppo_memory_gib"] = {f"{r['batch']}x{r.get('minibatches', 1)}": r["total_gib"]
                           for r in ppo_rows}
  streamed = [r["live_gib"] for r in rows if "live_gib" in r]
  if streamed:
    s["streamed_live_gib"] = streamed[-1]
  pipe = steps.get("pipeline", {}).get("result")
  if pipe:
    s["efficiency"] = pipe.get("efficiency")
    s["speedup_vs_sync_colocated"] = pipe.get("speedup_vs_sync_colocated")
    s["slowest_stage"] = pipe.get("slowest_stage")
    s["env_steps_per_s"] = {r["mode"]: r.get("env_steps_per_s") for r in pipe.get("rows", [])}
  act = steps.get("act", {}).get("result")
  if act:
    s["act_median_ms"] = {str(r["batch"]): r["median_ms"] for r in act.get("rows", [])
                          if r.get("op") == "act"}
  ppo = steps.get("ppo", {}).get("result")
  if ppo:
    for r in ppo.get("rows", []):
      if r.get("op") == "ppo_minibatch":
        s["ppo_minibatch"] = dict(batch=r["batch"], median_ms=r["median_ms"], mfu=r["mfu"],
                                  device_peak_gib=r.get("device_peak_gib"))
  return s


def check(out: str, *, dry_run: bool, steps: list[str], profile_dir: str,
          cache_dir: str, pipeline_flags: tuple[str, ...] = ()) -> dict:
  """Runs ``steps`` and writes ``out/gpu_check.json`` after each; returns its content."""
  unknown = [s for s in steps if s not in STEPS]
  if unknown:
    raise ValueError(f"--steps: {unknown} are not among {list(STEPS)}")
  os.makedirs(out, exist_ok=True)
  os.makedirs(cache_dir, exist_ok=True)
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=cache_dir,
             # Cache every compile: the pipeline and policy steps share the act shapes.
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  if not dry_run:
    # Full pi0's train state, the rollout copy and activations take most of an 80 GB GPU.
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  commands = step_commands(dry_run, profile_dir, pipeline_flags)
  limits = DRY_LIMITS_S if dry_run else LIMITS_S
  report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                host=dict(machine=platform.machine(), cpus=os.cpu_count()),
                dry_run=dry_run, profile_dir=profile_dir, steps={}, summary={})
  path = os.path.join(out, "gpu_check.json")
  for name in (s for s in STEPS if s in steps):
    print(f"[gpu_check] {name} (limit {limits[name]} s) ...", flush=True)
    texts = ([os.path.join(out, f"trace_{m.lstrip('+')}.txt") for m in MODES]
             if name == "trace" else None)
    result = run_step(name, commands[name], limits[name], out, env, texts)
    report["steps"][name] = result
    device = _device_of(result.get("result"))
    if device:
      report.setdefault("device", device)
    report["summary"] = summarize(report["steps"])
    print(f"[gpu_check] {name}: rc {result['rc']} in {result['wall_s']} s", flush=True)
    _write_json(path, report)
  report["ok"] = all(r["rc"] == 0 for r in report["steps"].values())
  _write_json(path, report)
  return report


def _write_json(path: str, report: dict) -> None:
  """Replaces ``path`` at once: a window cut short leaves the last whole report."""
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  os.replace(path + ".tmp", path)


def _device_of(result) -> str | None:
  """The device a step's result names: a command's JSON, or the first of several that
  names one (the memory step runs three commands)."""
  if isinstance(result, list):
    return next((d for d in map(_device_of, result) if d), None)
  if isinstance(result, dict):
    if result.get("device"):
      return result["device"]
    rows = result.get("rows") or []
    return rows[0].get("device") if rows and isinstance(rows[0], dict) else None
  return None


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  report = check(
      _OUT.value, dry_run=_DRY_RUN.value,
      steps=_STEPS.value or list(STEPS if _DRY_RUN.value else WINDOW_STEPS),
      profile_dir=_PROFILE_DIR.value or tempfile.mkdtemp(prefix="jaxvla_gpu_check_profile_"),
      cache_dir=_CACHE_DIR.value or os.path.join(root, ".cache", "jax_gpu_check"),
      pipeline_flags=tuple(_PIPELINE_FLAGS.value))
  print(json.dumps(dict(ok=report["ok"], device=report.get("device"),
                        summary=report["summary"],
                        failed=[n for n, r in report["steps"].items() if r["rc"]])))
  sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
  app.run(main)
