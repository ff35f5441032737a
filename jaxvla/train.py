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

from jaxvla import config_checks, metrics as metrics_lib, progress as progress_lib
from jaxvla import warm_start as warm_start_lib
from jaxvla.data import norm_stats as norm_lib
from jaxvla.envs import make_vec_env, normalized, protocol
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.learner import algorithm as algorithm_lib
from jaxvla.learner import guard as guard_lib
from jaxvla.learner import learner as learner_lib
from jaxvla.learner import update as update_lib
from jaxvla.models import contract, openpi_import, policy as policy_lib
from jaxvla.models import fast_tokenizer as fast_lib
from jaxvla.parallel import distributed
from jaxvla.parallel import sharding as sharding_lib
from jaxvla.runtime import ledger as ledger_lib
from jaxvla.runtime import pipeline as pipeline_lib
from jaxvla.runtime import replay as replay_lib
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


@dataclasses.dataclass(frozen=True)
class Keys:
  """The run's random keys, derived once from ``config.seed``: the initial params', the
  warm start's, the RL optimizer state's, every evaluation's (the same key each time:
  the same episodes and sampler noise, so a change in success between two evaluations
  is the policy's change, not another draw) and the rollout sampler's."""
  init: jax.Array
  bc: jax.Array
  rl: jax.Array
  eval: jax.Array
  rollout: jax.Array

  @classmethod
  def derive(cls, seed: int) -> "Keys":
    setup, rollout, _ = jax.random.split(jax.random.PRNGKey(seed), 3)
    init, bc, rl, ev = jax.random.split(setup, 4)
    return cls(init=init, bc=bc, rl=rl, eval=ev, rollout=rollout)


@dataclasses.dataclass
class Start:
  """Where RL starts: the train state, the run's progress and the normalisation between
  env and policy (restored from a checkpoint, or made by the warm start)."""
  state: learner_lib.TrainState
  run: RunState
  normalizer: norm_lib.Normalizer | None


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
    checkpointer = checkpoint_lib.Checkpointer(
        os.path.join(workdir, "checkpoints"), config.checkpoint.max_to_keep,
        keep_steps=(0,) if config.checkpoint.keep_warm_start else ())
    closing.callback(checkpointer.close)
    # Evaluation and demonstrations play independent episodes (no GRPO groups).
    eval_env = _eval_env(config) if distributed.is_primary() else None
    if eval_env is not None:
      closing.callback(eval_env.close)
    model = config.model
    if model.name == "pi0_fast":  # (its vocabulary sizes the network: fitted first)
      model = model.copy_and_resolve_references()
      model.fast_tokenizer_path = warm_start_lib.fast_tokenizer_dir(config, workdir, env.spec)
    policy = policy_lib.make_policy(model, env.spec)
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
  if config.model.name == "pi0_fast":
    return "greedy (argmax) FAST token decoding"
  return f"the '{config.model.eval_sampler}' sampler"


def _evaluate(config, s: Setup, normalizer: norm_lib.Normalizer | None, params, rng
              ) -> dict[str, float]:
  """Evaluation on fixed-seed episodes; every process calls it, process 0 plays them."""
  # (Multi-process: collectives, the gather here and the broadcast below.)
  params = distributed.local_replica(params, s.learner.mesh)
  if s.eval_env is None:
    result = dict.fromkeys(evaluate_lib.EVAL_KEYS, 0.0)
  else:  # The same episodes (fixed seed) and noise (the key) every time: paired.
    result = evaluate_lib.evaluate(normalized.wrap(s.eval_env, normalizer), s.policy,
                                    s.act_eval, params, rng,
                                    seed=config.seed + evaluate_lib.EVAL_SEED_OFFSET,
                                    chunk_len=config.model.chunk_len)
  return distributed.broadcast_from_primary(result)


# What acts only while a fresh run builds its first parameters: the model's init (openpi's
# weights, the steering head's initial std) and the warm start (its demonstrations and BC).
# A resume restores its checkpoint's parameters and normalisation instead, so a change to
# one of these would do nothing: it is refused (a section's name covers all its keys).
FRESH_ONLY = ("bc", "data", "model.init_checkpoint", "model.steer_std_init")


