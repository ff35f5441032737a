"""The rollout side of the pipeline: acting on env batches and cutting env segments.

:class:`SegmentBuilder` keeps, per env, the chunks of its current segment (policy
inputs, sampler chain, behaviour log-prob and value, the policy version that
acted, then reward / done / executed steps when the chunk's result arrives). When
an env has ``T`` finished chunks its segment is complete; with the value of the
observation after it (the GAE bootstrap) it becomes one column of a
``Trajectory [T, M]``, and ``M`` columns make one queue :class:`Item`.

:class:`Rollout` drives an env batch with a policy in one of two ways:

* lockstep (:meth:`Rollout.step_all`): every env steps one chunk per inference
  batch (any ``VecEnv``; the synchronous baselines);
* first-ready (:meth:`Rollout.step_ready`, level 2): an :class:`EnvPool`'s
  ``recv(b_max, t_max)`` returns the envs that are ready, inference runs on them
  and their next chunks are sent at once, so a slow env never holds up the rest.

Parameters come from a ``params_fn() -> (params, version)`` (the
:class:`ParamServer` or the learner's own state), read once per inference batch,
so a chunk is always produced by one version.

First-ready batches have any size from 1 to the number of envs; inference pads
each to a bucket (:func:`bucket_size`: powers of two, and the env count) so the
jitted ``act`` / ``value`` compile a handful of shapes, not one per size (a
full-size model compiles for seconds). Padded rows repeat row 0 and are cut from
the outputs. Every bucket is compiled when first-ready stepping starts
(:meth:`Rollout.compile_buckets`), so no compilation stalls the rollout later in
the run (each one stalled it for seconds on CPU, measured in the benchmark).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxvla.envs import protocol
from jaxvla.models import policy as policy_lib
from jaxvla.rollout import collector as collector_lib
from jaxvla.rollout import trajectory as trajectory_lib
from jaxvla.runtime import queue as queue_lib

log = logging.getLogger(__name__)

_STEP_FIELDS = ("chain", "log_prob", "value", "version")


def bucket_size(n: int, limit: int) -> int:
  """The padded batch size of ``n`` rows: the next power of two, at most ``limit``.

  Args:
    n: rows in the batch, ``1 <= n <= limit``.
    limit: the largest batch (the env count): always a bucket of its own.
  """
  if not 1 <= n <= limit:
    raise ValueError(f"batch of {n} rows is outside [1, {limit}]")
  return min(1 << (n - 1).bit_length(), limit)


def bucket_sizes(limit: int) -> list[int]:
  """Every padded batch size :func:`bucket_size` can return for ``limit`` envs."""
  return sorted({bucket_size(n, limit) for n in (1 << k for k in range(limit.bit_length()))}
                | {limit})


def pad_rows(tree: Any, size: int) -> Any:
  """``tree``'s leaves ``[n, ...]`` padded to ``[size, ...]`` by repeating row 0."""
  def pad(x):
    x = np.asarray(x)
    n = x.shape[0]
    if n == size:
      return x
    return np.concatenate([x, np.repeat(x[:1], size - n, axis=0)])
  return jax.tree.map(pad, tree)


def _rows(tree, idx: np.ndarray):
  return jax.tree.map(lambda x: x[idx], tree)


