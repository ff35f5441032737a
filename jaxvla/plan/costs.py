"""Stage costs: what the planner's simulator knows about one process of a run.

The file format (JSON, written by ``python -m jaxvla.plan --profile``) and its one reader.
Every cost is a pair: the *alone* time (seconds with the resource to itself) and the
*demand* (the CPU cores it keeps busy meanwhile; for work on an accelerator, the share of
that accelerator, 1). Demand is measured as the process's CPU seconds over wall seconds,
so an env step that sleeps has a demand below 1 and a renderer that spreads over threads
one above 1. :mod:`jaxvla.plan.engine` turns demands into slowdowns when stages share
cores.

Fields (``FORMAT`` 1):

* ``cores``: CPU cores of the machine the process runs on.
* ``backend``: ``cpu`` (``act`` and the learner run on the host's cores) or an
  accelerator (``gpu``, ``tpu``: each on its device).
* ``chunk_len``: env steps per action chunk.
* ``env_chunk``: samples ``[alone_s, demand]`` of one env executing one chunk in a worker
  process, the worker's round trip included; chunks in which an episode ended are left
  out (``env_reset``).
* ``env_reset`` (optional, default none): samples ``[alone_s, demand]`` of what a chunk in
  which the env's episode ended costs beyond the mean ordinary one: the env's auto-reset
  (LIBERO re-places its scene and settles it: about 1.5 chunks' time), less the steps
  skipped by an episode that ended early in the chunk (then it can be negative).
* ``episode_chunks`` (optional, default 0: episodes are not modelled): chunks per
  episode, the mean over the episodes that ended while the costs were measured, or the
  env's time limit in chunks when none did. The simulator ends every env's episode after
  that many chunks, from the start of the run, as the env pool's auto-reset does.
* ``act``, ``value``: ``{batch rows: [alone_s, demand]}`` of one inference call at each
  padded batch size measured; other sizes are interpolated linearly (and extrapolated
  from the two largest).
* ``rollout_overhead_s``: host time of one inference batch outside the jitted call
  (preparing, padding and fetching the batch), on one core.
* ``rollout_per_env_s``: host time per env chunk received, on one core: the rollout's and
  the pool's bookkeeping of its result (the rest of a lockstep step once ``act``,
  ``value`` and the wait for the envs are taken out).
* ``learner``: ``fixed_s`` per optimizer step, ``per_chunk_s`` per chunk per pass, and
  ``demand``; one PPO update of ``E`` epochs over ``M`` minibatches and ``N`` chunks takes
  ``E * (M * fixed_s + N * per_chunk_s)``. ``item_s`` (optional, default 0): what a
  streamed update (L3) costs per item beyond that: each item's own gradient call and its
  accumulation, and the later minibatches' pass under the update's first params.
* ``broadcast_s``: one weight broadcast, from the publish until the copy has landed.
* ``meta``: where and how it was measured (free-form; the device, the date, the config).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from typing import Any

FORMAT = 1
BACKENDS = ("cpu", "gpu", "tpu")
Cost = tuple[float, float]  # (alone seconds, demand)


@dataclasses.dataclass
class Learner:
  fixed_s: float
  per_chunk_s: float
  demand: float = 1.0
  item_s: float = 0.0


@dataclasses.dataclass
class Costs:
  """One process's stage costs (the module docstring has the fields)."""
  cores: float
  backend: str
  chunk_len: int
  env_chunk: list[Cost]
  act: dict[int, Cost]
  value: dict[int, Cost]
  rollout_overhead_s: float
  rollout_per_env_s: float
  learner: Learner
  broadcast_s: float
  env_reset: list[Cost] = dataclasses.field(default_factory=list)
  episode_chunks: float = 0.0
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    where = self.meta.get("path", "stage costs")
    if self.backend not in BACKENDS:
      raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {self.backend!r}")
    if not self.env_chunk:
      raise ValueError(f"{where}: env_chunk has no samples")
    for key in ("act", "value"):
      table = getattr(self, key)
      if not table:
        raise ValueError(f"{where}: {key} has no batch size")
      if any(b < 1 or s <= 0 for b, (s, _) in table.items()):
        raise ValueError(f"{where}: {key} needs batch sizes >= 1 and times > 0, got {table}")
    if self.cores <= 0 or self.chunk_len < 1:
      raise ValueError(f"{where}: need cores > 0 and chunk_len >= 1")
    if self.episode_chunks < 0:
      raise ValueError(f"{where}: need episode_chunks >= 0, got {self.episode_chunks}")

  @property
  def accelerated(self) -> bool:
    return self.backend != "cpu"

  def act_cost(self, rows: int) -> Cost:
    return _interpolate(self.act, rows)

  def value_cost(self, rows: int) -> Cost:
    return _interpolate(self.value, rows)

  def scaled(self, factor: float) -> "Costs":
    """These costs on a machine whose cores are ``factor`` times slower (``factor`` < 1:
    faster). Only a cost's CPU part scales: of ``(alone_s, demand)`` with demand ``d``,
    ``min(d, 1)`` of the time is computing and the rest waiting (a slept env step), so
    ``alone_s`` becomes ``alone_s * (1 + (factor - 1) * min(d, 1))``. The host's
    overheads are CPU work; on an accelerator ``act``, ``value``, the learner and the
    broadcast are the device's and keep their times."""
    if factor <= 0:
      raise ValueError(f"scale factor must be > 0, got {factor}")

    def slower(alone: float, demand: float, on_host: bool = True) -> float:
      return alone * (1 + (factor - 1) * min(demand, 1.0)) if on_host else alone

    host = not self.accelerated
    table = lambda t: {b: (slower(s, d, host), d) for b, (s, d) in t.items()}
    learner = self.learner
    return dataclasses.replace(
        self, env_chunk=[(slower(s, d), d) for s, d in self.env_chunk],
        env_reset=[(slower(s, d), d) for s, d in self.env_reset],
        act=table(self.act), value=table(self.value),
        rollout_overhead_s=self.rollout_overhead_s * factor,
        rollout_per_env_s=self.rollout_per_env_s * factor,
        learner=Learner(slower(learner.fixed_s, learner.demand, host),
                        slower(learner.per_chunk_s, learner.demand, host), learner.demand,
                        slower(learner.item_s, learner.demand, host)),
        broadcast_s=self.broadcast_s * factor if host else self.broadcast_s,
        meta=dict(self.meta, scaled=factor))

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["format"] = FORMAT
    for key in ("act", "value"):
      d[key] = {str(b): list(c) for b, c in sorted(getattr(self, key).items())}
    d["env_chunk"] = [list(c) for c in self.env_chunk]
    d["env_reset"] = [list(c) for c in self.env_reset]
    return d

  def save(self, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(self.to_json(), f, indent=1)
      f.write("\n")

  @classmethod
  def from_json(cls, d: dict, where: str = "stage costs") -> "Costs":
    """Raises ValueError naming the file and the key that is missing or malformed."""
    if d.get("format") != FORMAT:
      raise ValueError(f"{where}: format {d.get('format')!r}, this planner reads {FORMAT}")
    try:
      meta = dict(d.get("meta", {}), path=where)
      return cls(cores=float(d["cores"]), backend=d["backend"], chunk_len=int(d["chunk_len"]),
                 env_chunk=[(float(s), float(p)) for s, p in d["env_chunk"]],
                 act={int(b): (float(s), float(p)) for b, (s, p) in d["act"].items()},
                 value={int(b): (float(s), float(p)) for b, (s, p) in d["value"].items()},
                 rollout_overhead_s=float(d["rollout_overhead_s"]),
                 rollout_per_env_s=float(d["rollout_per_env_s"]),
                 learner=Learner(**d["learner"]), broadcast_s=float(d["broadcast_s"]),
                 env_reset=[(float(s), float(p)) for s, p in d.get("env_reset", [])],
                 episode_chunks=float(d.get("episode_chunks", 0.0)), meta=meta)
    except KeyError as e:
      raise ValueError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
      raise ValueError(f"{where}: {e}") from None

  @classmethod
  def load(cls, path: str) -> "Costs":
    with open(path, encoding="utf-8") as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return cls.from_json(d, where=path)


def _interpolate(table: dict[int, Cost], rows: int) -> Cost:
  """Piecewise-linear ``table`` at ``rows`` (flat below the smallest size measured)."""
  sizes = sorted(table)
  if rows <= sizes[0] or len(sizes) == 1:
    s, p = table[sizes[0]]
    return (s * rows / sizes[0], p) if rows > sizes[0] else (s, p)
  k = min(bisect.bisect_left(sizes, rows), len(sizes) - 1)
  lo, hi = sizes[k - 1], sizes[k]
  (s0, p0), (s1, p1) = table[lo], table[hi]
  w = (rows - lo) / (hi - lo)
  return s0 + w * (s1 - s0), p0 + min(w, 1.0) * (p1 - p0)
