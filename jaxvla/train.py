"""The whole job: behaviour-cloning warm start, then the RL phase, evaluations,
checkpoints, the export and the summary.

``train_and_evaluate(config, workdir)`` is the job; ``jaxvla.main`` only parses
flags. The RL phase runs in :class:`jaxvla.runtime.pipeline.Pipeline` in any
mode (synchronous or asynchronous); this module reads its metrics after every
update. Env steps counted in ``env_steps`` are RL rollout steps (the run's
budget, ``config.total_env_steps``); demonstration and evaluation steps are
reported separately. The learner runs on a ``('data', 'fsdp', 'tensor')`` mesh
of this host's devices (``config.mesh``; one device on a plain CPU run).

Multi-host (``config.distributed``, started by ``jaxvla.main``): every process
runs this same function with the same config and workdir (a shared file system).
Each process owns ``config.num_envs`` envs and its rollout devices, collects
``1 / P`` of the demonstrations and feeds ``1 / P`` of every learner batch; the
learner mesh spans every process's learner devices. ``env_steps`` and the budget
count every process's steps. Process 0 alone evaluates (on its replica of the
params; the result is broadcast), writes ``metrics.jsonl``, TensorBoard and
``config.json``, and shows the progress bar; checkpoints and the export are
written by orbax from every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import threading
import time

import jax
import ml_collections
import numpy as np

from jaxvla import config_checks, metrics as metrics_lib, progress as progress_lib
from jaxvla.data import collect as collect_lib
from jaxvla.data import config as data_config
from jaxvla.data import loader as data_loader
from jaxvla.data import norm_stats as norm_lib
from jaxvla.envs import make_vec_env, normalized, protocol
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.learner import learner as learner_lib
from jaxvla.learner import update as update_lib
from jaxvla.models import contract, openpi_import, policy as policy_lib
from jaxvla.parallel import distributed
from jaxvla.parallel import sharding as sharding_lib
from jaxvla.runtime import ledger as ledger_lib
from jaxvla.runtime import pipeline as pipeline_lib
from jaxvla.runtime import schedule as schedule_lib
from jaxvla.storage import checkpoint as checkpoint_lib
from jaxvla.storage import policy_io
from jaxvla.storage import workdir as workdir_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunState:
  """Host-side progress of the run (saved in checkpoint ``meta``)."""
  iteration: int = 0
  env_steps: int = 0
  warm_start_success_rate: float | None = None
  warm_start_eval: dict | None = None
  bc_wall_s: float = 0.0
  # Rollout data by fate (:class:`jaxvla.runtime.ledger.Ledger`) as of this checkpoint's
  # update; what was in flight then is discarded (re-collected) by a resume from it.
  ledger: dict = dataclasses.field(default_factory=dict)
  # The state/action normalisation the policy was trained with (Normalizer.to_json()).
  normalizer: dict | None = None

  @classmethod
  def from_meta(cls, meta: dict) -> "RunState":
    """From a checkpoint's ``meta``; the in-flight counts of checkpoints written before
    the ledger are dropped (with a log line: their discards go uncounted)."""
    meta = dict(meta)
    legacy = {k: meta.pop(k) for k in ("in_flight_segments", "in_flight_chunks") if k in meta}
    if legacy:
      log.info("the checkpoint predates the env-step ledger (%s); its in-flight data is "
               "discarded uncounted", legacy)
    return cls(**meta)


@dataclasses.dataclass
class Setup:
  """What one run owns, built once: its envs, policy, learner, checkpointer and writer.

  A context manager: leaving it closes the rollout and evaluation env pools, the
  checkpointer (waiting for its saves) and the metric writer, each even if one
  closed before it raises, so no env worker outlives the run however it ends.
  """
  env: protocol.VecEnv  # This process's rollout envs.
  policy: contract.Policy
  learner: learner_lib.Learner
  act_train: object
  act_eval: object
  value_fn: object
  eval_env: object  # None on every process but the primary one.
  writer: metrics_lib.MetricWriter
  checkpointer: checkpoint_lib.Checkpointer
  workdir: str  # The run's directory (demonstrations are recorded under it).
  closing: contextlib.ExitStack  # What __exit__ closes.
  rollout_sharding: object = None
  # State/action normalisation between env and policy (set by _initial_state).
  normalizer: norm_lib.Normalizer | None = None

  @property
  def spec(self) -> protocol.EnvSpec:
    """The env's, which the policy is built for."""
    return self.env.spec

  def __enter__(self) -> "Setup":
    return self

  def __exit__(self, *exc) -> None:
    self.closing.close()