class SegmentBuilder:
  """Per-env chunk records -> ``Trajectory [T, M]`` items of complete segments.

  Args:
    num_envs: envs of the batch (ids ``0..num_envs - 1``).
    segment_len: ``T`` chunks per segment.
    segments_per_item: ``M`` segments per item (the streamer's micro-batch).
  """

  def __init__(self, num_envs: int, segment_len: int, segments_per_item: int):
    self.num_envs, self.segment_len, self.per_item = num_envs, segment_len, segments_per_item
    self._open: list[list[dict]] = [[] for _ in range(num_envs)]  # Chunks of each env.
    self._done_segments: list[dict] = []

  def starts(self, env_ids: np.ndarray) -> np.ndarray:
    """``[b]`` bool: which of ``env_ids`` start a new segment with their next chunk."""
    return np.array([not self._open[i] for i in env_ids], bool)

  def starting(self, env_ids: np.ndarray) -> int:
    """How many of ``env_ids`` start a new segment with their next chunk."""
    return int(self.starts(env_ids).sum())

  def on_act(self, env_ids: np.ndarray, batch: dict, out: policy_lib.ActOutput,
             version: int) -> None:
    """Records the chunk each of ``env_ids`` ``[b]`` is about to execute."""
    for row, i in enumerate(env_ids):
      self._open[i].append(dict(batch=_rows(batch, row), chain=out.chain[row],
                                log_prob=out.log_prob[row], value=out.value[row],
                                version=np.int32(version)))

  def on_result(self, env_ids: np.ndarray, result: protocol.ChunkStep) -> np.ndarray:
    """Completes the chunks of ``env_ids``; returns the rows whose segment is full."""
    full = []
    for row, i in enumerate(env_ids):
      chunks = self._open[i]
      if not chunks or "reward" in chunks[-1]:
        raise RuntimeError(f"env {i}: a result arrived with no chunk acted on")
      chunks[-1].update(reward=result.reward[row], done=result.done[row],
                        steps=result.steps[row])
      if len(chunks) == self.segment_len:
        full.append(row)
    return np.asarray(full, np.int64)

  def complete(self, env_ids: np.ndarray, bootstrap_values: np.ndarray) -> None:
    """Closes the full segments of ``env_ids`` with their bootstrap values ``[b]``."""
    for i, v in zip(env_ids, bootstrap_values):
      chunks = self._open[i]
      if len(chunks) != self.segment_len or "reward" not in chunks[-1]:
        raise RuntimeError(f"env {i}: segment is not complete ({len(chunks)} chunks)")
      seg = {k: np.stack([c[k] for c in chunks]) for k in _STEP_FIELDS + ("reward", "done",
                                                                            "steps")}
      seg["batch"] = jax.tree.map(lambda *xs: np.stack(xs), *[c["batch"] for c in chunks])
      seg["bootstrap_value"] = np.float32(v)
      self._done_segments.append(seg)
      self._open[i] = []

  def pop_items(self) -> list[queue_lib.Item]:
    """Items of ``M`` complete segments each, in completion order (the rest wait)."""
    items = []
    while len(self._done_segments) >= self.per_item:
      segs, self._done_segments = (self._done_segments[:self.per_item],
                                   self._done_segments[self.per_item:])
      stack = lambda *xs: np.stack(xs, axis=1)  # [T, M, ...]
      traj = trajectory_lib.Trajectory(
          batch=jax.tree.map(stack, *[s["batch"] for s in segs]),
          chain=stack(*[s["chain"] for s in segs]),
          log_prob=stack(*[s["log_prob"] for s in segs]),
          value=stack(*[s["value"] for s in segs]),
          reward=stack(*[s["reward"] for s in segs]),
          done=stack(*[s["done"] for s in segs]),
          steps=stack(*[s["steps"] for s in segs]),
          bootstrap_value=np.stack([s["bootstrap_value"] for s in segs]),
          policy_version=stack(*[s["version"] for s in segs]))
      items.append(queue_lib.Item(data=traj, versions=traj.policy_version,
                                  num_chunks=traj.log_prob.size,
                                  num_env_steps=int(traj.steps.sum())))
    return items

  def in_flight(self) -> tuple[int, int]:
    """``(segments, chunks)`` started but not emitted (lost if the run stops now)."""
    open_chunks = sum(len(c) for c in self._open)
    return (sum(1 for c in self._open if c) + len(self._done_segments),
            open_chunks + len(self._done_segments) * self.segment_len)


