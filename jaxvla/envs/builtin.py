"""ColorReach: the built-in environment for the default run, tests and benchmarks.

A point agent moves in the square ``[-1, 1]^2``. Several coloured targets lie at
random places (by default around the agent's fixed start at the centre, like a
robot's home pose); the instruction names one colour ("move to the red target"). The
episode succeeds (reward 1) when the agent comes within ``goal_radius`` of the
named target and fails (reward 0) if it touches another target first. Target
positions are only visible in the RGB image and the goal colour only in the
instruction, so a policy must read both pixels and language; the proprioceptive
state is the agent's own position.

Episodes are a pure function of ``(reset seed, group, episode number)``: env
``i``'s ``k``-th episode lays out agent, targets, colours and goal from
``np.random.default_rng([seed, 0, i // group_size, k])`` (``i`` the global env id),
whatever the batch size, the order in which envs finish, or the process that steps
the env. With ``group_size`` G > 1 the members of a GRPO group replay the same
layouts (see :mod:`jaxvla.envs.protocol`); with G = 1 every env has its own stream.

Everything is vectorised over the batch in NumPy. An optional per-step latency,
drawn from a log-normal (long-tailed) distribution and *slept*, stands in for a
slow simulator in benchmarks without burning CPU.
"""

from __future__ import annotations

import time

import ml_collections
import numpy as np

from jaxvla.envs import protocol

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (235, 215, 40),
    "purple": (170, 60, 210),
    "cyan": (40, 210, 220),
}
_BACKGROUND = np.array([40, 40, 48], np.uint8)
_AGENT_COLOUR = np.array([255, 255, 255], np.uint8)
# Random streams, kept apart by the word after the seed: episode layouts (per group and
# episode number), slept latency and the expert's fallback noise (per env batch).
_EPISODE_STREAM, _LATENCY_STREAM, _NOISE_STREAM = 0, 1, 2


def _spec(image_size: int, max_episode_steps: int) -> protocol.EnvSpec:
  """The one definition of ColorReach's spec: a ``top`` camera, 2-D state and action."""
  return protocol.EnvSpec(
      camera_names=("top",), image_shape=(image_size, image_size, 3), state_dim=2,
      action_dim=2, max_episode_steps=max_episode_steps)


def spec_from_config(config: ml_collections.ConfigDict) -> protocol.EnvSpec:
  """The spec of the env :func:`make` builds from the ``env`` sub-config, without building it.

  Raises:
    ValueError: ``config.name`` names another env (its spec is not ColorReach's).
  """
  if config.get("name", "builtin") != "builtin":
    raise ValueError(f"config.env.name={config.name!r}: spec_from_config reads the built-in "
                     "env's spec only")
  return _spec(config.image_size, config.max_episode_steps)


def episode_rng(seed: int, group: int, episode: int) -> np.random.Generator:
  """The generator of group ``group``'s ``episode``-th layout after ``reset(seed)``."""
  return np.random.default_rng([seed, _EPISODE_STREAM, group, episode])