def _build(config: ml_collections.ConfigDict, workdir: str) -> Setup:
  """Opens the run's envs, checkpointer and writer and builds its policy and learner
  (what was opened is closed again if a later part fails)."""
  closing = contextlib.ExitStack()
  try:
    env = make_vec_env(config.env, config.num_envs, distributed.host_seed(config.seed),
                       num_workers=config.env_workers,
                       step_timeout_s=config.env_step_timeout_s,
                       hang_floor_s=config.env_hang_floor_s)
    closing.callback(env.close)
    writer = metrics_lib.MetricWriter(workdir, enabled=distributed.is_primary())
    closing.callback(writer.close)
    checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                               config.checkpoint.max_to_keep)
    closing.callback(checkpointer.close)
    # Evaluation and demonstrations play independent episodes (no GRPO groups).
    eval_env = _eval_env(config) if distributed.is_primary() else None
    if eval_env is not None:
      closing.callback(eval_env.close)
    policy = policy_lib.make_policy(config.model, env.spec)
    # The learner mesh: this host's learner devices (config.mesh.{data,fsdp,tensor}); the
    # rollout acts on config.mesh.rollout_devices (by default the same devices).
    # (Multi-process: the learner devices of every process, this process's rollout devices.)
    learner_devices, rollout_devices = sharding_lib.role_devices(config.mesh.rollout_devices)
    mesh = sharding_lib.make_mesh(config.mesh, learner_devices)
    config_checks.validate_batch_shards(
        config, sharding_lib.num_batch_shards(mesh, config.mesh.rules),
        num_processes=jax.process_count())
    log.info("learner mesh %s on %d devices (%d processes); rollout on %d devices of "
             "process %d", dict(mesh.shape), len(learner_devices), jax.process_count(),
             len(rollout_devices), jax.process_index())
    return Setup(
        env=env, workdir=workdir, closing=closing,
        rollout_sharding=sharding_lib.rollout_sharding(rollout_devices),
        policy=policy,
        learner=learner_lib.Learner(
            policy, config, mesh=mesh, rules=config.mesh.rules,
            behaviour_is_proximal=config.pipeline.mode == "sync_colocated"),
        act_train=jax.jit(functools.partial(policy.act, mode="train")),
        act_eval=evaluate_lib.row_keyed_act(policy),
        value_fn=jax.jit(policy.value),
        eval_env=eval_env, writer=writer, checkpointer=checkpointer)
  except BaseException:
    closing.close()
    raise


def _eval_env(config: ml_collections.ConfigDict) -> protocol.VecEnv:
  """One env per evaluation episode, in ``config.eval.env_workers`` processes (0: here).
  Its episodes are independent (no GRPO groups) and the same either way."""
  env_config = config.env.copy_and_resolve_references()
  env_config.group_size = 1
  return make_vec_env(env_config, config.eval.num_episodes, config.seed + 1,
                      num_workers=config.eval.env_workers,
                      step_timeout_s=config.env_step_timeout_s,
                      hang_floor_s=config.env_hang_floor_s)


def _eval_policy_name(config) -> str:
  if config.model.name == "action_token_vla":
    return "greedy (argmax) token decoding"
  return f"the '{config.model.eval_sampler}' sampler"