def _differences(config, written: dict, names) -> list[str]:
  """``config.X.k: 'a' -> 'b'`` for each key of ``names`` (sections, or ``section.key``)
  whose value differs from the config a workdir's run wrote (compared as JSON). A key
  either side lacks (one added or retired since that run) is not a change."""
  changed = []
  for name in names:
    section, _, key = name.partition(".")
    now, then = json.loads(config[section].to_json_best_effort()), written.get(section, {})
    changed += [f"config.{section}.{k}: {then[k]!r} -> {now[k]!r}"
                for k in ([key] if key else sorted(now)) if k in then and then[k] != now[k]]
  return changed


def _changed_keys(config, written: dict | None) -> str:
  """`` (config.model.X: 'a' -> 'b', ...)`` against the config a checkpoint's run wrote:
  the model's keys and the RL update's (both shape the checkpoint's train state)."""
  changed = _differences(config, written, ("model", "rl")) if written else []
  return f" (changed since that run: {', '.join(changed)})" if changed else ""


def _initial_state(config, s: Setup, keys: Keys, written: dict | None = None,
                   replay_at: int | None = None) -> Start:
  """Restores the latest checkpoint (``config.resume``) or warm-starts a fresh policy.

  ``written``: the config the workdir's run wrote (its ``config.json``), if any.
  ``replay_at``: a resumed replay restores the checkpoint of this iteration, where the
  recorded session it replays started.
  """
  if config.resume:  # (a checkpoint exists, and none without it: checked by _train)
    # The restore target's structure and shardings, computed abstractly (nothing is
    # allocated); orbax reads every array straight into its shards.
    abstract = jax.eval_shape(lambda: learner_lib.init_state(
        s.policy.init(keys.init), s.learner.ppo_tx, keys.rl))
    abstract = sharding_lib.with_shardings(abstract, s.learner.state_shardings(abstract))
    step, state, meta = s.checkpointer.restore_latest(abstract, _changed_keys(config, written),
                                                      at_most=replay_at)
    if replay_at is not None and step != replay_at:
      raise ValueError(f"config.replay: the recorded session to replay next started at "
                       f"iteration {replay_at}, but {s.checkpointer.manager.directory} holds "
                       f"no checkpoint {replay_at} (the newest before it: {step})")
    run = RunState.from_meta(meta)
    normalizer = (None if run.normalizer is None
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
    return Start(state, run, normalizer)
  t0 = time.perf_counter()
  # Fresh, or openpi's weights (config.model.init_checkpoint) read straight into
  # their shards, with fresh RL heads.
  params = openpi_import.init_params(s.policy, keys.init, config.model.init_checkpoint,
                                     s.learner.param_shardings)
  params, normalizer, bc_metrics = warm_start_lib.warm_start(
      config, s.learner, s.policy, s.spec, s.workdir, params, keys.bc)
  run = RunState(bc_wall_s=time.perf_counter() - t0,
                 normalizer=None if normalizer is None else normalizer.to_json())
  run.warm_start_eval = _evaluate(config, s, normalizer, params, keys.eval)
  run.warm_start_success_rate = run.warm_start_eval["success_rate"]
  s.writer.write(0, "warm_start", dict(bc_metrics, **run.warm_start_eval,
                                       **contract.host_counts(s.policy), wall_s=run.bc_wall_s))
  log.info("warm start: %s eval=%s", bc_metrics, run.warm_start_eval)
  state = s.learner.shard_state(learner_lib.init_state(params, s.learner.ppo_tx, keys.rl))
  s.checkpointer.save(0, state, dataclasses.asdict(run))
  return Start(state, run, normalizer)


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
    pipe.schedule.note("save", iteration=run.iteration)


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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs the job described by ``config`` in ``workdir``; returns the final summary.

  Raises:
    workdir_lib.WorkdirInUse: another live run holds ``workdir``.
    ValueError: a resume changes a key that acts only in a fresh run (:data:`FRESH_ONLY`).
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
  """:func:`train_and_evaluate` once the workdir is this run's: prepare the workdir, build,
  the initial state, the RL loop, finish."""
  written, replay_at = _prepare_workdir(config, workdir)
  keys = Keys.derive(config.seed)
  with _build(config, workdir) as s:
    start = _initial_state(config, s, keys, written, replay_at if config.resume else None)
    if config.resume:  # (a fresh run wrote it before its warm start)
      _write_config(config, workdir)
    pipe = _pipeline(config, s, start, keys, replay_at)
    rl = _rl_loop(config, s, start, pipe, keys.eval)
    return dataclasses.asdict(_finish(config, s, start, pipe, rl, t_start))


def _write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  if distributed.is_primary():
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      f.write(config.to_json_best_effort(indent=2))


def _prepare_workdir(config: ml_collections.ConfigDict, workdir: str
                     ) -> tuple[dict | None, int | None]:
  """Checks that the workdir fits ``config.resume`` and ``config.replay`` (before anything
  is written or started: a refused run must not overwrite the earlier run's config.json,
  which its resume compares against), then writes a fresh run's config.json.

  Returns the config the workdir's run wrote (a resume's, to name what changed on a
  mismatch) and the iteration of the recorded session a replay follows.
  """
  saved = checkpoint_lib.saved_steps(os.path.join(workdir, "checkpoints"))
  if config.resume and not saved:
    raise FileNotFoundError(
        f"--config.resume=True but {os.path.join(workdir, 'checkpoints')!r} holds no "
        "checkpoint; check --workdir, or drop --config.resume to start a new run there")
  if saved and not config.resume:
    raise FileExistsError(
        f"the workdir already holds checkpoint {saved[-1]}; pass --config.resume=True to "
        "continue it or choose another --workdir")
  replay_at = replay_lib.check_request(config, workdir) if config.replay else None
  os.makedirs(workdir, exist_ok=True)
  config_path = os.path.join(workdir, "config.json")
  written = None
  if config.resume and os.path.exists(config_path):
    with open(config_path, encoding="utf-8") as f:
      written = json.load(f)
    fresh_only = _differences(config, written, FRESH_ONLY)
    if fresh_only:
      raise ValueError(
          f"--config.resume=True: {', '.join(fresh_only)} acts only when a fresh run builds "
          f"its parameters (init and warm start), and a resume restores its checkpoint's; "
          f"keep the value {config_path} holds, or start a new run in another --workdir")
  if not config.resume:  # (a resume's, once its checkpoint is known to fit)
    _write_config(config, workdir)
  return written, replay_at


def _schedule(config, s: Setup, start: Start, seed: int, replay_at: int | None):
  """The session's schedule: live (with its log, ``pipeline.schedule_log``) or replayed."""
  run, state = start.run, start.state
  recorder = None
  if config.pipeline.schedule_log:
    recorder = schedule_lib.Recorder(
        schedule_lib.session_path(s.workdir, run.iteration, jax.process_index(),
                                  jax.process_count()),
        iteration=run.iteration, version=int(state.step), env_steps=run.env_steps,
        seed=seed, mode=config.pipeline.mode, process=jax.process_index(),
        num_processes=jax.process_count(), platform=schedule_lib.platform())
    s.closing.callback(recorder.close)
  if replay_at is None:
    return schedule_lib.LiveSchedule(recorder)
  session = replay_lib.open_session(config.replay, replay_at, int(state.step), seed)
  return replay_lib.ReplaySchedule(session, recorder)


def _pipeline(config, s: Setup, start: Start, keys: Keys, replay_at: int | None
              ) -> pipeline_lib.Pipeline:
  """The RL phase's pipeline, from where ``start`` left the run."""
  run = start.run
  rollout_key = keys.rollout
  if jax.process_count() > 1:  # Each process samples its own actions.
    rollout_key = jax.random.fold_in(rollout_key, jax.process_index())
  seed = distributed.host_seed(config.seed + run.iteration)
  builder, items = algorithm_lib.get(config.algorithm).builder(config, s.spec)
  acting = pipeline_lib.Acting(
      env=normalized.wrap(s.env, start.normalizer), policy=s.policy, act_fn=s.act_train,
      value_fn=s.value_fn, builder=builder, items_per_update=items,
      rng=jax.random.fold_in(rollout_key, run.iteration), seed=seed)
  return pipeline_lib.Pipeline(
      config.pipeline, s.learner, acting, s.rollout_sharding, version=int(start.state.step),
      ledger=ledger_lib.Ledger.from_meta(run.ledger).resumed(),  # (fresh: nothing to discard)
      schedule=_schedule(config, s, start, seed, replay_at))


@dataclasses.dataclass
class _RL:
  """What the RL loop leaves for the summary."""
  last_eval: dict
  nonfinite_updates: int
  start_s: float  # When RL started, and at how many env steps.
  start_env_steps: int
  discarded: dict  # In-flight data of the checkpoint resumed from, discarded (per unit).
  ledger: dict  # Ledger.report() of the whole run.
  pipeline_metrics: dict


def _rl_loop(config, s: Setup, start: Start, pipe: pipeline_lib.Pipeline, eval_key) -> _RL:
  """The RL loop: after each update, log, evaluate and checkpoint (``start.state`` and
  ``start.run`` advance); on Ctrl-C the last finished update is saved."""
  run = start.run
  progress = metrics_lib.Progress(config.total_env_steps, run.env_steps,
                                  config.log.progress and distributed.is_primary())
  # Off a terminal (a log file), the same figures as lines at a steady pace.
  lines = progress_lib.PhaseLog(
      "RL (env steps)", config.total_env_steps,
      0.0 if progress_lib.on_terminal() and config.log.progress else config.log.progress_every_s,
      initial=run.env_steps)
  checkpointed = ledger_lib.Ledger.from_meta(run.ledger)  # (before _save replaces it)
  rl = _RL(last_eval=run.warm_start_eval, nonfinite_updates=0, start_s=time.perf_counter(),
           start_env_steps=run.env_steps, ledger={}, pipeline_metrics={},
           discarded={unit: checkpointed.in_flight(unit) for unit in ledger_lib.UNITS})
  guard = guard_lib.DivergenceGuard(config.rl.max_bad_updates, "RL update")
  with _stop_on_sigint(pipe):
    try:
      t_update = time.perf_counter()
      for info in pipe.updates(start.state, run.env_steps, config.total_env_steps):
        start.state = info.state
        now = time.perf_counter()
        learner_s, t_update = now - t_update, now
        run.iteration += 1
        run.env_steps = info.run_env_steps
        sps = pipe.totals()["rollout_env_steps"] / (now - rl.start_s)
        window = pipe.meters.window()
        s.writer.write(run.env_steps, "train", dict(
            info.metrics, env_steps_per_s=sps, iteration_s=learner_s,
            dropped_env_steps=info.dropped_env_steps, **window,
            **contract.host_counts(s.policy)))
        guard.check(float(info.metrics["nonfinite"]), run.iteration)  # (after its record)
        done = run.env_steps >= config.total_env_steps
        if run.iteration % config.eval.every_iters == 0 or done:
          rl.last_eval = _evaluate(config, s, start.normalizer, start.state.params, eval_key)
          s.writer.write(run.env_steps, "eval", rl.last_eval)
        if run.iteration % config.checkpoint.every_iters == 0 or done:
          _save(s, run, start.state, pipe)
        figures = dict(sps=sps, success=window.get("success_rate", 0.0),
                       eval=rl.last_eval["success_rate"], loss=info.metrics["loss"])
        progress.update(run.env_steps, **figures)
        if distributed.is_primary():
          lines.tick(run.env_steps, **figures)
    finally:
      progress.close()
      pipe.stop()
      _after_stop(config, s, start, pipe)
  rl.nonfinite_updates = guard.total
  rl.ledger = pipe.settle()  # (a collective: every process gets here)
  rl.pipeline_metrics = pipe.meters.record()
  s.writer.write(run.env_steps, "pipeline", rl.pipeline_metrics)
  return rl


def _after_stop(config, s: Setup, start: Start, pipe: pipeline_lib.Pipeline) -> None:
  """A run stopped early saves where it stopped: on Ctrl-C the last finished update;
  a replay whose log ended there, the recorded session's save, if it made one."""
  run = start.run
  if pipe.stopped is pipeline_lib.Stop.INTERRUPTED:
    _save(s, run, start.state, pipe)
    log.warning("interrupted: saved checkpoint %d (policy version %d); rerun with "
                "--config.resume=True to continue", run.iteration, int(start.state.step))
  elif pipe.stopped is pipeline_lib.Stop.LOG_ENDED:
    session = pipe.schedule.session
    if run.iteration in session.saves:
      _save(s, run, start.state, pipe)
    log.warning("replay: the recorded session ends at iteration %d (%s); %s",
                run.iteration, session.end or "its run was killed there",
                "replay its next session with --config.resume=True"
                if len(schedule_lib.sessions(config.replay)) > 1 else
                "it has no later session")


@dataclasses.dataclass(frozen=True)
class Summary:
  """What :func:`train_and_evaluate` returns (as a dict) and ``jaxvla.main`` prints.

  Rates are over this process's life: after a resume, the steps it ran in its time.
  """
  env_steps: int  # RL env steps of the whole run (every process).
  env_steps_this_process: int  # ... of this process's life (after a resume).
  wall_s: float
  env_steps_per_s: float  # env_steps_this_process / wall_s (demonstrations and BC included).
  rl_env_steps_per_s: float  # RL env steps per second of RL.
  success_rate: float  # The last evaluation's.
  success_rate_source: str
  warm_start_success_rate: float | None
  train_success_rate_recent: float | None  # The rollout's recent episodes.
  iterations: int
  policy_version: int
  export_dir: str
  pipeline: str  # The mode's name (with its levels).
  rollout_env_steps: int  # Env steps every process's rollout produced in this session ...
  dropped_env_steps: int  # ... and dropped as too stale.
  num_processes: int
  staleness_mean: float
  nonfinite_updates: int
  discarded_on_resume: dict | None  # In-flight data a resume discarded (per unit).
  ledger: dict  # Where every env step the run produced went (its whole history).
  env_steps_unaccounted: int
  interrupted: bool


def _finish(config, s: Setup, start: Start, pipe: pipeline_lib.Pipeline, rl: _RL,
            t_start: float) -> Summary:
  """Writes the timeline and the export; returns the summary (also written as metrics)."""
  run, state = start.run, start.state
  if config.pipeline.timeline and distributed.is_primary():
    pipe.save_timeline(os.path.join(s.workdir, "timeline.json"))
  export_dir = checkpoint_lib.export_policy(os.path.join(s.workdir, "export"), state.params,
                                            config.to_json_best_effort(),
                                            write_config=distributed.is_primary())
  if distributed.is_primary():  # (the export acts correctly with nothing else)
    norm_lib.save_normalizer(export_dir, start.normalizer)
    policy_io.write_spec(export_dir, s.spec)
    fast_lib.save_beside(export_dir, s.policy)  # (pi0-FAST's tokenizer)
  wall_s = time.perf_counter() - t_start
  summary = Summary(
      env_steps=run.env_steps, env_steps_this_process=run.env_steps - rl.start_env_steps,
      wall_s=round(wall_s, 2),
      env_steps_per_s=round((run.env_steps - rl.start_env_steps) / wall_s, 2),
      rl_env_steps_per_s=round((run.env_steps - rl.start_env_steps)
                               / max(time.perf_counter() - rl.start_s, 1e-9), 2),
      success_rate=rl.last_eval["success_rate"],
      success_rate_source=(f"evaluation of {int(rl.last_eval['num_episodes'])} fixed-seed "
                           f"episodes with {_eval_policy_name(config)}"),
      warm_start_success_rate=run.warm_start_success_rate,
      train_success_rate_recent=rl.pipeline_metrics.get("success_rate"),
      iterations=run.iteration, policy_version=int(state.step), export_dir=export_dir,
      pipeline=pipe.mode_name, **pipe.totals(), num_processes=jax.process_count(),
      staleness_mean=rl.pipeline_metrics.get("staleness_mean", 0.0),
      nonfinite_updates=rl.nonfinite_updates,
      discarded_on_resume=rl.discarded if config.resume else None,
      ledger=rl.ledger, env_steps_unaccounted=rl.ledger["env_steps"]["unaccounted"],
      interrupted=pipe.interrupted)
  s.writer.write(run.env_steps, "summary", {
      k: v for k, v in dataclasses.asdict(summary).items()
      if isinstance(v, (int, float)) and k != "env_steps"})
  return summary
