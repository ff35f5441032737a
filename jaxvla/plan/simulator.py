"""The pipeline as a discrete-event model: what :mod:`jaxvla.runtime` does, timed by stage costs.

:func:`simulate` plays a run of one :class:`Setup` (the pipeline's shape: mode, levels,
envs, workers, batching, staleness, processes) with the costs of
:class:`jaxvla.plan.costs.Costs`, and returns what the pipeline benchmark measures: env
steps/s (the smaller of trained and usable produced), each stage's busy fraction, the
staleness of the chunks trained on, and the env steps dropped as too stale.

What is modelled, and how it maps onto the code:

* **Env workers** (:class:`jaxvla.envs.pool.EnvPool`): each worker executes its step
  commands in order, the envs of one command one after another; a command's results are
  ready together when its last env finishes. An env's chunk costs a sample drawn from the
  measured ones. ``env_workers = 0`` steps the envs in the rollout's thread.
* **Episodes**: every env starts an episode at the start of the run, and an episode
  lasts ``episode_chunks`` chunks (a non-integer mean: the next length drawn from the
  two integers around it); the chunk that ends one also costs a sample of
  ``env_reset`` (the pool's auto-reset). A short window of a few updates holds a reset
  or not as the run's own does (LIBERO's costs about 1.5 chunks' time).
* **The rollout** (:class:`jaxvla.rollout.rollout.Rollout`): lockstep (every env, one
  ``act`` padded to the env count, wait for all) or first-ready (``recv(b_max, t_max)``:
  at least one ready, then until ``b_max`` are or ``t_max`` has passed since the first,
  the earliest finished first; ``act`` padded to its power-of-two bucket, at least
  ``min_bucket``). A segment's last chunk triggers the value call of the segments it
  completes. ``rollout_overhead_s`` of host time per inference batch and
  ``rollout_per_env_s`` per env result received.
* **Items and the queue** (:class:`jaxvla.rollout.segments.SegmentBuilder`,
  :class:`jaxvla.runtime.queue.TrajectoryQueue`): segments of ``rollout_len`` chunks, in
  the order they complete, ``micro_batch_segments`` per item; a full queue blocks the
  rollout; an item older than ``max_staleness`` is dropped when taken.
* **The pacer** (:class:`jaxvla.rollout.pacer.Pacer`): segment ``s`` may start with version
  ``v`` only while ``s < (v + k + 1) * num_envs``; first-ready parks refused envs; a
  dropped item's segments give their starts back.
* **The learner**: L1 off, it steps the rollout itself until an item is there; L1 on, a
  rollout thread fills the queue. One update takes ``num_envs / micro_batch_segments``
  items per process; non-streamed it trains once all are there, streamed (L3) it computes
  each item's gradient as it arrives and steps the optimizer per minibatch. Several
  processes train one update together: each step of it waits for every process's items.
* **The broadcast**: every mode but ``sync_colocated`` copies the params after each update;
  the rollout acts with the new version once the copy has landed (the synchronous modes
  wait for it).
* **Sharing**: stages on one machine share its cores (processor sharing by demand,
  :mod:`jaxvla.plan.engine`); on the ``cpu`` backend ``act`` and the learner run on those
  cores too, on an accelerator on their devices (one device shared by both, or separate
  rollout and learner devices, each stage's work split evenly over its devices).

Left out (stated where the planner's figures are used, docs/scaling.md): network time of
the broadcast and of the learner's gradient reduction between machines (a per-step
``allreduce_s`` can be given), stragglers among machines (every process draws its own env
times, but the machines themselves are alike), worker faults, evaluation and checkpoints,
compilation, and GRPO (episodes rather than segments: refused).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterator

import ml_collections
import numpy as np

from jaxvla.learner import algorithm as algorithm_lib
from jaxvla.plan import costs as costs_lib
from jaxvla.plan import engine
from jaxvla.rollout import rollout as rollout_lib
from jaxvla.runtime import modes as modes_lib

STALENESS_CONTROLS = ("pace", "drop")


@dataclasses.dataclass(frozen=True)
class Setup:
  """The pipeline's shape for one run; counts are per process unless named otherwise."""
  train_async: bool = False  # L1
  rollout_async: bool = False  # L2
  streamer: bool = False  # L3
  separate_params: bool = False  # A broadcast after every update (all but sync_colocated).
  num_envs: int = 32
  env_workers: int = 8
  rollout_len: int = 4
  micro_batch_segments: int = 8
  b_max: int = 16
  t_max_s: float = 0.005
  min_bucket: int = 1
  max_staleness: int = 1
  staleness_control: str = "pace"
  queue_items: int = 8
  num_minibatches: int = 2
  num_epochs: int = 1
  processes: int = 1
  processes_per_machine: int = 1  # Processes sharing one machine's cores.
  rollout_devices: int = 1  # Accelerators of one process that act ...
  learner_devices: int = 1  # ... and that train (the same ones when shared_devices).
  shared_devices: bool = True  # Rollout and learner on the same accelerators.
  allreduce_s: float = 0.0  # Network time per optimizer step between machines.

  def __post_init__(self):
    problems = []
    if self.num_envs % self.micro_batch_segments:
      problems.append(f"micro_batch_segments={self.micro_batch_segments} must divide "
                      f"num_envs={self.num_envs}")
    elif (self.num_envs // self.micro_batch_segments) % self.num_minibatches:
      problems.append(f"num_minibatches={self.num_minibatches} must divide the "
                      f"{self.num_envs // self.micro_batch_segments} items of an update")
    if self.env_workers and self.num_envs % self.env_workers:
      problems.append(f"env_workers={self.env_workers} must divide num_envs={self.num_envs}")
    if self.rollout_async and not self.env_workers:
      problems.append("rollout_async (first-ready) needs env_workers > 0")
    if self.staleness_control not in STALENESS_CONTROLS:
      problems.append(f"staleness_control must be one of {STALENESS_CONTROLS}")
    if self.processes % self.processes_per_machine:
      problems.append(f"processes_per_machine={self.processes_per_machine} must divide "
                      f"processes={self.processes}")
    if min(self.b_max, self.rollout_len, self.rollout_devices, self.learner_devices,
           self.num_epochs, self.queue_items) < 1 or self.max_staleness < 0:
      problems.append("b_max, rollout_len, the device counts, num_epochs and queue_items "
                      "must be >= 1, max_staleness >= 0")
    if problems:
      raise ValueError("plan setup: " + "; ".join(problems))

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, processes: int = 1,
                  processes_per_machine: int = 1, **overrides) -> "Setup":
    """The setup a run of ``config`` has (the pipeline's own reading of its switches).

    Raises:
      ValueError: for GRPO (the simulator models PPO's segments).
    """
    if config.algorithm != algorithm_lib.PPO.name:
      raise ValueError(f"the planner models PPO's segments; config.algorithm="
                       f"{config.algorithm!r} is not supported")
    p = config.pipeline
    levels = modes_lib.Levels.from_config(p)
    streamer = levels.streamer
    return dataclasses.replace(cls(
        train_async=levels.train_async, rollout_async=levels.rollout_async,
        streamer=streamer, separate_params=levels.separate_params,
        num_envs=config.num_envs, env_workers=config.env_workers,
        rollout_len=config.rollout_len, micro_batch_segments=p.micro_batch_segments,
        b_max=p.b_max or max(1, config.num_envs // 2), t_max_s=p.t_max_ms / 1000.0,
        min_bucket=p.min_bucket, max_staleness=p.max_staleness,
        staleness_control=p.staleness_control, queue_items=p.queue_items,
        num_minibatches=config.rl.num_minibatches,
        num_epochs=1 if streamer else config.rl.num_epochs, processes=processes,
        processes_per_machine=processes_per_machine), **overrides)

  @property
  def items_per_update(self) -> int:
    return self.num_envs // self.micro_batch_segments

  @property
  def paced(self) -> bool:
    return self.train_async and self.staleness_control == "pace"

  def level_name(self) -> str:
    if not (self.train_async or self.rollout_async or self.streamer):
      return "sync_disaggregated" if self.separate_params else "sync_colocated"
    return "+".join(n for n, on in (("L1", self.train_async), ("L2", self.rollout_async),
                                    ("L3", self.streamer)) if on)


@dataclasses.dataclass
class Result:
  """What one simulated run predicts, over its timed updates (all processes together)."""
  env_steps_per_s: float
  trained_env_steps_per_s: float
  usable_rollout_env_steps_per_s: float
  staleness_mean: float
  staleness_hist: dict[int, int]
  dropped_env_steps: int
  env_workers_busy: float  # Share of the workers' time spent executing chunks.
  inference_busy: float
  learner_busy: float
  stage_rates: dict[str, float]  # Each stage alone, env steps/s.
  efficiency: float  # env_steps_per_s over the slowest stage alone.
  seconds: float
  events: int

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["staleness_hist"] = {str(k): v for k, v in sorted(self.staleness_hist.items())}
    return d


@dataclasses.dataclass
class _Item:
  versions: np.ndarray  # [chunks] the version that acted for each chunk
  env_steps: int

  @property
  def oldest(self) -> int:
    return int(self.versions.min())


class _Process:
  """One process: its env workers, rollout, queue and pacer."""

  def __init__(self, run: "_Run", index: int, cpu: engine.Resource,
               inference: engine.Resource, learner: engine.Resource):
    s, sim = run.setup, run.sim
    self.run, self.index, self.sim = run, index, sim
    self.cpu, self.inference, self.learner_res = cpu, inference, learner
    self.rng = np.random.default_rng([run.seed, index])
    n = s.num_envs
    self.chunks_done = np.zeros(n, np.int64)  # Chunks of each env's open segment.
    self.open_versions: list[list[int]] = [[] for _ in range(n)]
    self.done_segments: list[list[int]] = []
    self.queue: collections.deque[_Item] = collections.deque()
    self.queue_changed = sim.event()
    self.version = 0  # What the rollout acts with.
    self.version_changed = sim.event()
    self.started = 0  # Segments started (the pacer's count).
    self.produced = 0  # Env steps whose results arrived.
    self.dropped = 0
    self.worker_busy_s = 0.0
    # Env pool state: commands per worker, results ready (env -> finish time).
    workers = max(1, s.env_workers)
    self.per_worker = n // workers
    self.commands: list[collections.deque[list[int]]] = [collections.deque()
                                                         for _ in range(workers)]
    self.command_posted = [sim.event() for _ in range(workers)]
    self.episode_left = np.zeros(n, np.int64)  # Chunks left in each env's episode.
    for e in range(n):
      self._new_episode(e)
    self.ready: dict[int, float] = {}
    self.ready_changed = sim.event()
    self.in_flight = 0
    self.parked: list[int] = list(range(n))
    self.first_step = True
    if s.env_workers:
      for w in range(workers):
        sim.spawn(self._worker(w))
    if s.train_async:
      sim.spawn(self._rollout_thread())

  # ------------------------------------------------------------------ envs --
  def _chunk_cost(self) -> costs_lib.Cost:
    samples = self.run.costs.env_chunk
    return samples[self.rng.integers(len(samples))]

  def _new_episode(self, e: int) -> None:
    mean = self.run.costs.episode_chunks
    whole = int(mean)
    self.episode_left[e] = max(1, whole + int(self.rng.random() < mean - whole)) if mean else 0

  def _env_chunk(self, e: int) -> engine.Process:
    """Env ``e`` executes one chunk on its worker's (or the rollout's) cores, and its
    auto-reset when the chunk ends its episode."""
    alone, demand = self._chunk_cost()
    if self.episode_left[e]:  # (0: episodes not modelled)
      self.episode_left[e] -= 1
      if not self.episode_left[e]:
        resets = self.run.costs.env_reset
        if resets:  # (negative: the episode ended early in the chunk and skipped steps)
          alone = max(0.0, alone + resets[self.rng.integers(len(resets))][0])
        self._new_episode(e)
    yield self.cpu.run(alone, demand)

  def _worker(self, w: int) -> engine.Process:
    while True:
      while not self.commands[w]:
        self.command_posted[w] = self.sim.event()
        yield self.command_posted[w]
      envs = self.commands[w].popleft()
      start = self.sim.now
      for e in envs:
        yield from self._env_chunk(e)
      self.worker_busy_s += self.sim.now - start
      for e in envs:
        self.ready[e] = self.sim.now
      self.in_flight -= len(envs)
      self._notify("ready_changed")

  def _notify(self, name: str) -> None:
    event = getattr(self, name)
    setattr(self, name, self.sim.event())
    event.succeed()

  def _send(self, envs: list[int]) -> None:
    by_worker = collections.defaultdict(list)
    for e in envs:
      by_worker[e // self.per_worker].append(e)
    for w, ids in by_worker.items():
      self.commands[w].append(ids)
      self.command_posted[w].succeed()
    self.in_flight += len(envs)

  # --------------------------------------------------------------- rollout --
  def _rollout_thread(self) -> engine.Process:
    while not self.run.finished:
      yield from self.step()
      yield from self.hand_on()

  def _bucket(self, rows: int) -> int:
    s = self.run.setup
    if not s.rollout_async:
      return s.num_envs
    return rollout_lib.bucket_size(rows, s.num_envs, s.min_bucket)

  def _infer(self, rows: int, value: bool) -> engine.Process:
    s, costs = self.run.setup, self.run.costs
    padded = self._bucket(rows)
    per_device = math.ceil(padded / s.rollout_devices) if costs.accelerated else padded
    alone, demand = (costs.value_cost if value else costs.act_cost)(per_device)
    yield self.cpu.run(costs.rollout_overhead_s, 1.0)
    start = self.sim.now
    yield self.inference.run(alone, demand)
    self.run.inference_busy[self.index] += self.sim.now - start

  def _act(self, envs: list[int]) -> engine.Process:
    yield from self._infer(len(envs), value=False)
    for e in envs:
      self.open_versions[e].append(self.version)

  def _finish(self, envs: list[int]) -> engine.Process:
    s = self.run.setup
    yield self.cpu.run(self.run.costs.rollout_per_env_s * len(envs), 1.0)
    self.produced += len(envs) * self.run.costs.chunk_len
    full = []
    for e in envs:
      self.chunks_done[e] += 1
      if self.chunks_done[e] == s.rollout_len:
        full.append(e)
    if full:
      yield from self._infer(len(full), value=True)
      for e in full:
        self.done_segments.append(self.open_versions[e])
        self.open_versions[e], self.chunks_done[e] = [], 0

  def _starting(self, envs: list[int]) -> list[int]:
    return [e for e in envs if self.chunks_done[e] == 0 and not self.open_versions[e]]

  def step(self) -> engine.Process:
    """One inference batch, as :meth:`Rollout.step` makes it."""
    if self.run.setup.rollout_async:
      yield from self._step_ready()
    else:
      yield from self._step_all()

  def _available(self) -> int:
    s = self.run.setup
    return (self.version + s.max_staleness + 1) * s.num_envs - self.started

  def _step_all(self) -> engine.Process:
    s = self.run.setup
    envs = list(range(s.num_envs))
    starting = len(self._starting(envs)) if s.paced else 0
    while starting and self._available() < starting:
      yield self.version_changed
    self.started += starting
    yield from self._act(envs)
    if s.env_workers:
      self._send(envs)
      while len(self.ready) < len(envs):
        yield self.ready_changed
      self.ready.clear()
    else:  # Stepped in the rollout's own thread.
      for e in envs:
        yield from self._env_chunk(e)
    yield from self._finish(envs)

  def _step_ready(self) -> engine.Process:
    s = self.run.setup
    # In flight for the rollout: sent and not yet received (running, or ready in the pool).
    in_flight = self.in_flight + len(self.ready)
    envs, nothing_in_flight = self.parked, in_flight == 0
    if self.first_step:
      self.first_step = False
    elif in_flight:
      got = yield from self._receive()
      yield from self._finish(got)
      envs = envs + got
    starting = set(self._starting(envs)) if s.paced else set()
    continuing = [e for e in envs if e not in starting]
    if starting and not continuing and nothing_in_flight:
      while self._available() <= 0:
        yield self.version_changed
    granted = max(0, min(len(starting), self._available())) if starting else 0
    self.started += granted
    admitted = sorted(continuing + [e for e in envs if e in starting][:granted])
    taken = set(admitted)
    self.parked = [e for e in envs if e not in taken]
    if admitted:
      yield from self._act(admitted)
      self._send(admitted)
    elif not envs:
      raise RuntimeError("simulated rollout: no env is parked, ready or in flight")

  def _receive(self) -> engine.Process:
    s = self.run.setup
    while not self.ready:
      yield self.ready_changed
    while len(self.ready) < s.b_max and self.in_flight:
      deadline = min(self.ready.values()) + s.t_max_s
      if self.sim.now >= deadline:
        break
      yield self.sim.any_of(self.ready_changed, self.sim.timeout(deadline - self.sim.now))
    got = sorted(self.ready, key=lambda e: (self.ready[e], e))[:s.b_max]
    for e in got:
      del self.ready[e]
    return got

  def hand_on(self) -> engine.Process:
    """Complete items into the queue (blocking while it is full, L1)."""
    s = self.run.setup
    while len(self.done_segments) >= s.micro_batch_segments:
      segments = self.done_segments[:s.micro_batch_segments]
      del self.done_segments[:s.micro_batch_segments]
      item = _Item(np.array([v for seg in segments for v in seg]),
                   len(segments) * s.rollout_len * self.run.costs.chunk_len)
      while s.train_async and len(self.queue) >= s.queue_items:
        yield self.queue_changed
      self.queue.append(item)
      self._notify("queue_changed")

  # --------------------------------------------------------------- learner --
  def take(self, update: int) -> Iterator[engine.Event]:
    """The next item fresh enough for learner version ``update``."""
    s = self.run.setup
    while True:
      while not self.queue:
        if s.train_async:
          yield self.queue_changed
        else:
          yield from self.step()
          yield from self.hand_on()
      item = self.queue.popleft()
      self._notify("queue_changed")
      if update - item.oldest > s.max_staleness:
        self.dropped += item.env_steps
        if s.paced:  # Its start is given back (Pacer.release).
          self.started -= s.micro_batch_segments
          self._notify("version_changed")
        continue
      self.run.record_staleness(update - item.versions)
      return item

  def set_version(self, version: int) -> None:
    self.version = max(self.version, version)
    self._notify("version_changed")


class _Run:
  """Every process, the learner and the broadcast of one simulated run."""

  def __init__(self, setup: Setup, costs: costs_lib.Costs, seed: int):
    self.setup, self.costs, self.seed = setup, costs, seed
    self.sim = engine.Sim()
    self.finished = False
    self.staleness: collections.Counter = collections.Counter()
    self.inference_busy = [0.0] * setup.processes
    self.learner_busy = 0.0
    self.marks: list[tuple[float, int, int, int]] = []  # (time, trained, produced, dropped)
    self.trained = 0
    self._barriers: dict = {}
    machines = setup.processes // setup.processes_per_machine
    cpus = [engine.Resource(self.sim, f"cpu{m}", costs.cores) for m in range(machines)]
    self.processes = []
    for p in range(setup.processes):
      cpu = cpus[p // setup.processes_per_machine]
      if not costs.accelerated:
        inference = learner = cpu
      elif setup.shared_devices:
        inference = learner = engine.Resource(self.sim, f"devices{p}", 1.0)
      else:
        inference = engine.Resource(self.sim, f"rollout{p}", 1.0)
        learner = engine.Resource(self.sim, f"learner{p}", 1.0)
      self.processes.append(_Process(self, p, cpu, inference, learner))

  def record_staleness(self, values: np.ndarray) -> None:
    if self.recording:
      self.staleness.update(values.tolist())

  @property
  def recording(self) -> bool:
    return len(self.marks) >= self.warmup

  def _barrier(self, key) -> engine.Event:
    """Fires when every process has reached ``key`` (a collective step)."""
    count, event = self._barriers.get(key, (0, None))
    event = event or self.sim.event()
    count += 1
    if count == self.setup.processes:
      self._barriers.pop(key, None)
      event.succeed()
    else:
      self._barriers[key] = (count, event)
    return event

  def _compute(self, proc: _Process, chunks: int, steps: int, items: int = 0
               ) -> engine.Process:
    """The learner's work on ``chunks`` chunks in ``steps`` optimizer steps (``items``:
    streamed items among them)."""
    s = self.setup
    start = self.sim.now
    yield proc.learner_res.run(learner_alone_s(s, self.costs, chunks, steps, items),
                               self.costs.learner.demand)
    if s.allreduce_s and steps:
      yield self.sim.timeout(s.allreduce_s * steps)
    if proc.index == 0:
      self.learner_busy += self.sim.now - start

  def learner(self, proc: _Process, updates: int) -> engine.Process:
    s = self.setup
    item_chunks = s.micro_batch_segments * s.rollout_len
    per_minibatch = s.items_per_update // s.num_minibatches
    for u in range(updates):
      if s.streamer:
        for j in range(s.items_per_update):
          item = yield from proc.take(u)
          self.trained += item.env_steps
          yield self._barrier((u, j))
          yield from self._compute(proc, item_chunks, int((j + 1) % per_minibatch == 0),
                                   items=1)
      else:
        for _ in range(s.items_per_update):
          item = yield from proc.take(u)
          self.trained += item.env_steps
        yield self._barrier((u, "update"))
        yield from self._compute(proc, s.num_epochs * s.items_per_update * item_chunks,
                                 s.num_epochs * s.num_minibatches)
      yield self._barrier((u, "done"))
      if proc.index == 0:
        self.marks.append((self.sim.now, self.trained, sum(p.produced for p in self.processes),
                           sum(p.dropped for p in self.processes)))
      yield from self._publish(proc, u + 1)
    if proc.index == 0:
      self.finished = True

  def _publish(self, proc: _Process, version: int) -> engine.Process:
    s = self.setup
    if not s.separate_params:
      proc.set_version(version)
      return
    landed = self.sim.spawn(self._broadcast(proc, version))
    if not s.train_async:
      yield landed

  def _broadcast(self, proc: _Process, version: int) -> engine.Process:
    if self.costs.accelerated:  # A device-to-device copy: the copy engines, not the SMs.
      yield self.sim.timeout(self.costs.broadcast_s)
    else:
      yield proc.cpu.run(self.costs.broadcast_s, 1.0)
    proc.set_version(version)

  def play(self, warmup: int, updates: int) -> None:
    self.warmup = warmup
    total = warmup + updates
    for proc in self.processes:
      self.sim.spawn(self.learner(proc, total))
    self.sim.run(lambda: len(self.marks) >= total)
    if len(self.marks) < total:
      raise RuntimeError(f"the simulated run stopped after {len(self.marks)} of {total} "
                         "updates: nothing left to happen (a deadlock in the setup)")


def learner_alone_s(setup: Setup, costs: costs_lib.Costs, chunks: int, steps: int,
                    items: int = 0) -> float:
  """The learner's alone seconds for ``chunks`` chunks in ``steps`` optimizer steps
  (``items`` of them streamed items, each ``learner.item_s`` more), data-parallel over
  its devices (the per-chunk part divides, the per-step and per-item parts do not)."""
  devices = setup.learner_devices if costs.accelerated else 1
  learner = costs.learner
  return (steps * learner.fixed_s + items * learner.item_s
          + chunks * learner.per_chunk_s / devices)


def stage_rates(setup: Setup, costs: costs_lib.Costs) -> dict[str, float]:
  """Each stage alone, in env steps/s of the whole run (the benchmark's standalone rates).

  env: every worker stepping back to back (its cores shared by demand); inference: ``act``
  at ``b_max`` rows; learner: updates back to back.
  """
  s, h = setup, costs.chunk_len
  mean_s = float(np.mean([c[0] for c in costs.env_chunk]))
  if costs.env_reset and costs.episode_chunks:
    mean_s += float(np.mean([c[0] for c in costs.env_reset])) / costs.episode_chunks
  mean_demand = float(np.mean([c[1] for c in costs.env_chunk]))
  workers = max(1, s.env_workers) * s.processes_per_machine
  share = min(1.0, costs.cores / max(workers * mean_demand, 1e-9))
  machines = s.processes // s.processes_per_machine
  env = workers * machines * h / mean_s * share
  rows = s.b_max if s.rollout_async else s.num_envs
  per_device = math.ceil(rows / s.rollout_devices) if costs.accelerated else rows
  act_s = costs.act_cost(per_device)[0] + costs.rollout_overhead_s
  inference = s.processes * rows * h / act_s
  chunks, steps = s.num_envs * s.rollout_len, s.num_minibatches * s.num_epochs
  update_s = (learner_alone_s(s, costs, s.num_epochs * chunks, steps,
                             s.items_per_update if s.streamer else 0) + steps * s.allreduce_s)
  learner = s.processes * chunks * h / update_s
  return dict(env=env, inference=inference, learner=learner)


def simulate(setup: Setup, costs: costs_lib.Costs, updates: int = 20, warmup: int = 2,
             seed: int = 0) -> Result:
  """Plays ``warmup + updates`` updates; the figures are over the last ``updates``."""
  if updates < 1 or warmup < 1:
    raise ValueError(f"need updates >= 1 and warmup >= 1, got {updates}, {warmup}")
  run = _Run(setup, costs, seed)
  run.play(warmup, updates)
  (t0, s0, r0, d0), (t1, s1, r1, d1) = run.marks[warmup - 1], run.marks[-1]
  span = t1 - t0
  trained, usable = (s1 - s0) / span, (r1 - r0 - (d1 - d0)) / span
  throughput = min(trained, usable)
  hist = dict(run.staleness)
  n = sum(hist.values())
  rates = stage_rates(setup, costs)
  workers = max(1, setup.env_workers) * setup.processes
  return Result(
      env_steps_per_s=throughput, trained_env_steps_per_s=trained,
      usable_rollout_env_steps_per_s=usable,
      staleness_mean=sum(k * v for k, v in hist.items()) / n if n else 0.0,
      staleness_hist=hist, dropped_env_steps=int(d1 - d0),
      env_workers_busy=sum(p.worker_busy_s for p in run.processes) / (workers * t1),
      inference_busy=run.inference_busy[0] / t1, learner_busy=run.learner_busy / t1,
      stage_rates=rates, efficiency=throughput / min(rates.values()), seconds=span,
      events=run.sim.events)