def _evaluate(config, s: Setup, params, rng) -> dict[str, float]:
  """Evaluation on fixed-seed episodes; every process calls it, process 0 plays them."""
  # (Multi-process: collectives, the gather here and the broadcast below.)
  params = distributed.local_replica(params, s.learner.mesh)
  if s.eval_env is None:
    result = dict.fromkeys(evaluate_lib.EVAL_KEYS, 0.0)
  else:  # The same episodes (fixed seed) and noise (the key) every time: paired.
    result = evaluate_lib.evaluate(normalized.wrap(s.eval_env, s.normalizer), s.policy,
                                    s.act_eval, params, rng,
                                    seed=config.seed + evaluate_lib.EVAL_SEED_OFFSET,
                                    chunk_len=config.model.chunk_len)
  return distributed.broadcast_from_primary(result)


def demonstrations(config, workdir: str, spec: protocol.EnvSpec
                   ) -> tuple[ml_collections.ConfigDict, dict]:
  """The dataset the warm start reads (its ``data`` sub-config) and figures about it.

  ``config.data.path`` when set. Otherwise the env's scripted expert is recorded,
  once, into ``<workdir>/demos`` as an RLDS dataset (process 0 records, the others
  wait), exactly as ``python -m jaxvla.data.collect`` would: one path from
  demonstrations to BC, through the disk, for every run.
  """
  if config.data.path:
    return config.data, {}
  out = os.path.join(workdir, "demos")
  figures = {}
  if distributed.is_primary():
    if os.path.isdir(out):  # (a run that stopped during its warm start recorded them)
      log.info("warm start: reading the demonstrations already recorded in %s", out)
    else:
      t0 = time.perf_counter()
      summary = collect_lib.collect(config, out, config.bc.num_episodes,
                                    noise=config.bc.demo_noise, num_envs=config.num_envs,
                                    success_only=config.bc.success_only)
      log.info("warm start: recorded %d demonstrations (%d steps; %d attempted, success %.3f) "
               "in %s in %.1f s", summary["episodes"], summary["steps"], summary["attempted"],
               summary["success_rate"], out, time.perf_counter() - t0)
      figures = dict(demo_success_rate=summary["success_rate"])
  # Every process reads the dataset once process 0 has written it (a collective).
  figures = distributed.broadcast_from_primary(
      dict(demo_success_rate=figures.get("demo_success_rate", -1.0)))
  d = data_config.recorded(config.data, out, spec.camera_names)
  return d, ({} if figures["demo_success_rate"] < 0 else figures)


def _check_dataset_fits(reader, d: ml_collections.ConfigDict, spec: protocol.EnvSpec) -> None:
  """The dataset's cameras, state and actions must be what the policy (built for the
  env) takes; raises ValueError naming the ``config.data`` key to change."""
  got = data_loader.dataset_spec(reader, d)
  if len(got.camera_names) != len(spec.camera_names):
    raise ValueError(f"config.data.cameras: the dataset gives {len(got.camera_names)} cameras "
                     f"{list(got.camera_names)}, the env's policy takes {len(spec.camera_names)} "
                     f"{list(spec.camera_names)}")
  if got.image_shape != spec.image_shape:
    raise ValueError(f"config.data.image_size: the dataset's images are {got.image_shape}, the "
                     f"env's {spec.image_shape}; set --config.data.image_size="
                     f"{spec.image_shape[0]} to resize them")
  for what, key in (("state_dim", "state_key"), ("action_dim", "action_key")):
    if getattr(got, what) != getattr(spec, what):
      raise ValueError(f"config.data.{key}: the dataset's {what} is {getattr(got, what)}, the "
                       f"env's {getattr(spec, what)}")