class Rollout:
  """Acts on an env batch and feeds a :class:`SegmentBuilder`.

  Args:
    env: the env batch (an :class:`EnvPool` for first-ready stepping).
    policy: the policy contract; act_fn: jitted ``(params, batch, rng) -> ActOutput``
      (the training sampler); value_fn: jitted ``(params, batch) -> [B]``.
    params_fn: ``() -> (params, version)``, read once per inference batch.
    builder: where chunks go.
    rng: key of the sampler; seed: the env's reset seed.
    clock: optional :class:`StageClock` (stages ``env`` and ``inference``).
    pacer: optional :class:`Pacer` (``staleness_control='pace'``).
  """

  def __init__(self, env: protocol.VecEnv, policy: policy_lib.Policy, act_fn: Callable,
               value_fn: Callable, params_fn: Callable[[], tuple[Any, int]],
               builder: SegmentBuilder, rng: jax.Array, seed: int, clock=None,
               pacer: queue_lib.Pacer | None = None):
    self.env, self.policy = env, policy
    self.act_fn, self.value_fn, self.params_fn = act_fn, value_fn, params_fn
    self.builder, self.rng, self.seed = builder, rng, seed
    self.clock, self.pacer = clock, pacer
    self.episodes = collector_lib.EpisodeTracker()
    self.timing = collections.defaultdict(float)
    self.num_acts = 0
    self.env_steps = 0
    self._obs: protocol.Observation | None = None
    self._started_ready = False
    self._in_flight = 0  # First-ready: envs with a chunk sent and not yet received.
    self._parked_ids = np.zeros((0,), np.int64)  # ... ready, waiting for the pacer.
    self._parked_obs: protocol.Observation | None = None

  def _busy(self, stage: str):
    if self.clock is None:
      return _Null()
    return self.clock.busy(stage)

  def _act(self, env_ids: np.ndarray, obs: protocol.Observation,
           paced: int | None = None) -> np.ndarray:
    """Inference on ``env_ids``'s ``obs``; records the chunks; returns actions.

    ``paced``: the version the pacer already granted these envs' segment starts
    (first-ready); None: acquire the starts here, blocking (lockstep, where every
    env is at a segment boundary together).
    """
    version = paced
    if paced is None and self.pacer is not None:
      starting = self.builder.starting(env_ids)
      if starting:
        t0 = time.perf_counter()
        version = self.pacer.start(starting, self.params_fn()[1])
        self.timing["pace_wait_s"] += time.perf_counter() - t0
    params, got = self.params_fn()
    if version is not None and got < version:  # (params_fn is monotone; defensive)
      raise RuntimeError(f"rollout params version {got} is older than the paced {version}")
    t0 = time.perf_counter()
    with self._busy("inference"):
      batch = self.policy.prepare(obs)
      key = jax.random.fold_in(self.rng, self.num_acts)
      n = len(env_ids)
      padded = pad_rows(batch, bucket_size(n, self.env.num_envs))
      out = jax.tree.map(lambda x: x[:n], jax.device_get(self.act_fn(params, padded, key)))
    self.timing["inference_s"] += time.perf_counter() - t0
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
    if self.pacer is None:
      return np.arange(len(env_ids)), None
    starting = self.builder.starts(env_ids)
    continuing = np.flatnonzero(~starting)
    t0 = time.perf_counter()
    granted, version = self.pacer.acquire(int(starting.sum()), self.params_fn()[1],
                                          block=block and continuing.size == 0)
    self.timing["pace_wait_s"] += time.perf_counter() - t0
    rows = np.sort(np.concatenate([continuing, np.flatnonzero(starting)[:granted]]))
    return rows, version

  def _finish(self, env_ids: np.ndarray, result: protocol.ChunkStep) -> None:
    self.episodes.add(result.episodes)
    self.env_steps += int(result.steps.sum())
    full = self.builder.on_result(env_ids, result)
    if full.size:
      params, _ = self.params_fn()
      with self._busy("inference"):
        batch = self.policy.prepare(result.obs.take(full))
        padded = pad_rows(batch, bucket_size(full.size, self.env.num_envs))
        values = np.asarray(jax.device_get(self.value_fn(params, padded)))[:full.size]
      self.builder.complete(env_ids[full], values)

  def compile_buckets(self, obs: protocol.Observation) -> float:
    """Compiles ``act`` and ``value`` for every bucket size, before they are needed.

    Runs each once on rows of ``obs`` (outputs discarded; the sampler's key
    sequence is not advanced). Returns the seconds it took (``timing['compile_s']``).
    """
    t0 = time.perf_counter()
    params, _ = self.params_fn()
    batch = self.policy.prepare(obs)
    key = jax.random.fold_in(self.rng, 0x7FFFFFFF)
    sizes = bucket_sizes(self.env.num_envs)
    for size in sizes:
      rows = pad_rows(_rows(batch, np.arange(min(size, self.env.num_envs))), size)
      jax.block_until_ready((self.act_fn(params, rows, key), self.value_fn(params, rows)))
    seconds = time.perf_counter() - t0
    self.timing["compile_s"] += seconds
    log.info("rollout: act / value compiled for inference batches %s in %.1f s", sizes, seconds)
    return seconds

  # ---------------------------------------------------------------- lockstep --
  def step_all(self) -> None:
    """One chunk for every env (``env.step_chunk``)."""
    if self._obs is None:
      self._obs = self.env.reset(self.seed)
    ids = np.arange(self.env.num_envs)
    actions = self._act(ids, self._obs)
    t0 = time.perf_counter()
    with self._busy("env"):
      result = self.env.step_chunk(actions)
    self.timing["env_s"] += time.perf_counter() - t0
    self._obs = result.obs
    self._finish(ids, result)

  # ------------------------------------------------------------- first-ready --
  def step_ready(self, b_max: int, t_max_s: float) -> None:
    """One first-ready batch: ``recv(b_max, t_max)``, finish, act, ``send``.

    The env workers step in parallel with this thread; the ``env`` stage is busy
    while any chunk is in flight (recorded at the pool's send/recv calls). How much
    of the workers' capacity that used is the pool's ``stats.worker_busy_s``
    (the pipeline's ``env_workers_busy``).
    Envs the pacer does not let start a segment yet are parked (not stepped) and
    join a later batch; the rest of the batch goes on. With every env parked, the
    call returns (so the caller hands on the segments just finished) and the next
    one waits for the pacer.
    """
    if not self._started_ready:
      self._parked_ids = np.arange(self.env.num_envs)
      self._parked_obs = self.env.reset(self.seed)
      self._started_ready = True
      self.compile_buckets(self._parked_obs)
      self._env_busy_since = None  # Set at the first send.
    ids, obs = self._parked_ids, self._parked_obs
    nothing_in_flight = not self._in_flight  # Only the pacer can unblock the parked envs.
    if self._in_flight:
      t0 = time.perf_counter()
      got_ids, result = self.env.recv(b_max, t_max_s)
      t1 = time.perf_counter()
      self.timing["recv_wait_s"] += t1 - t0
      self._in_flight -= len(got_ids)
      self._finish(got_ids, result)
      if self.clock is not None:  # Some env was stepping since _env_busy_since.
        self.clock.add("env", self._env_busy_since, t1)
      # Envs still in flight keep stepping while this batch is inferred and sent.
      self._env_busy_since = t1 if self._in_flight else None
      if ids.size:
        ids = np.concatenate([ids, got_ids])
        obs = protocol.concat_observations([obs, result.obs])
      else:
        ids, obs = got_ids, result.obs
    rows, version = self._admit(ids, block=nothing_in_flight)
    wait = np.setdiff1d(np.arange(len(ids)), rows)
    self._parked_ids, self._parked_obs = ids[wait], obs.take(wait)
    if rows.size:
      actions = self._act(ids[rows], obs.take(rows), paced=version)
      self.env.send(actions, ids[rows])
      self._in_flight += rows.size
    if self._env_busy_since is None and self._in_flight:
      self._env_busy_since = time.perf_counter()

  def in_flight(self) -> tuple[int, int]:
    return self.builder.in_flight()


class _Null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False
