"""ManiSkill3's motion-planning solutions as a demonstrator for :mod:`jaxvla.data.collect`.

Registered for ``env.name = "maniskill"`` in :data:`jaxvla.data.demonstrators.DEMONSTRATORS`.

mani-skill ships scripted solutions for Panda tasks
(``mani_skill.examples.motionplanning.panda.solutions``, on ``mplib``): each
plans a grasp and screw motions and steps a ``pd_joint_pos`` env along the path.
:class:`PlannerDemonstrator` runs them in worker processes
(:mod:`jaxvla.data.planner_worker`, which also says how each step is recorded
and labelled in the policy's control mode) with the observation settings of
``config.env``, and yields their episodes in seed order. Attempt ``k`` is the
task's episode with seed ``demonstrators.demo_seed(config.seed) + k`` (episodes no RL or
evaluation env of the run plays); with several tasks (``env.task`` joined by
commas) it is task ``k % n``'s, so the tasks take turns.

The workers run with NumPy 1 first on their path: mplib is built against it and
crashes under NumPy 2, which jax needs (``launch/setup.sh`` installs it into
``.venv/planner-site``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import ml_collections
import numpy as np

from jaxvla.data import demonstrators, planner_worker
from jaxvla.envs import maniskill, protocol

log = logging.getLogger(__name__)

# NumPy 1 for the planner processes (launch/setup.sh installs it into the venv).
PLANNER_SITE = os.path.join(sys.prefix, "planner-site")


def _planner_site() -> str:
  if not os.path.isdir(os.path.join(PLANNER_SITE, "numpy")):
    raise RuntimeError(f"ManiSkill3's motion planner (mplib) needs NumPy 1 in its own processes "
                       f"and {PLANNER_SITE} holds none; run `bash launch/setup.sh`")
  return PLANNER_SITE


class PlannerDemonstrator:
  """ManiSkill3's motion planner on ``config.env``, a :class:`demonstrators.Demonstrator`.

  Args:
    config: the run config (``env``: task, observation and control modes, time limit).
    num_workers: planner processes (each steps one simulator).
    noise: std (radians) of Gaussian noise on the executed arm joint targets; the
      labels stay the planner's (DART-style, see :mod:`jaxvla.data.planner_worker`).

  Raises:
    ValueError: naming ``config.env.task`` without a solution or ``config.env.control_mode``
      that planner targets cannot be converted to.
  """

  def __init__(self, config: ml_collections.ConfigDict, num_workers: int, noise: float = 0.0):
    e = config.env
    # The worker's own table of solutions and label modes (one owner of each).
    solvable = sorted(t for t in maniskill.INSTRUCTIONS if t in planner_worker.solutions())
    self._tasks = maniskill.tasks(e.task)
    for task in self._tasks:
      if task not in solvable:
        raise ValueError(f"config.env.task: {task!r} has no ManiSkill3 motion-planning "
                         f"solution; offline tasks with one: {solvable}")
    if e.control_mode not in planner_worker.LABEL_CONTROL_MODES:
      raise ValueError(f"config.env.control_mode={e.control_mode!r}: planner demonstrations are "
                       f"recorded for {planner_worker.LABEL_CONTROL_MODES} only")
    self._site = _planner_site()
    # Episode seeds demonstrators.demo_seed(config.seed) + k: none a run's RL or evaluation
    # envs play.
    self._env_config, self.num_workers = e, max(1, num_workers)
    self.seed = demonstrators.demo_seed(config.seed)
    self.noise = noise
    probe = maniskill.ManiSkillCPU(e.task, 1, obs_mode=e.obs_mode, control_mode=e.control_mode,
                                   image_size=e.image_size,
                                   max_episode_steps=e.max_episode_steps,
                                   reward_mode=e.reward_mode, seed=config.seed,
                                   state_keys=maniskill.parse_names(e.get("state_keys", "")),
                                   critic_state_dim=e.get("critic_state_dim", 0),
                                   **maniskill.gym_options(e))
    self.spec: protocol.EnvSpec = probe.spec
    probe.close()
    self.attempts = self.successes = self.planner_errors = 0
    self.labels = self.clipped = 0  # Label entries, and those clipped to [-1, 1].

  def _command(self, seeds: list[int], out: str) -> list[str]:
    e = self._env_config
    tasks = [self._task(seed) for seed in seeds]
    return [sys.executable, "-m", "jaxvla.data.planner_worker", f"--tasks={','.join(tasks)}",
            f"--obs_mode={e.obs_mode}", f"--label_mode={e.control_mode}",
            f"--reward_mode={e.reward_mode}", f"--image_size={e.image_size}",
            f"--max_episode_steps={e.max_episode_steps}",
            f"--seeds={','.join(map(str, seeds))}", f"--out={out}", f"--noise={self.noise}",
            f"--state_keys={e.get('state_keys', '')}",
            f"--critic_state_dim={e.get('critic_state_dim', 0)}"] + [
                f"--{k}={v}" for k, v in maniskill.gym_options(e).items()]

  def _task(self, seed: int) -> str:
    """The task attempted with ``seed``: attempt ``seed - self.seed``'s turn."""
    return self._tasks[(seed - self.seed) % len(self._tasks)]

  def episodes(self, num_episodes: int) -> Iterator[demonstrators.Episode]:
    """Attempts ``num_episodes`` seeds; an attempt whose solution raised before its first
    step yields nothing (it is counted in :meth:`report`)."""
    seeds = [self.seed + k for k in range(num_episodes)]
    out = tempfile.mkdtemp(prefix="jaxvla-planner-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [self._site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    workers = [subprocess.Popen(self._command(seeds[w::self.num_workers], out), env=env,
                                stdout=subprocess.PIPE, text=True)
               for w in range(min(self.num_workers, num_episodes))]
    try:
      for k, seed in enumerate(seeds):
        worker = workers[k % len(workers)]
        line = worker.stdout.readline()
        if not line:
          raise RuntimeError(f"motion-planner worker {k % len(workers)} exited with status "
                             f"{worker.wait()} before seed {seed} (its stderr is above)")
        reply = json.loads(line)
        if reply["seed"] != seed:  # (each worker answers its seeds in order)
          raise RuntimeError(f"motion-planner worker answered seed {reply['seed']}, not {seed}")
        episode = self._episode(reply["file"], seed)
        if episode is not None:
          yield episode
    finally:
      for worker in workers:
        if worker.poll() is None:
          worker.kill()
        worker.wait()
        worker.stdout.close()
      shutil.rmtree(out, ignore_errors=True)

  def _episode(self, file: str, seed: int) -> demonstrators.Episode | None:
    with np.load(file) as z:
      rec = {k: z[k] for k in z.files}
    os.remove(file)
    self.attempts += 1
    success = bool(rec["success"])
    self.successes += success
    self.clipped += int(rec["clipped"])
    if str(rec["error"]):
      self.planner_errors += 1
      log.warning("motion planner failed on %s seed %d: %s", self._task(seed), seed,
                  rec["error"])
    if "actions" not in rec:
      return None
    self.labels += rec["actions"].size
    return demonstrators.Episode(images=rec["images"], state=rec["state"], actions=rec["actions"],
                           rewards=rec["rewards"],
                           instruction=maniskill.INSTRUCTIONS[self._task(seed)],
                           terminated=success, success=success,
                           critic_state=rec.get("critic_state"))

  def report(self) -> dict:
    """The planner's figures so far: attempts, success rate over the attempts (errors
    count as failures), errors, and the fraction of label entries clipped to [-1, 1]."""
    return dict(planner_attempts=self.attempts,
                planner_success_rate=round(self.successes / max(self.attempts, 1), 4),
                planner_errors=self.planner_errors,
                label_clipped_fraction=round(self.clipped / max(self.labels, 1), 6))

  def close(self) -> None:
    pass  # (each episodes() call ends its workers)


def make(config: ml_collections.ConfigDict, num_envs: int, *,
         noise: float) -> PlannerDemonstrator:
  """The :data:`demonstrators.DEMONSTRATORS` entry's factory: ``num_envs`` planner processes."""
  if noise < 0:
    raise ValueError(f"--noise={noise}: the execution noise's std must be >= 0")
  return PlannerDemonstrator(config, num_envs, noise=noise)