def warm_start(config, s: Setup, params, rng
               ) -> tuple[object, norm_lib.Normalizer | None, dict]:
  """Behaviour cloning on a demonstration dataset on disk (:func:`demonstrations`);
  returns the params, the normalisation (``config.data.normalize``, statistics from
  ``config.data.norm_stats`` or the dataset) and figures. Multi-process: each process
  reads its shard of the steps and feeds its share of every batch."""
  if config.bc.num_steps == 0:
    return params, data_loader.normalizer_from_config(config.data), {}
  d, figures = demonstrations(config, s.workdir, s.spec)
  hosts = jax.process_count()
  ds, reader = data_loader.from_config(d, chunk_len=config.model.chunk_len,
                                         batch_size=config.bc.batch_size // hosts,
                                         seed=config.seed + 3)
  _check_dataset_fits(reader, d, s.spec)
  normalizer = data_loader.normalizer_from_config(d, reader)
  batches = data_loader.bc_batches(iter(ds), s.policy.prepare, normalizer)
  state = s.learner.shard_state(learner_lib.init_state(params, s.learner.bc_tx, rng))
  guard = learner_lib.DivergenceGuard(config.ppo.max_bad_updates, "BC step")
  losses, pending = [], []
  phase = progress_lib.PhaseLog("warm start (BC)", config.bc.num_steps,
                               config.log.progress_every_s)
  for i in range(config.bc.num_steps):
    batch, actions, mask = next(batches)
    state, metrics = s.learner.bc_step(state, batch, actions, mask)
    pending.append(metrics)
    # Checked a few steps late, so the host does not wait for every step.
    if len(pending) == 8 or i + 1 == config.bc.num_steps:
      for step, m in enumerate(jax.device_get(pending), start=i + 2 - len(pending)):
        guard.check(float(m["nonfinite"]), step)  # (steps numbered from 1, like updates)
        losses.append(float(m["loss"]))
      pending = []
      phase.tick(i + 1, loss=losses[-1])
  batches.close()
  losses = np.asarray(losses)
  table = reader.table
  return state.params, normalizer, dict(
      bc_loss_first=float(losses[0]), bc_loss_last=float(losses[-5:].mean()),
      demo_episodes=float(table.num_episodes), demo_env_steps=float(table.num_steps), **figures)


def _changed_keys(config, written: dict | None) -> str:
  """`` (config.model.X: 'a' -> 'b', ...)`` against the config a checkpoint's run wrote:
  the model's keys and the RL update's (both shape the checkpoint's train state)."""
  if not written:
    return ""
  changed = []
  for section in ("model", "ppo"):
    if section not in written:
      continue
    now = json.loads(config[section].to_json_best_effort())
    changed += [f"config.{section}.{k}: {written[section].get(k)!r} -> {v!r}"
                for k, v in sorted(now.items()) if written[section].get(k) != v]
  return f" (changed since that run: {', '.join(changed)})" if changed else ""


def _setup_keys(rng: jax.Array) -> jax.Array:
  """``rng`` -> the keys of the initial params, BC, PPO's state and every evaluation."""
  return jax.random.split(rng, 4)


