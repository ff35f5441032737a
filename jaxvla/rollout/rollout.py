"""The rollout driver: acting on an env batch with a policy, chunk by chunk.

:class:`Rollout` drives an env batch in one of two ways:

* lockstep (:meth:`Rollout.step_all`): every env steps one chunk per inference
  batch (any ``VecEnv``; the synchronous baselines);
* first-ready (:meth:`Rollout.step_ready`, level 2): an ``AsyncVecEnv``'s
  ``recv(b_max, t_max)`` returns the envs that are ready, inference runs on them
  and their next chunks are sent at once, so a slow env never holds up the rest.

Every acted chunk and every result goes to a *builder*, which cuts them into
queue items: :class:`jaxvla.rollout.segments.SegmentBuilder` (PPO segments with
their GAE bootstrap values, and the values of the last observations of episodes
truncated by the time limit) or :class:`jaxvla.rollout.groups.EpisodeBuilder`
(GRPO groups of whole episodes).

Parameters come from a ``params_fn() -> (params, version)`` (the weight
broadcast's latest copy or the learner's own state), read once per inference
batch, so a chunk is always produced by one version.

First-ready batches have any size from 1 to the number of envs; inference pads
each to a bucket (:func:`bucket_size`: powers of two, and the env count) so the
jitted ``act`` / ``value`` compile a handful of shapes, not one per size (a
full-size model compiles for seconds). Padded rows repeat row 0 and are cut from
the outputs. Every bucket is compiled when first-ready stepping starts
(:meth:`Rollout.compile_buckets`), so no compilation stalls the rollout later in
the run (each one stalled it for seconds on CPU, measured in the benchmark).
Lockstep acts on every env at once and so only ever compiles the full size: its
value batches are padded to it too.

Timing's decisions (the params version of each inference call, the envs the pacer
admits, the envs a first-ready ``recv`` returns, where a worker restarts) come from a
step schedule (:mod:`jaxvla.rollout.steps`): live, and written to the schedule log if
there is one, or replayed from a recorded session's log
(:class:`jaxvla.runtime.replay.ReplayedSteps`), so that the same items reach the queue
in the same order. The rollout itself never branches on which.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

import jax
import numpy as np

from jaxvla import timing, types
from jaxvla.envs import protocol
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.models import contract
from jaxvla.rollout import pacer as pacer_lib
from jaxvla.rollout import segments as segments_lib
from jaxvla.rollout import steps as steps_lib
from jaxvla.rollout.segments import rows

log = logging.getLogger(__name__)

# The rollout's stages on the pipeline's clock.
STAGES = ("env", "inference")


class Builder(Protocol):
  """Where a :class:`Rollout` sends chunks: segments (PPO) or episode groups (GRPO)."""

  def starts(self, env_ids: np.ndarray) -> np.ndarray:
    """``bool [b]``: which of ``env_ids`` start a new segment/episode with their next chunk."""

  def on_act(self, env_ids: np.ndarray, batch: dict, out: contract.ActOutput,
             version: int) -> None:
    """Records the chunk each of ``env_ids`` ``[b]`` is about to execute."""

  def on_result(self, env_ids: np.ndarray, result: protocol.ChunkStep) -> np.ndarray:
    """Completes the chunks of ``env_ids``; returns the rows that need a bootstrap value."""

  def final_obs(self, env_ids: np.ndarray) -> list[protocol.Observation]:
    """The last observations of the truncated episodes in the segments of ``env_ids``
    (rows :meth:`on_result` returned), whose values :meth:`complete` takes."""

  def complete(self, env_ids: np.ndarray, bootstrap_values: np.ndarray,
               final_values: np.ndarray) -> None:
    """Closes the segments of ``env_ids`` with their bootstrap values ``[b]`` and the
    values ``[k]`` of their :meth:`final_obs`."""

  def pop_items(self) -> list[types.Item]:
    """The queue items completed so far (each returned once)."""

  def in_flight(self) -> types.Counts:
    """Segments (or episodes), chunks and env steps started but not yet returned as
    items; chunks and env steps count only chunks whose result arrived."""


def bucket_size(n: int, limit: int, minimum: int = 1) -> int:
  """The padded batch size of ``n`` rows: the next power of two, at least ``minimum``
  and at most ``limit``.

  Args:
    n: rows in the batch, ``1 <= n <= limit``.
    limit: the largest batch (the env count): always a bucket of its own.
    minimum: the smallest bucket (``pipeline.min_bucket``): fewer programs to compile,
      where a small batch costs an accelerator as much as a larger one.
  """
  if not 1 <= n <= limit:
    raise ValueError(f"batch of {n} rows is outside [1, {limit}]")
  return min(max(1 << (n - 1).bit_length(), minimum), limit)


def bucket_sizes(limit: int, minimum: int = 1) -> list[int]:
  """Every padded batch size :func:`bucket_size` can return for ``limit`` envs."""
  return sorted({bucket_size(n, limit, minimum)
                 for n in (1 << k for k in range(limit.bit_length()))} | {limit})


def pad_rows(tree: Any, size: int) -> Any:
  """``tree``'s leaves ``[n, ...]`` padded to ``[size, ...]`` by repeating row 0."""
  def pad(x):
    x = np.asarray(x)
    n = x.shape[0]
    if n == size:
      return x
    return np.concatenate([x, np.repeat(x[:1], size - n, axis=0)])
  return jax.tree.map(pad, tree)