class ColorReach:
  """A batch of ColorReach episodes (implements :class:`protocol.VecEnv`).

  Args:
    num_envs: batch size B.
    image_size: side of the square RGB image in pixels.
    num_targets: targets per episode (distinct colours).
    num_colours: colours drawn from (the first ``num_colours`` of ``COLOURS``).
    max_episode_steps: time limit in env steps.
    max_speed: distance moved per step at action magnitude 1 (per axis).
    goal_radius: success distance to the named target.
    wrong_target_radius: touching another target within this distance fails.
    min_separation: minimum distance between targets and the agent's start.
    layout: 'ring': the agent starts at the centre (a robot's home pose) and
      targets lie at random angles at distances in ``ring_radius``; 'uniform':
      agent and targets anywhere.
    ring_radius: ``(min, max)`` target distance from the centre for 'ring'.
    latency_ms: median per-step latency slept in ``step_chunk`` (0: none).
    latency_sigma: log-normal shape of the latency (larger: longer tail).
    seed: episode seed until the first ``reset`` (>= 0).
    group_size: GRPO group size G; envs ``i // G`` share every episode's layout.
    first_env_id: global id of this batch's env 0 (a pool's worker builds env ``i``
      alone with ``first_env_id=i``).
    total_envs: envs in the whole run (default: this batch is the run).
  """

  def __init__(self, num_envs: int, *, image_size: int = 32, num_targets: int = 3,
               num_colours: int = 4, max_episode_steps: int = 50, max_speed: float = 0.1,
               goal_radius: float = 0.15, wrong_target_radius: float = 0.15,
               min_separation: float = 0.5, layout: str = "ring",
               ring_radius: tuple[float, float] = (0.4, 0.85), latency_ms: float = 0.0,
               latency_sigma: float = 1.0, seed: int = 0, group_size: int = 1,
               first_env_id: int = 0, total_envs: int | None = None):
    if not 1 <= num_targets <= num_colours <= len(COLOURS):
      raise ValueError(
          f"need 1 <= num_targets ({num_targets}) <= num_colours ({num_colours}) "
          f"<= {len(COLOURS)}")
    if num_envs < 1:
      raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    self.num_envs = num_envs
    self._groups, _ = protocol.group_layout(group_size, num_envs, first_env_id, total_envs)
    self.group_size = int(group_size)
    self.first_env_id = first_env_id
    self.image_size = image_size
    self.num_targets = num_targets
    self.colour_names = tuple(COLOURS)[:num_colours]
    self.palette = np.array([COLOURS[c] for c in self.colour_names], np.uint8)
    self.max_speed = max_speed
    self.goal_radius = goal_radius
    self.wrong_target_radius = wrong_target_radius
    self.min_separation = min_separation
    if layout not in ("ring", "uniform"):
      raise ValueError(f"env.layout={layout!r} is not 'ring' or 'uniform'")
    if not 0 <= ring_radius[0] <= ring_radius[1] <= 0.9:
      raise ValueError(f"env.ring_radius={ring_radius} must satisfy 0 <= min <= max <= 0.9")
    self.layout, self.ring_radius = layout, tuple(ring_radius)
    self.latency_ms = latency_ms
    self.latency_sigma = latency_sigma
    self.spec = _spec(image_size, max_episode_steps)
    # Called after every executed step of step_chunk, before any auto-reset, with the
    # camera images uint8 [B, S, S, 3], the envs that executed the step bool [B] and
    # those whose episode ended on it bool [B]. Observations come once per chunk; a
    # video needs every step (jaxvla.envs.frames records them).
    self.frame_hook = None
    # Pixel-centre coordinates in world units, [S].
    self._pix = (np.arange(image_size) + 0.5) / image_size * 2.0 - 1.0
    self.agent = np.zeros((num_envs, 2), np.float32)
    self.targets = np.zeros((num_envs, num_targets, 2), np.float32)
    self.target_colours = np.zeros((num_envs, num_targets), np.int32)
    self.goal = np.zeros((num_envs,), np.int32)
    self.t = np.zeros((num_envs,), np.int32)
    self.ep_return = np.zeros((num_envs,), np.float32)
    self._reset(seed, None)

  # --------------------------------------------------------------- episodes --
  def group_ids(self) -> np.ndarray:
    """``int64 [B]``: the GRPO group of each env."""
    return self._groups.copy()

  def reset(self, seed: int,
            first_episode: np.ndarray | None = None) -> protocol.Observation:
    self._reset(seed, first_episode)
    return self.observe()

  def _reset(self, seed: int, first_episode: np.ndarray | None) -> None:
    self._seed = int(seed)
    # Number k of each env's current episode, [B].
    self._episode = protocol.check_first_episode(first_episode, self.num_envs)
    self._latency_rng = np.random.default_rng([seed, _LATENCY_STREAM, self.first_env_id])
    self._rng = np.random.default_rng([seed, _NOISE_STREAM, self.first_env_id])
    self._new_episodes(np.arange(self.num_envs))

  def _new_episodes(self, ids: np.ndarray) -> None:
    """Lays out the current episode (``self._episode``) of env ids ``ids`` ``[n]``."""
    for i in ids:
      rng = episode_rng(self._seed, int(self._groups[i]), int(self._episode[i]))
      pts = self._sample_separated(self.num_targets + 1, rng)
      self.agent[i] = pts[0]
      self.targets[i] = pts[1:]
      self.target_colours[i] = rng.choice(len(self.colour_names), self.num_targets,
                                          replace=False)
      self.goal[i] = rng.integers(self.num_targets)
    self.t[ids] = 0
    self.ep_return[ids] = 0.0

  def _sample_separated(self, n: int, rng: np.random.Generator) -> np.ndarray:
    """Rejection-samples ``n`` points ``[n, 2]`` at least ``min_separation`` apart."""
    margin = 0.85
    for _ in range(1000):
      if self.layout == "ring":
        angle = rng.uniform(0, 2 * np.pi, n - 1)
        radius = rng.uniform(*self.ring_radius, n - 1)
        ring = np.stack([np.cos(angle), np.sin(angle)], -1) * radius[:, None]
        pts = np.concatenate([np.zeros((1, 2)), ring]).astype(np.float32)
      else:
        pts = rng.uniform(-margin, margin, size=(n, 2)).astype(np.float32)
      d = np.linalg.norm(pts[:, None] - pts[None], axis=-1) + np.eye(n) * 10
      if d.min() >= self.min_separation:
        return pts
    raise RuntimeError(
        f"could not place {n} points {self.min_separation} apart; lower "
        "env.min_separation or env.num_targets")

  # ------------------------------------------------------------ observation --
  def instructions(self) -> np.ndarray:
    names = [self.colour_names[self.target_colours[i, self.goal[i]]]
             for i in range(self.num_envs)]
    return np.array([f"move to the {c} target" for c in names], dtype=object)

  def render(self, ids: np.ndarray | None = None) -> np.ndarray:
    """Draws envs ``ids`` ``[b]`` (default: every env): ``uint8 [b, S, S, 3]``."""
    ids = np.arange(self.num_envs) if ids is None else np.asarray(ids, np.int64)
    agent, targets = self.agent[ids], self.targets[ids]
    s = self.image_size
    img = np.broadcast_to(_BACKGROUND, (len(ids), s, s, 3)).copy()
    px = self._pix
    disc_r = self.goal_radius * 0.9
    for k in range(self.num_targets):
      dy = px[None, :, None] - targets[:, k, 1][:, None, None]
      dx = px[None, None, :] - targets[:, k, 0][:, None, None]
      mask = dx * dx + dy * dy <= disc_r * disc_r
      colour = self.palette[self.target_colours[ids, k]]  # [b, 3]
      img = np.where(mask[..., None], colour[:, None, None, :], img)
    dy = px[None, :, None] - agent[:, 1][:, None, None]
    dx = px[None, None, :] - agent[:, 0][:, None, None]
    mask = dx * dx + dy * dy <= (0.6 * disc_r) ** 2
    img = np.where(mask[..., None], _AGENT_COLOUR, img)
    return img

  def observe(self, ids: np.ndarray | None = None) -> protocol.Observation:
    """The observations of envs ``ids`` ``[b]`` (default: every env)."""
    ids = np.arange(self.num_envs) if ids is None else np.asarray(ids, np.int64)
    return protocol.Observation(
        images=self.render(ids)[:, None], state=self.agent[ids],
        instruction=self.instructions()[ids])

  # ------------------------------------------------------------------- step --
  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    actions = protocol.check_actions(actions, self.num_envs, self.spec.action_dim)
    actions = np.clip(actions, -1.0, 1.0)
    b, horizon = self.num_envs, actions.shape[1]
    reward = np.zeros(b, np.float32)
    terminated = np.zeros(b, bool)
    truncated = np.zeros(b, bool)
    success = np.zeros(b, bool)
    steps = np.zeros(b, np.int32)
    active = np.ones(b, bool)
    for h in range(horizon):
      self._sleep_latency(int(active.sum()))
      self.agent[active] = np.clip(
          self.agent[active] + self.max_speed * actions[active, h], -1.0, 1.0)
      self.t[active] += 1
      steps[active] += 1
      dist = np.linalg.norm(self.targets - self.agent[:, None], axis=-1)  # [B, K]
      goal_dist = dist[np.arange(b), self.goal]
      other = dist.copy()
      other[np.arange(b), self.goal] = np.inf
      hit_goal = active & (goal_dist <= self.goal_radius)
      hit_other = active & ~hit_goal & (other.min(-1) <= self.wrong_target_radius)
      timeout = active & ~hit_goal & ~hit_other & (self.t >= self.spec.max_episode_steps)
      reward[hit_goal] += 1.0
      success |= hit_goal
      terminated |= hit_goal | hit_other
      truncated |= timeout
      if self.frame_hook is not None:
        self.frame_hook(self.render(), active.copy(), hit_goal | hit_other | timeout)
      active &= ~(hit_goal | hit_other | timeout)
      if not active.any():
        break
    self.ep_return += reward
    done = terminated | truncated
    ended = np.nonzero(done)[0]
    final_obs = self.observe(np.flatnonzero(truncated))  # Before the auto-reset replaces it.
    episodes = [
        protocol.EpisodeStats(env_id=int(i), group=int(self._groups[i]),
                              episode=int(self._episode[i]),
                              episode_return=float(self.ep_return[i]), length=int(self.t[i]),
                              success=bool(success[i]), truncated=bool(truncated[i]))
        for i in ended]
    self._episode[ended] += 1  # Auto-reset: each env moves on to its own next episode.
    self._new_episodes(ended)
    return protocol.ChunkStep(obs=self.observe(), reward=reward, terminated=terminated,
                              truncated=truncated, success=success, steps=steps,
                              episodes=episodes, has_final_obs=truncated.copy(),
                              final_obs=final_obs)

  def _sleep_latency(self, n_active: int) -> None:
    """Sleeps the summed latency of ``n_active`` serially stepped envs."""
    if self.latency_ms <= 0 or n_active == 0:
      return
    draws = self._latency_rng.lognormal(np.log(self.latency_ms), self.latency_sigma, n_active)
    time.sleep(float(draws.sum()) / 1000.0)

  # ----------------------------------------------------------------- expert --
  def expert_chunk(self, horizon: int, noise: float = 0.0,
                   rng: np.random.Generator | None = None, speed: float = 1.0) -> np.ndarray:
    """Scripted expert: straight line to the named target, ``float32 [B, H, 2]``.

    Each action is the clipped displacement to the goal, scaled by ``speed``
    (``< 1``: a cautious demonstrator, like slow human teleoperation); ``noise``
    adds Gaussian perturbations (for diverse demonstrations). The chunk is
    planned open-loop from the current state, as a chunked policy would.
    """
    goal = self.targets[np.arange(self.num_envs), self.goal]
    pos = self.agent.copy()
    out = np.zeros((self.num_envs, horizon, 2), np.float32)
    for h in range(horizon):
      a = speed * np.clip((goal - pos) / (speed * self.max_speed), -1.0, 1.0)
      if noise > 0:
        a = np.clip(a + noise * (rng or self._rng).standard_normal(a.shape), -1.0, 1.0)
      out[:, h] = a
      pos = np.clip(pos + self.max_speed * a, -1.0, 1.0)
    return out

  def close(self) -> None:
    pass


def make(config: ml_collections.ConfigDict, num_envs: int, seed: int, *,
         group_size: int | None = None, first_env_id: int = 0,
         total_envs: int | None = None) -> ColorReach:
  """Builds ColorReach from the ``env`` sub-config (``group_size`` None: ``env.group_size``)."""
  return ColorReach(
      num_envs, image_size=config.image_size, num_targets=config.num_targets,
      num_colours=config.num_colours, max_episode_steps=config.max_episode_steps,
      max_speed=config.max_speed, goal_radius=config.goal_radius,
      wrong_target_radius=config.wrong_target_radius,
      min_separation=config.min_separation, layout=config.layout,
      ring_radius=tuple(config.ring_radius), latency_ms=config.latency_ms,
      latency_sigma=config.latency_sigma, seed=seed,
      group_size=config.group_size if group_size is None else group_size,
      first_env_id=first_env_id, total_envs=total_envs)