def _initial_state(config, s: Setup, rng, written: dict | None = None,
                   replay_at: int | None = None) -> tuple[learner_lib.TrainState, RunState]:
  """Restores the latest checkpoint (``config.resume``) or warm-starts a fresh policy.

  ``written``: the config the workdir's run wrote (its ``config.json``), if any.
  ``replay_at``: a resumed replay restores the checkpoint of this iteration, where the
  recorded session it replays started.
  """
  init_key, bc_key, ppo_key, eval_key = _setup_keys(rng)
  if config.resume:  # (a checkpoint exists, and none without it: checked by _train)
    # The restore target's structure and shardings, computed abstractly (nothing is
    # allocated); orbax reads every array straight into its shards.
    abstract = jax.eval_shape(lambda: learner_lib.init_state(
        s.policy.init(init_key), s.learner.ppo_tx, ppo_key))
    abstract = sharding_lib.with_shardings(abstract, s.learner.state_shardings(abstract))
    step, state, meta = s.checkpointer.restore_latest(abstract, _changed_keys(config, written),
                                                      at_most=replay_at)
    if replay_at is not None and step != replay_at:
      raise ValueError(f"config.replay: the recorded session to replay next started at "
                       f"iteration {replay_at}, but {s.checkpointer.manager.directory} holds "
                       f"no checkpoint {replay_at} (the newest before it: {step})")
    run = RunState.from_meta(meta)
    s.normalizer = (None if run.normalizer is None
                    else norm_lib.Normalizer.from_json(run.normalizer, f"checkpoint {step}"))
    moved = s.writer.resume_from(run.env_steps)
    if moved:
      log.info("moved %d metric records written after checkpoint %d (env_steps=%d) to "
               "metrics.discarded.jsonl: those steps are trained again", moved, step,
               run.env_steps)
    was = ledger_lib.Ledger.from_meta(run.ledger)
    log.info("resumed from checkpoint %d (policy version %d, env_steps=%d); discarded %d "
             "in-flight env steps (%d chunks) that were queued or being collected when it "
             "was written", step, int(state.step), run.env_steps, was.in_flight("env_steps"),
             was.in_flight("chunks"))
    return state, run
  t0 = time.perf_counter()
  # Fresh, or openpi's weights (config.model.init_checkpoint) read straight into
  # their shards, with fresh RL heads.
  params = openpi_import.init_params(s.policy, init_key, config.model.init_checkpoint,
                                     s.learner.param_shardings)
  params, s.normalizer, bc_metrics = warm_start(config, s, params, bc_key)
  run = RunState(bc_wall_s=time.perf_counter() - t0,
                 normalizer=None if s.normalizer is None else s.normalizer.to_json())
  run.warm_start_eval = _evaluate(config, s, params, eval_key)
  run.warm_start_success_rate = run.warm_start_eval["success_rate"]
  s.writer.write(0, "warm_start", dict(bc_metrics, **run.warm_start_eval,
                                       wall_s=run.bc_wall_s))
  log.info("warm start: %s eval=%s", bc_metrics, run.warm_start_eval)
  state = s.learner.shard_state(learner_lib.init_state(params, s.learner.ppo_tx, ppo_key))
  s.checkpointer.save(0, state, dataclasses.asdict(run))
  return state, run


def _save(s: Setup, run: RunState, state, pipe: pipeline_lib.Pipeline) -> None:
  # The learner never applies a non-finite update; this keeps it that way for
  # checkpoints (an earlier, finite one is never rotated out by a bad one).
  if not bool(update_lib.all_finite(state.params)):
    raise FloatingPointError(f"iteration {run.iteration}: the params are not finite; "
                             "checkpoint not written (the earlier ones are intact)")
  # As of the update this state is from (every process's counts, summed then).
  run.ledger = dataclasses.asdict(pipe.ledger)
  if s.checkpointer.latest_step() != run.iteration:
    s.checkpointer.save(run.iteration, state, dataclasses.asdict(run))
    pipe.note("save", iteration=run.iteration)