class Rollout:
  """Acts on an env batch and feeds a :class:`Builder`.

  Args:
    env: the env batch (an ``AsyncVecEnv`` such as the env pool for first-ready
      stepping).
    policy: the policy contract; act_fn: jitted ``(params, batch, rng) -> ActOutput``
      (the training sampler); value_fn: jitted ``(params, batch) -> [B]``.
    params_fn: ``() -> (params, version)``, read once per inference batch.
    builder: where chunks go.
    rng: key of the sampler; seed: the env's reset seed.
    clock: the pipeline's :class:`jaxvla.timing.StageClock` (stages ``env`` and
      ``inference``, counters ``pace_wait_s``, ``rollout_recv_wait_s``,
      ``rollout_compile_s``); a private one when None.
    pacer: the :class:`Pacer` of ``staleness_control='pace'``, or None.
    first_ready: ``(b_max, t_max_s)`` to step first-ready batches (level 2);
      None steps every env in lockstep.
    min_bucket: first-ready inference batches are padded to at least this many rows
      (:func:`bucket_size`).
    schedule: the step schedule (:mod:`jaxvla.rollout.steps`); None: live, unlogged
      (:class:`jaxvla.rollout.steps.LiveSteps` over ``params_fn``).
  """

  def __init__(self, env: protocol.VecEnv, policy: contract.Policy, act_fn: Callable,
               value_fn: Callable, params_fn: Callable[[], tuple[Any, int]],
               builder: Builder, rng: jax.Array, seed: int,
               clock: timing.StageClock | None = None, pacer: pacer_lib.Pacer | None = None,
               first_ready: tuple[int, float] | None = None, min_bucket: int = 1,
               schedule: steps_lib.StepSchedule | None = None):
    if first_ready is not None and not isinstance(env, protocol.AsyncVecEnv):
      raise TypeError("first-ready stepping needs an AsyncVecEnv with send / recv (the env "
                      f"pool: config.env_workers > 0), got {type(env).__name__}")
    self.env, self.policy = env, policy
    self.act_fn, self.value_fn, self.params_fn = act_fn, value_fn, params_fn
    self.builder, self.rng, self.seed = builder, rng, seed
    if clock is None:  # Standalone (tests, benchmarks): a clock of its own, running.
      clock = timing.StageClock(STAGES)
      clock.start()
    self.clock = clock
    self.pacer, self.first_ready, self.min_bucket = pacer, first_ready, min_bucket
    self.episodes = evaluate_lib.EpisodeTracker()
    self.num_acts = 0
    # Env steps and chunks whose results arrived: produced, in the ledger's terms. One
    # tuple, replaced at once, so another thread reads a consistent pair.
    self.produced = types.Counts()
    self._obs: protocol.Observation | None = None  # Lockstep: the next observation.
    self._started_ready = False
    self._in_flight = 0  # First-ready: envs with a chunk sent and not yet received.
    self._parked_ids = np.zeros((0,), np.int64)  # ... ready, waiting for the pacer.
    self._parked_obs: protocol.Observation | None = None
    self._env_busy_since: float | None = None  # First-ready: some env stepping since.
    self.schedule = steps_lib.LiveSteps(params_fn) if schedule is None else schedule
    self.schedule.attach(env)
    self.num_steps = 0
    self._items_made = 0

  def step(self) -> None:
    """One inference batch: lockstep (:meth:`step_all`) or first-ready (:meth:`step_ready`),
    one step of the schedule.

    Raises:
      Closed: replaying, past the recorded rollout's last step.
    """
    self.schedule.begin(self.num_steps)
    if self.first_ready is None:
      self.step_all()
    else:
      self.step_ready(*self.first_ready)
    self.schedule.end(self.num_steps)
    self.num_steps += 1

  def pop_items(self) -> list[types.Item]:
    """The queue items the builder completed since the last call, numbered in order."""
    items = self.builder.pop_items()
    for item in items:
      item.seq, self._items_made = self._items_made, self._items_made + 1
    return items

  @property
  def env_steps(self) -> int:
    """Env steps whose results arrived (this process's rollout, since it started)."""
    return self.produced.env_steps

  def in_flight(self) -> types.Counts:
    """Segments (or episodes), chunks and env steps produced but not yet returned as
    items (chunks acted on but not yet back are not counted)."""
    return self.builder.in_flight()

  # ------------------------------------------------------------- inference --
  def _act(self, env_ids: np.ndarray, obs: protocol.Observation, version: int | None
           ) -> np.ndarray:
    """Inference on ``env_ids``'s ``obs``; records the chunks; returns actions ``[b, H, A]``.

    ``version``: the version the pacer granted these envs' segment starts (None
    without a pacer); the params acted with are at least that new.
    """
    params, got = self.schedule.params(for_values=False)
    if version is not None and got < version:  # (params_fn is monotone; defensive)
      raise RuntimeError(f"rollout params version {got} is older than the paced {version}")
    with self.clock.busy("inference"):
      batch = self.policy.prepare(obs)
      key = jax.random.fold_in(self.rng, self.num_acts)
      n = len(env_ids)
      padded = pad_rows(batch, self._padded_size(n))
      out = jax.tree.map(lambda x: x[:n], jax.device_get(self.act_fn(params, padded, key)))
    self.num_acts += 1
    self.builder.on_act(env_ids, batch, out, got)
    return np.asarray(out.actions)

  def _admit(self, env_ids: np.ndarray, block: bool) -> tuple[np.ndarray, int | None]:
    """Rows of ``env_ids`` that may act now, and the version the pacer granted.

    Envs continuing a segment always may; envs starting one need a grant.
    ``block``: wait for at least one grant (only when nothing is in flight: every
    open segment is then done and already handed on, so the learner can advance
    the version); otherwise refused starts are parked and retried later.
    """
    return self.schedule.admit(env_ids, lambda: self._pace(env_ids, block))

  def _pace(self, env_ids: np.ndarray, block: bool) -> tuple[np.ndarray, int | None]:
    """:meth:`_admit` by the pacer's grants."""
    if self.pacer is None:
      return np.arange(len(env_ids)), None
    starting = self.builder.starts(env_ids)
    continuing = np.flatnonzero(~starting)
    with self.clock.timed("pace_wait_s"):
      granted, version = self.pacer.acquire(int(starting.sum()), self.params_fn()[1],
                                            block=block and continuing.size == 0)
    admitted = np.sort(np.concatenate([continuing, np.flatnonzero(starting)[:granted]]))
    return admitted, version

  def _finish(self, env_ids: np.ndarray, result: protocol.ChunkStep) -> None:
    """Hands ``result`` to the builder; values the observations that close a segment
    (after it: the bootstrap; inside it: the last ones of time-limit truncations)."""
    self.episodes.add(result.episodes)
    self.produced = types.Counts(env_steps=self.produced.env_steps + int(result.steps.sum()),
                                 chunks=self.produced.chunks + len(env_ids))
    full = self.builder.on_result(env_ids, result)
    if full.size:
      finals = self.builder.final_obs(env_ids[full])
      values = self._values(protocol.concat_observations([result.obs.take(full), *finals]))
      self.builder.complete(env_ids[full], values[:full.size], values[full.size:])

  def _values(self, obs: protocol.Observation) -> np.ndarray:
    """``value_fn`` of ``obs`` ``[n]`` -> ``[n]``, in batches of compiled sizes.

    ``n`` may exceed the env count (bootstraps and final observations together):
    the rows go in pieces of at most ``num_envs``, each padded to its size.
    """
    params, _ = self.schedule.params(for_values=True)
    limit, n = self.env.num_envs, obs.batch_size
    starts = range(0, n, limit)
    with self.clock.busy("inference"):
      batch = self.policy.prepare(obs)
      sizes = [min(limit, n - start) for start in starts]
      out = jax.device_get([
          self.value_fn(params, pad_rows(rows(batch, slice(start, start + size)),
                                         self._padded_size(size)))
          for start, size in zip(starts, sizes)])  # Every piece dispatched, then one wait.
    return np.concatenate([np.asarray(v)[:size] for v, size in zip(out, sizes)])

  def _padded_size(self, n: int) -> int:
    """The compiled batch size ``n`` rows are padded to: their bucket first-ready (every
    bucket is compiled up front), the env count in lockstep (the one size it compiles)."""
    if self.first_ready is None:
      return self.env.num_envs
    return bucket_size(n, self.env.num_envs, self.min_bucket)

  def compile_buckets(self, obs: protocol.Observation) -> None:
    """Compiles ``act`` and ``value`` for every bucket size, before they are needed.

    Runs each once on rows of ``obs`` (outputs discarded; the sampler's key
    sequence is not advanced). The seconds go to counter ``rollout_compile_s``.
    """
    params, _ = self.params_fn()
    batch = self.policy.prepare(obs)
    key = jax.random.fold_in(self.rng, 0x7FFFFFFF)
    sizes = bucket_sizes(self.env.num_envs, self.min_bucket)
    with self.clock.timed("rollout_compile_s"):
      for size in sizes:
        padded = pad_rows(rows(batch, np.arange(min(size, self.env.num_envs))), size)
        jax.block_until_ready((self.act_fn(params, padded, key),
                               self.value_fn(params, padded)))
    log.info("rollout: act / value compiled for inference batches %s", sizes)

  # ---------------------------------------------------------------- lockstep --
  def step_all(self) -> None:
    """One chunk for every env (``env.step_chunk``), every env admitted together."""
    if self._obs is None:
      self._obs = self.schedule.reset(self.env, self.seed)
    ids = np.arange(self.env.num_envs)
    version = None
    starting = 0 if self.pacer is None else int(self.builder.starts(ids).sum())
    if starting:  # Every env at a segment boundary starts together: wait for them all.
      with self.clock.timed("pace_wait_s"):
        version = self.pacer.start(starting, self.params_fn()[1])
    actions = self._act(ids, self._obs, version)
    with self.clock.busy("env"):
      result = self.schedule.step_chunk(self.env, actions)
    self._obs = result.obs
    self._finish(ids, result)

  # ------------------------------------------------------------- first-ready --
  def step_ready(self, b_max: int, t_max_s: float) -> None:
    """One first-ready batch: ``recv(b_max, t_max)``, finish, act, ``send``.

    The env workers step in parallel with this thread; the ``env`` stage is busy
    while any chunk is in flight (recorded at the pool's send/recv calls). How much
    of the workers' capacity that used is the pool's ``stats.worker_busy_s``.
    Envs the pacer does not let start a segment yet are parked (not stepped) and
    join a later batch; the rest of the batch goes on. With every env parked, the
    call returns (so the caller hands on the segments just finished) and the next
    one waits for the pacer.
    """
    if not self._started_ready:
      self._parked_ids = np.arange(self.env.num_envs)
      self._parked_obs = self.schedule.reset(self.env, self.seed)
      self._started_ready = True
      self.compile_buckets(self._parked_obs)
    ids, obs = self._parked_ids, self._parked_obs
    nothing_in_flight = not self._in_flight  # Only the pacer can unblock the parked envs.
    if self._in_flight:
      got_ids, result = self._receive(b_max, t_max_s)
      self._finish(got_ids, result)
      if ids.size:
        ids = np.concatenate([ids, got_ids])
        obs = protocol.concat_observations([obs, result.obs])
      else:
        ids, obs = got_ids, result.obs
    admitted, version = self._admit(ids, block=nothing_in_flight)
    wait = np.setdiff1d(np.arange(len(ids)), admitted)
    self._parked_ids, self._parked_obs = ids[wait], obs.take(wait)
    if admitted.size:
      actions = self._act(ids[admitted], obs.take(admitted), version)
      self.schedule.send(self.env, actions, ids[admitted])
      self._in_flight += admitted.size
    if self._env_busy_since is None and self._in_flight:
      self._env_busy_since = time.perf_counter()

  def _receive(self, b_max: int, t_max_s: float) -> tuple[np.ndarray, protocol.ChunkStep]:
    """The next first-ready batch from the env; records the ``env`` stage's busy time."""
    with self.clock.timed("rollout_recv_wait_s"):
      got_ids, result = self.schedule.recv(self.env, b_max, t_max_s)
    now = time.perf_counter()
    self._in_flight -= len(got_ids)
    self.clock.add("env", self._env_busy_since, now)  # Some env was stepping since then.
    # Envs still in flight keep stepping while this batch is inferred and sent.
    self._env_busy_since = now if self._in_flight else None
    return got_ids, result


def collect_segments(env: protocol.VecEnv, policy: contract.Policy, act_fn: Callable,
                     value_fn: Callable, params, num_steps: int, rng: jax.Array, seed: int,
                     version: int = 0) -> types.Trajectory:
  """One lockstep segment of ``num_steps`` chunks from every env: ``Trajectory [T, B]``.

  The synchronous rollout of one PPO batch with fixed ``params`` (tests, benchmarks,
  offline checks); the pipeline drives the same :class:`Rollout` step by step.
  """
  builder = segments_lib.SegmentBuilder(env.num_envs, num_steps, env.num_envs)
  rollout = Rollout(env, policy, act_fn, value_fn, lambda: (params, version), builder, rng, seed)
  for _ in range(num_steps):
    rollout.step_all()
  (item,) = rollout.pop_items()
  return item.data
