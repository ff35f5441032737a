"""The rollout's step schedule: the seam through which timing's decisions reach a rollout step.

In an asynchronous run, four things in a rollout step depend on timing: the params
version an inference call uses, the envs the pacer lets act, the envs a first-ready
``recv`` returns, and where an env worker restarts. :class:`jaxvla.rollout.rollout.Rollout`
asks a :class:`StepSchedule` for each of them, and never asks whether it is replaying:

* :class:`LiveSteps` (here): timing decides; with a :class:`StepLog` (the schedule log's
  recorder, :class:`jaxvla.runtime.schedule.Recorder`) every decision is written down;
* :class:`jaxvla.runtime.replay.ReplayedSteps`: a recorded session's log decides, and a
  step that cannot follow it raises ``ReplayMismatch``.

The env calls whose outcome depends on timing (reset, lockstep step, send, recv) go
through the schedule, which knows the phase a worker restart happens in.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from jaxvla.envs import protocol

ParamsFn = Callable[[], tuple[Any, int]]
# ``() -> (rows of the ready envs that may act now, the version the pacer granted)``.
PaceFn = Callable[[], tuple[np.ndarray, "int | None"]]


class StepSchedule(Protocol):
  """What a rollout step asks about timing (see the module docstring)."""

  def attach(self, env: protocol.VecEnv) -> None:
    """Called once with the rollout's env (an env pool tells it of worker restarts)."""

  def begin(self, n: int) -> None:
    """Rollout step ``n`` starts (raises ``types.Closed`` where a replay's log ends)."""

  def end(self, n: int) -> None:
    """Rollout step ``n`` is done."""

  def params(self, for_values: bool) -> tuple[Any, int]:
    """``(params, version)`` for an act call (``for_values=False``) or a value call."""

  def admit(self, env_ids: np.ndarray, pace: PaceFn) -> tuple[np.ndarray, int | None]:
    """Rows of ``env_ids`` ``[b]`` that act now, and the version the pacer granted."""

  def reset(self, env: protocol.VecEnv, seed: int) -> protocol.Observation:
    """``env.reset(seed)``."""

  def step_chunk(self, env: protocol.VecEnv, actions: np.ndarray) -> protocol.ChunkStep:
    """One lockstep chunk of every env: ``env.step_chunk(actions)``."""

  def send(self, env: protocol.AsyncVecEnv, actions: np.ndarray, env_ids: np.ndarray) -> None:
    """``env.send(actions, env_ids)`` (first-ready)."""

  def recv(self, env: protocol.AsyncVecEnv, b_max: int, t_max_s: float
           ) -> tuple[np.ndarray, protocol.ChunkStep]:
    """The next first-ready batch: ``env.recv(b_max, t_max_s)``."""


class StepLog(Protocol):
  """Where :class:`LiveSteps` writes its decisions (the schedule log's recorder)."""

  def step(self, n: int, recv=None, act=None, version: int | None = None,
           values: list[int] | None = None) -> None:
    """Rollout step ``n``'s record."""

  def restart(self, n: int, phase: str, worker: int, why: str, lost, ready) -> None:
    """A worker restart in ``phase`` of rollout step ``n``."""


class LiveSteps:
  """Timing decides: the latest params, the pacer's grants, whatever ``recv`` returns.

  Args:
    params_fn: ``() -> (params, version)``, the latest params (read once per call).
    log: where every decision is written (None: nowhere).
  """

  def __init__(self, params_fn: ParamsFn, log: StepLog | None = None):
    self.params_fn, self.log = params_fn, log
    self._n = 0
    self._phase = "reset"
    self._record: dict | None = None  # The step being written (with a log).

  def attach(self, env: protocol.VecEnv) -> None:
    if self.log is not None and isinstance(env, protocol.ReplayableEnv):
      env.set_restart_listener(self._on_restart)

  def _on_restart(self, worker: int, why: str, in_flight: list[int], ready: list[int]
                  ) -> None:
    self.log.restart(self._n, self._phase, worker, why, in_flight, ready)

  def begin(self, n: int) -> None:
    self._n = n
    if self.log is not None:
      self._record = dict(values=[])

  def end(self, n: int) -> None:
    if self._record is not None:
      self.log.step(n, **self._record)
      self._record = None

  def params(self, for_values: bool) -> tuple[Any, int]:
    params, version = self.params_fn()
    if self._record is not None:
      if for_values:
        self._record["values"].append(version)
      else:
        self._record["version"] = version
    return params, version

  def admit(self, env_ids: np.ndarray, pace: PaceFn) -> tuple[np.ndarray, int | None]:
    rows, version = pace()
    if self._record is not None and rows.size < len(env_ids):
      self._record["act"] = env_ids[rows]
    return rows, version

  def reset(self, env: protocol.VecEnv, seed: int) -> protocol.Observation:
    self._phase = "reset"
    return env.reset(seed)

  def step_chunk(self, env: protocol.VecEnv, actions: np.ndarray) -> protocol.ChunkStep:
    self._phase = "step"
    return env.step_chunk(actions)

  def send(self, env: protocol.AsyncVecEnv, actions: np.ndarray, env_ids: np.ndarray) -> None:
    self._phase = "send"
    env.send(actions, env_ids)

  def recv(self, env: protocol.AsyncVecEnv, b_max: int, t_max_s: float
           ) -> tuple[np.ndarray, protocol.ChunkStep]:
    self._phase = "recv"
    got_ids, result = env.recv(b_max, t_max_s)
    if self._record is not None:
      self._record["recv"] = got_ids
    return got_ids, result