@contextlib.contextmanager
def _stop_on_sigint(pipe: pipeline_lib.Pipeline):
  """First Ctrl-C: stop after the current update (then a checkpoint is saved);
  a second one interrupts at once. Only in the main thread."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def handler(signum, frame):
    signal.signal(signal.SIGINT, previous)
    log.warning("Ctrl-C: stopping after the current update (again to abort now)")
    pipe.request_stop()

  previous = signal.signal(signal.SIGINT, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _check_replay(config: ml_collections.ConfigDict, workdir: str) -> int:
  """What ``config.replay`` asks is possible; returns the recorded session's iteration.

  Raises:
    ValueError / FileNotFoundError: naming what stands in the way (several processes,
      the replay's own workdir, a config that differs from the recorded one, no log).
  """
  if jax.process_count() > 1:
    raise ValueError("config.replay: a multi-process run cannot be replayed (each process "
                     "records its own schedule log, to read; replay follows one process)")
  if os.path.abspath(config.replay) == os.path.abspath(workdir):
    raise ValueError(f"config.replay={config.replay!r} is the --workdir: replay into "
                     "another workdir (the recorded run's is read, never written)")
  path = os.path.join(config.replay, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"config.replay: {path} is missing (not a run's workdir?)")
  with open(path, encoding="utf-8") as f:
    recorded = json.load(f)
  diffs = schedule_lib.config_differences(recorded, json.loads(config.to_json_best_effort()))
  if diffs:
    raise ValueError(f"config.replay: a replay runs the recorded config ({path}), and this "
                     f"one differs: {'; '.join(diffs)}")
  return schedule_lib.replay_session(config.replay, workdir, config.resume)


def _schedule(config, workdir: str, run: RunState, state, seed: int, replay_at: int | None
              ) -> tuple[schedule_lib.Recorder | None, schedule_lib.Session | None]:
  """The session's schedule log (``pipeline.schedule_log``) and the one it replays."""
  replay = None
  if replay_at is not None:
    replay = schedule_lib.Session(schedule_lib.session_path(config.replay, replay_at))
    header = replay.header
    changed = schedule_lib.platform_differences(header.get("platform", {}),
                                                schedule_lib.platform())
    if changed:
      raise ValueError(f"config.replay: {replay.path} was recorded on another platform "
                       f"({'; '.join(changed)}); a replay repeats a run bit for bit only with "
                       "the same JAX and XLA build, XLA_FLAGS and device kind")
    if (header["version"], header["seed"]) != (int(state.step), seed):
      raise schedule_lib.ReplayMismatch(
          f"{replay.path}: the recorded session starts at policy version "
          f"{header['version']} with env seed {header['seed']}, the replay at "
          f"{int(state.step)} with {seed}")
    log.info("replaying %s (%d updates, %d rollout steps%s)", replay.path,
             len(replay.updates), len(replay.steps),
             "" if replay.end else "; the recorded run was cut short after them")
  recorder = None
  if config.pipeline.schedule_log:
    recorder = schedule_lib.Recorder(
        schedule_lib.session_path(workdir, run.iteration, jax.process_index(),
                                  jax.process_count()),
        iteration=run.iteration, version=int(state.step), env_steps=run.env_steps,
        seed=seed, mode=config.pipeline.mode, process=jax.process_index(),
        num_processes=jax.process_count(), platform=schedule_lib.platform())
  return recorder, replay


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs the job described by ``config`` in ``workdir``; returns the final summary.

  Raises:
    workdir_lib.WorkdirInUse: another live run holds ``workdir``.
  """
  config_checks.validate(config)
  t_start = time.perf_counter()
  if distributed.multi_process():  # Mismatched processes would deadlock later, silently.
    distributed.check_same_on_hosts(os.path.abspath(workdir), "--workdir")
    shared = config.copy_and_resolve_references()
    with shared.unlocked():
      shared.distributed.process_id = 0  # (the two fields processes may differ in)
      shared.distributed.local_device_ids = ""
    distributed.check_same_on_hosts(shared.to_json_best_effort(sort_keys=True), "the config")
  lock = workdir_lib.WorkdirLock(workdir, enabled=distributed.is_primary())
  refused = None
  try:
    lock.acquire()
  except workdir_lib.WorkdirInUse as e:
    refused = e
  # Every process stops if process 0 was refused (the others would wait for it forever).
  if distributed.broadcast_from_primary(dict(refused=float(refused is not None)))["refused"]:
    raise refused or workdir_lib.WorkdirInUse(
        f"workdir {workdir!r} is in use by another run (process 0 was refused its lock)")
  try:
    return _train(config, workdir, t_start)
  finally:
    lock.release()


def _train(config: ml_collections.ConfigDict, workdir: str, t_start: float) -> dict:
  """:func:`train_and_evaluate` once the workdir is this run's."""
  # Both checked before anything is written or started: a refused run must not
  # overwrite the earlier run's config.json, which its resume compares against.
  saved = checkpoint_lib.saved_steps(os.path.join(workdir, "checkpoints"))
  if config.resume and not saved:
    raise FileNotFoundError(
        f"--config.resume=True but {os.path.join(workdir, 'checkpoints')!r} holds no "
        "checkpoint; check --workdir, or drop --config.resume to start a new run there")
  if saved and not config.resume:
    raise FileExistsError(
        f"the workdir already holds checkpoint {saved[-1]}; pass --config.resume=True to "
        "continue it or choose another --workdir")
  replay_at = _check_replay(config, workdir) if config.replay else None
  os.makedirs(workdir, exist_ok=True)
  config_path = os.path.join(workdir, "config.json")
  written = None
  if config.resume and os.path.exists(config_path):  # To name what changed, on a mismatch.
    with open(config_path, encoding="utf-8") as f:
      written = json.load(f)

  def write_config():
    if distributed.is_primary():
      with open(config_path, "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2))

  if not config.resume:  # (a resume's, once its checkpoint is known to fit)
    write_config()
  rng = jax.random.PRNGKey(config.seed)
  setup_key, rollout_key, _ = jax.random.split(rng, 3)
  # Every evaluation of the run samples with the warm start's key: the same episodes and
  # the same sampler noise (common random numbers), so a change in success between two
  # evaluations is the policy's change, not another draw of the noise.
  eval_key = _setup_keys(setup_key)[3]
  with _build(config, workdir) as s:
    state, run = _initial_state(config, s, setup_key, written,
                                replay_at if config.resume else None)
    if config.resume:
      write_config()
    if jax.process_count() > 1:  # Each process samples its own actions.
      rollout_key = jax.random.fold_in(rollout_key, jax.process_index())
    checkpointed = ledger_lib.Ledger.from_meta(run.ledger)
    ledger = checkpointed.resumed()  # (a fresh run's is empty: nothing to discard)
    seed = distributed.host_seed(config.seed + run.iteration)
    recorder, replay = _schedule(config, workdir, run, state, seed, replay_at)
    if recorder is not None:
      s.closing.callback(recorder.close)
    pipe = pipeline_lib.Pipeline(config, s.policy, s.learner,
                                 normalized.wrap(s.env, s.normalizer), s.act_train, s.value_fn,
                                 s.rollout_sharding,
                                 jax.random.fold_in(rollout_key, run.iteration), seed=seed,
                                 version=int(state.step), ledger=ledger, recorder=recorder,
                                 replay=replay)
    resumed_at = run.env_steps
    discarded = {unit: checkpointed.in_flight(unit) for unit in ledger_lib.UNITS}
    progress = metrics_lib.Progress(config.total_env_steps, run.env_steps,
                                    config.log.progress and distributed.is_primary())
    # Off a terminal (a log file), the same figures as lines at a steady pace.
    lines = progress_lib.PhaseLog(
        "RL (env steps)", config.total_env_steps,
        0.0 if progress_lib.on_terminal() and config.log.progress else config.log.progress_every_s,
        initial=run.env_steps)
    last_eval = run.warm_start_eval
    rl_start, rl_start_steps = time.perf_counter(), run.env_steps
    guard = learner_lib.DivergenceGuard(config.ppo.max_bad_updates, "RL update")

    # The RL loop: after each update, log, evaluate and checkpoint.
    with _stop_on_sigint(pipe):
      try:
        t_update = time.perf_counter()
        for info in pipe.updates(state, run.env_steps, config.total_env_steps):
          state = info.state
          now = time.perf_counter()
          learner_s, t_update = now - t_update, now
          run.iteration += 1
          run.env_steps += info.env_steps + info.dropped_env_steps
          sps = pipe.totals()["rollout_env_steps"] / (now - rl_start)
          window = pipe.meters.window()
          s.writer.write(run.env_steps, "train", dict(
              info.metrics, env_steps_per_s=sps, iteration_s=learner_s,
              dropped_env_steps=info.dropped_env_steps, **window))
          guard.check(float(info.metrics["nonfinite"]), run.iteration)  # (after its record)
          done = run.env_steps >= config.total_env_steps
          if run.iteration % config.eval.every_iters == 0 or done:
            last_eval = _evaluate(config, s, state.params, eval_key)
            s.writer.write(run.env_steps, "eval", last_eval)
          if run.iteration % config.checkpoint.every_iters == 0 or done:
            _save(s, run, state, pipe)
          figures = dict(sps=sps, success=window.get("success_rate", 0.0),
                         eval=last_eval["success_rate"], loss=info.metrics["loss"])
          progress.update(run.env_steps, **figures)
          if distributed.is_primary():
            lines.tick(run.env_steps, **figures)
      finally:
        progress.close()
        pipe.stop()
        if pipe.interrupted:  # Ctrl-C: the last finished update's state is saved.
          _save(s, run, state, pipe)
          log.warning("interrupted: saved checkpoint %d (policy version %d); rerun with "
                      "--config.resume=True to continue", run.iteration, int(state.step))
        elif pipe.replay_ended:  # Where the recorded session ended; its save, if it made one.
          if run.iteration in replay.saves:
            _save(s, run, state, pipe)
          log.warning("replay: the recorded session ends at iteration %d (%s); %s",
                      run.iteration, replay.end or "its run was killed there",
                      "replay its next session with --config.resume=True"
                      if len(schedule_lib.sessions(config.replay)) > 1 else
                      "it has no later session")
    ledger_report = pipe.settle()  # (a collective: every process gets here)
    pipeline_metrics = pipe.meters.record()
    s.writer.write(run.env_steps, "pipeline", pipeline_metrics)
    if config.pipeline.timeline and distributed.is_primary():
      pipe.save_timeline(os.path.join(workdir, "timeline.json"))
    export_dir = checkpoint_lib.export_policy(os.path.join(workdir, "export"), state.params,
                                              config.to_json_best_effort(),
                                              write_config=distributed.is_primary())
    if distributed.is_primary():  # (the export acts correctly with nothing else)
      norm_lib.save_normalizer(export_dir, s.normalizer)
      policy_io.write_spec(export_dir, s.spec)
    wall_s = time.perf_counter() - t_start
    summary = dict(
        # Rates over this process's life: after a resume, the steps it ran in its time.
        env_steps=run.env_steps, env_steps_this_process=run.env_steps - resumed_at,
        wall_s=round(wall_s, 2),
        env_steps_per_s=round((run.env_steps - resumed_at) / wall_s, 2),
        rl_env_steps_per_s=round((run.env_steps - rl_start_steps)
                                 / max(time.perf_counter() - rl_start, 1e-9), 2),
        success_rate=last_eval["success_rate"],
        success_rate_source=(f"evaluation of {int(last_eval['num_episodes'])} fixed-seed "
                             f"episodes with {_eval_policy_name(config)}"),
        warm_start_success_rate=run.warm_start_success_rate,
        train_success_rate_recent=pipeline_metrics.get("success_rate"),
        iterations=run.iteration, policy_version=int(state.step), export_dir=export_dir,
        pipeline=pipe.mode_name, **pipe.totals(), num_processes=jax.process_count(),
        staleness_mean=pipeline_metrics.get("staleness_mean", 0.0),
        nonfinite_updates=guard.total,
        discarded_on_resume=discarded if config.resume else None,
        # Where every env step the run produced went (its whole history, every process).
        ledger=ledger_report, env_steps_unaccounted=ledger_report["env_steps"]["unaccounted"],
        interrupted=pipe.interrupted)
    s.writer.write(run.env_steps, "summary", {k: v for k, v in summary.items()
                                              if isinstance(v, (int, float))
                                              and k != "env_steps"})
  return summary
