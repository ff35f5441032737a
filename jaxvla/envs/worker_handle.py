"""The parent's handle on one env worker process: start, send, receive, kill, stop.

This file owns what the parent holds of one worker (:class:`WorkerHandle`): the
process, the parent's end of its pipe, the commands it has not answered yet and
the generation of its envs; how a lost worker is reported (:class:`WorkerLost`),
why one is replaced (:class:`RestartCause`), and the last-resort :func:`cleanup`.
It knows nothing of envs' states or episodes: when to restart, and what a restart
does to the envs, is the pool's (:mod:`jaxvla.envs.pool`). The worker process and
the messages it exchanges live in :mod:`jaxvla.envs.worker`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from multiprocessing import connection
from multiprocessing import shared_memory
from typing import Any

from jaxvla.envs import worker

# How long a process that was asked to exit (or killed) is waited for.
JOIN_TIMEOUT_S = 5.0


class RestartCause(enum.Enum):
  """Why the pool replaced a worker process.

  The values are the ``why`` strings the pool's restart listener receives and a
  run's schedule log records: a file format that replays and old logs read back,
  so they must never change.
  """
  DIED = "died"  # The process exited, or its pipe broke.
  HUNG = "hung"  # A command outlasted the hang timeout.
  FAILED = "failed"  # A simulator raised: fresh envs keep the pool usable.


class WorkerLost(Exception):
  """A worker died or timed out (turned into a restart by the pool)."""


@dataclasses.dataclass(frozen=True)
class Sent:
  """A command a worker has not answered yet."""
  env_ids: list[int]  # Global ids of the envs it runs, in the command's order.
  sent_at: float  # time.monotonic() when it was sent.


@dataclasses.dataclass(eq=False)
class WorkerHandle:
  """Parent-side handle of one worker process: its process, pipe and unanswered commands."""
  index: int
  first_env_id: int
  count: int
  process: Any = None  # multiprocessing Process, None before the first start.
  conn: connection.Connection | None = None
  generation: int = 0  # Restarts so far: new construction seeds for the fresh envs.
  outstanding: collections.deque[Sent] = dataclasses.field(default_factory=collections.deque)
  busy_since: float = 0.0  # When the oldest outstanding command started executing.

  @property
  def env_ids(self) -> range:
    return range(self.first_env_id, self.first_env_id + self.count)

  def start(self, ctx: Any, env_fn: worker.EnvFn, build_seed: int,
            obs: worker.SharedObs) -> None:
    """Starts a fresh process running :func:`worker.worker_main` for this worker's envs."""
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(
        target=worker.worker_main, name=f"jaxvla-env-worker-{self.index}", daemon=True,
        kwargs=dict(conn=child_conn, env_fn=env_fn, first_env_id=self.first_env_id,
                    count=self.count, build_seed=build_seed, obs=obs))
    try:
      process.start()
    except BaseException:
      parent_conn.close()
      raise
    finally:
      child_conn.close()  # Only the worker holds its end: its death reads as EOF here.
    self.process, self.conn = process, parent_conn

  def send(self, command: worker.Command) -> None:
    """Sends ``command``; raises ``OSError`` if the worker is gone (broken pipe)."""
    self.conn.send(command)

  def queue(self, env_ids: list[int], now: float) -> None:
    """Counts a step command for ``env_ids`` sent at ``now`` as unanswered."""
    if not self.outstanding:  # An idle worker starts on it at once.
      self.busy_since = now
    self.outstanding.append(Sent(env_ids=env_ids, sent_at=now))

  def started_next(self, finished_at: float) -> float:
    """The oldest command (just popped) finished at ``finished_at``: returns the seconds
    it ran; the next queued command started then (or when it was sent, if later)."""
    ran_s = max(0.0, finished_at - self.busy_since)
    if self.outstanding:
      self.busy_since = max(finished_at, self.outstanding[0].sent_at)
    return ran_s

  def recv(self, timeout_s: float, what: str) -> worker.Reply:
    """Receives one reply within ``timeout_s`` or raises ``WorkerLost`` (``what``: for errors)."""
    ready = connection.wait([self.conn, self.process.sentinel], timeout_s)
    if self.conn in ready or self.conn.poll():
      try:
        return self.conn.recv()
      except (EOFError, OSError) as e:
        raise WorkerLost(f"worker {self.index} exited during {what}") from e
    if ready:
      self.process.join(JOIN_TIMEOUT_S)
      raise WorkerLost(f"worker {self.index} exited during {what} "
                       f"(exit code {self.process.exitcode})")
    raise WorkerLost(f"worker {self.index} did not answer {what} within {timeout_s} s")

  def kill(self) -> None:
    """Kills the process (if alive) and closes the pipe; idempotent."""
    if self.process is not None:
      if self.process.is_alive():
        self.process.kill()
      self.process.join(JOIN_TIMEOUT_S)
    if self.conn is not None:
      self.conn.close()
      self.conn = None

  def replace(self) -> None:
    """Kills the process and forgets its unanswered commands; the next :meth:`start`
    builds the envs' next generation (new construction seeds)."""
    self.kill()
    self.outstanding.clear()
    self.generation += 1

  def request_close(self) -> None:
    """Asks a live worker to close its envs and exit."""
    if self.conn is None or self.process is None or not self.process.is_alive():
      return
    try:
      self.conn.send(worker.Close())
    except OSError:  # Already gone: stop() returns at once.
      pass

  def stop(self, deadline: float) -> None:
    """Waits for the process to exit until ``deadline`` (monotonic), then terminates it."""
    if self.process is None:
      return
    self.process.join(max(0.0, deadline - time.monotonic()))
    if self.process.is_alive():
      self.process.terminate()
      self.process.join(JOIN_TIMEOUT_S)


def cleanup(workers: list[WorkerHandle], shms: list[shared_memory.SharedMemory]) -> None:
  """Kills what is still running and unlinks the segments (idempotent; also at exit)."""
  for w in workers:
    w.kill()
  for shm in shms:
    try:
      shm.unlink()
    except FileNotFoundError:
      pass
