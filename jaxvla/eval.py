"""Success-rate tables people can compare: ``python -m jaxvla.eval``.

::

  python -m jaxvla.eval --config=configs/libero.py --policy=DIR --suite=libero_object \\
      --episodes_per_task=50 --out=DIR
  python -m jaxvla.eval --config=configs/maniskill.py:state --policy=DIR \\
      --tasks=PickCube-v1,PushCube-v1 --episodes_per_task=20 --out=DIR

``--policy`` is a jaxvla export, a jaxvla run (its checkpoints) or an openpi
checkpoint (:mod:`jaxvla.storage.policy_io`); the env settings come from ``--config``
(default: the policy's own run config), the model from the policy's run config
(an openpi checkpoint's from ``--config``, which must then be given).

The protocol (each choice and where it comes from is in docs/guides/evaluation.md):

* LIBERO: every task of ``--suite`` (or the ``--tasks`` listed), episode ``e`` of a
  task starting from the suite's fixed initial state ``e`` (openpi's
  ``get_task_init_states(task)[e]``), 10 no-op settle steps first (the env's
  ``settle_steps``), the suite's step limit, a new chunk every ``replan_steps = 5``
  actions, success = LIBERO's ``done``.
* ManiSkill3 / ColorReach: the ``--tasks`` listed (default the config's), each
  episode fixed by ``(--seed, env, episode)``; a new chunk every
  ``model.chunk_len`` actions unless ``--replan_steps`` says otherwise.

``--num_envs`` episodes of a task run in parallel (``--env_workers`` processes).
Episode ``e`` is env ``e % num_envs``'s episode ``e // num_envs``, and its sampler
noise is a function of ``(--seed, task, env, episode, chunk)``
(:func:`jaxvla.evaluation.success.row_keyed_act`): the same flags give the same
per-episode outcomes, and a killed evaluation started again with the same
``--out`` resumes with the episodes it has not played (``episodes.jsonl`` holds
every finished one).

Writes to ``--out``: ``settings.json``, ``episodes.jsonl``, ``results.json`` (per
task: successes, success rate with its Wilson 95% interval, mean episode length;
the suite mean), ``results.md`` (the same as a Markdown table) and, for the first
``--videos_per_task`` episodes of each task, ``videos/<task>_ep<e>.mp4``: every
camera side by side, one frame per chunk, with the instruction and the outcome
written on it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import zlib

import jax
import ml_collections
import numpy as np
import tqdm

from jaxvla import progress as progress_lib
from jaxvla.envs import libero as libero_env
from jaxvla.envs import make_vec_env, normalized, protocol, spec_from_config
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.storage import jsonl, policy_io

LIBERO_REPLAN_STEPS = 5  # openpi's examples/libero/main.py: replan_steps = 5.
LIBERO_RESET_SEED = 0  # Episode e of a task starts from the suite's init state e.
DEFAULT_SEED = 7  # openpi's LIBERO example seeds with 7.
SETTINGS_FILE = "settings.json"
EPISODES_FILE = "episodes.jsonl"
RESULTS_FILE = "results.json"
TABLE_FILE = "results.md"


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
  """The Wilson score interval of a success rate (95% for the default ``z``)."""
  if n == 0:
    return 0.0, 1.0
  p = successes / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return max(0.0, centre - half), min(1.0, centre + half)


@dataclasses.dataclass(frozen=True)
class Settings:
  """What fixes an evaluation's episodes; a resumed one must match it field by field."""
  policy: str
  policy_kind: str
  env: str
  tasks: tuple[str, ...]
  episodes_per_task: int
  num_envs: int
  seed: int
  reset_seed: int
  replan_steps: int
  env_config: str  # The env sub-config's JSON, the task field aside.

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), "tasks": list(self.tasks)}


def task_env_configs(env_config: ml_collections.ConfigDict, suite: str | None,
                     tasks: list[str]) -> dict[str, ml_collections.ConfigDict]:
  """The env sub-config of each task to evaluate, in order.

  Raises:
    ValueError: a suite for a non-LIBERO env, a bad suite or task name, or no task.
  """
  name = env_config.name
  if suite:
    if name != "libero":
      raise ValueError(f"--suite={suite} is LIBERO's; the config's env is {name!r} (use --tasks)")
    tasks = libero_env.suite_tasks(suite) + [t for t in tasks if not t.startswith(suite + "/")]
  if not tasks:
    if name == "libero":
      raise ValueError("LIBERO evaluation needs --suite (e.g. libero_object) or --tasks")
    tasks = [env_config.task if "task" in env_config else name]
  out = {}
  for task in tasks:
    c = env_config.copy_and_resolve_references()
    c.group_size = 1  # Independent episodes.
    if name == "libero":
      libero_env.parse_task(task)  # ValueError naming the task and the suites.
      c.task, c.max_episode_steps = task, 0  # 0: the suite's step limit.
    elif "task" in c:
      c.task = task
    elif task != name:
      raise ValueError(f"--tasks={task}: the {name!r} env has one task, {name!r}")
    out[task] = c
  return out


def check_fits(policy_spec: protocol.EnvSpec, env_spec: protocol.EnvSpec, policy: str,
               task: str) -> None:
  """Raises ValueError naming both sides when the policy cannot act in the env."""
  def describe(s: protocol.EnvSpec) -> str:
    return (f"action_dim={s.action_dim}, state_dim={s.state_dim}, cameras "
            f"{list(s.camera_names)} of {s.image_shape}")
  fits = (policy_spec.action_dim == env_spec.action_dim
          and policy_spec.state_dim == env_spec.state_dim
          and len(policy_spec.camera_names) == len(env_spec.camera_names)
          and tuple(policy_spec.image_shape) == tuple(env_spec.image_shape))
  if not fits:
    raise ValueError(f"the policy {policy} acts with {describe(policy_spec)}; the env of "
                     f"task {task!r} has {describe(env_spec)}")


def _read_episodes(out_dir: str) -> list[dict]:
  """The finished episodes in ``episodes.jsonl``. A kill can tear the last line: it is
  cut off the file (that episode is played again) so that appending starts clean.

  Raises:
    ValueError: a line other than the last is not JSON (naming the file and line).
  """
  file = os.path.join(out_dir, EPISODES_FILE)
  if not os.path.exists(file):
    return []
  jsonl.cut_torn(file)
  try:
    return jsonl.read(file)
  except ValueError as e:
    raise ValueError(f"{e}; remove the line or pick another --out") from None


def _start(out_dir: str, settings: Settings) -> list[dict]:
  """Writes ``settings.json`` (or checks it against a previous run's) and returns the
  episodes already played."""
  os.makedirs(out_dir, exist_ok=True)
  file = os.path.join(out_dir, SETTINGS_FILE)
  if os.path.exists(file):
    with open(file, encoding="utf-8") as f:
      stored = json.load(f)
    for key, value in settings.to_json().items():
      if stored.get(key) != value:
        raise ValueError(f"{out_dir} holds an evaluation with {key}={stored.get(key)!r}, this "
                         f"one has {value!r}: resume with the same flags or pick another --out")
  else:
    with open(file, "w", encoding="utf-8") as f:
      json.dump(settings.to_json(), f, indent=2)
  return _read_episodes(out_dir)


class EpisodeFrames:
  """Each env's current episode's instruction, and the frames of chosen episodes written
  as mp4 when they end; :func:`play_episodes`'s ``on_chunk``. A video shows every
  camera side by side, upscaled, with a caption strip: the reset's frame, then one per
  chunk. The env reports the last observation of a truncated episode only (not of a
  terminated one, which the next episode's reset replaces), so a video of a success
  or failure ends at the start of its last chunk."""

  HOLD_FRAMES = 4  # The last frame is shown this many more times (half a second at 8 fps).

  def __init__(self, out_dir: str, task: str, wanted: set[tuple[int, int]], num_envs: int,
               min_height: int = 256):
    self.dir = os.path.join(out_dir, "videos")
    self.task = task
    self.wanted = set(wanted)  # (env, episode k) pairs to record.
    self.num_envs = num_envs
    self.min_height = min_height
    self.frames: dict[tuple[int, int], list[np.ndarray]] = {}
    self.instruction = [""] * num_envs  # Of the episode each env is playing.

  def on_chunk(self, obs: protocol.Observation, result: protocol.ChunkStep | None,
               playing: np.ndarray) -> None:
    if result is None:  # After the reset: every env starts its episode playing[i].
      for i in range(self.num_envs):
        self._begin(i, int(playing[i]), obs)
      return
    ended = {ep.env_id: ep for ep in result.episodes}
    final_rows = np.flatnonzero(result.has_final_obs)
    for i in range(self.num_envs):
      key = (i, int(playing[i]))
      if i not in ended:
        if key in self.frames:
          self.frames[key].append(obs.images[i])
        continue
      if key in self.frames:
        if i in final_rows:  # Truncated: its last observation is kept apart.
          self.frames[key].append(
              result.final_obs.images[int(np.searchsorted(final_rows, i))])
        self._write(key, bool(ended[i].success))
      self._begin(i, ended[i].episode + 1, obs)

  def _begin(self, i: int, k: int, obs: protocol.Observation) -> None:
    self.instruction[i] = str(obs.instruction[i])
    if (i, k) in self.wanted:
      self.frames[(i, k)] = [obs.images[i]]

  def _write(self, key: tuple[int, int], success: bool) -> None:
    import imageio.v3 as iio  # pylint: disable=import-outside-toplevel
    i, k = key
    frames = [self._frame(f, self.instruction[i], success) for f in self.frames.pop(key)]
    frames += frames[-1:] * self.HOLD_FRAMES
    os.makedirs(self.dir, exist_ok=True)
    name = f"{self.task.replace('/', '_')}_ep{i + self.num_envs * k}.mp4"
    iio.imwrite(os.path.join(self.dir, name), np.stack(frames), plugin="pyav",
                codec="libx264", fps=8)

  def _frame(self, cameras: np.ndarray, instruction: str, success: bool) -> np.ndarray:
    """``uint8 [N_cam, H, W, 3]`` -> one captioned frame (even sides, for H.264)."""
    import PIL.Image  # pylint: disable=import-outside-toplevel
    import PIL.ImageDraw  # pylint: disable=import-outside-toplevel
    scale = max(1, -(-self.min_height // cameras.shape[1]))
    row = np.concatenate(list(cameras), axis=1).repeat(scale, 0).repeat(scale, 1)
    h, w = row.shape[:2]
    canvas = PIL.Image.new("RGB", (w + w % 2, h + 40 + h % 2), (0, 0, 0))
    canvas.paste(PIL.Image.fromarray(row), (0, 0))
    draw = PIL.ImageDraw.Draw(canvas)
    draw.text((4, h + 4), instruction[:90], fill=(255, 255, 255))
    draw.text((4, h + 22), "success" if success else "failure",
              fill=(60, 220, 80) if success else (230, 60, 60))
    return np.asarray(canvas)


def _evaluate_task(loaded: policy_io.LoadedPolicy, task: str, env_config, settings: Settings,
                   done: list[dict], out_dir: str, act_fn, videos: int, env_workers: int,
                   bar: tqdm.tqdm, log_file, lines: progress_lib.PhaseLog) -> None:
  """Plays ``task``'s episodes not in ``done``, appending each to ``done`` and ``log_file``."""
  n, e_total = settings.num_envs, settings.episodes_per_task
  # Episode e is env e % n's episode e // n: env i plays range(i, e_total, n).
  per_env = np.array([len(range(i, e_total, n)) for i in range(n)], np.int64)
  played = np.zeros(n, np.int64)
  for row in done:
    played[row["env_id"]] += 1
  if (played >= per_env).all():
    return
  config = loaded.config
  env = make_vec_env(env_config, n, settings.reset_seed, num_workers=env_workers,
                     step_timeout_s=config.env_step_timeout_s,
                     hang_floor_s=config.env_hang_floor_s)
  try:
    check_fits(loaded.spec, env.spec, loaded.path, task)
    rng = jax.random.fold_in(jax.random.PRNGKey(settings.seed), zlib.crc32(task.encode()))
    frames = EpisodeFrames(out_dir, task, {(i, k) for i in range(n) for k in range(
        int(played[i]), int(per_env[i])) if i + n * k < videos}, n)

    def on_episode(r: evaluate_lib.EpisodeResult) -> None:
      row = dict(task=task, episode=r.env_id + n * r.episode, env_id=r.env_id, k=r.episode,
                 success=r.success, length=r.length, episode_return=r.episode_return,
                 truncated=r.truncated, instruction=frames.instruction[r.env_id])
      log_file.write(json.dumps(row) + "\n")
      log_file.flush()
      done.append(row)
      bar.update(1)
      rate = float(np.mean([d['success'] for d in done]))
      bar.set_postfix(task=task, success=f"{rate:.2f}")
      lines.tick(lines.done + 1, success=rate)

    evaluate_lib.play_episodes(normalized.wrap(env, loaded.normalizer), loaded.policy, act_fn,
                               loaded.params, rng, seed=settings.reset_seed,
                               episodes_per_env=per_env - played, first_episode=played,
                               replan_steps=settings.replan_steps, on_chunk=frames.on_chunk,
                               on_episode=on_episode)
  finally:
    env.close()


def summarize(settings: Settings, episodes: list[dict]) -> dict:
  """Per-task figures and the suite mean (the mean of the tasks' success rates).

  A task's ``instruction`` is its episodes' one (empty where they differ: ColorReach
  names a colour per episode).
  """
  rows = []
  for task in settings.tasks:
    eps = sorted((e for e in episodes if e["task"] == task), key=lambda e: e["episode"])
    s = sum(e["success"] for e in eps)
    lo, hi = wilson_interval(s, len(eps))
    said = {e["instruction"] for e in eps}
    rows.append(dict(task=task, instruction=said.pop() if len(said) == 1 else "",
                     episodes=len(eps), successes=s,
                     success_rate=s / len(eps) if eps else float("nan"),
                     ci95=[lo, hi], mean_length=float(np.mean([e["length"] for e in eps]))
                     if eps else float("nan")))
  rates = [r["success_rate"] for r in rows]
  total = sum(r["episodes"] for r in rows)
  successes = sum(r["successes"] for r in rows)
  return dict(settings=settings.to_json(), tasks=rows, mean_success=float(np.mean(rates)),
              episodes=total, successes=successes,
              ci95=list(wilson_interval(successes, total)))


def markdown_table(results: dict) -> str:
  """``results`` (:func:`summarize`) as a Markdown table with a mean row."""
  lines = ["| task | success | 95% CI | episodes | mean length |", "|---|---|---|---|---|"]
  for r in results["tasks"]:
    label = r["task"] + (f" ({r['instruction']})" if r["instruction"] else "")
    lines.append(f"| {label} | {r['success_rate']:.3f} | [{r['ci95'][0]:.3f}, "
                 f"{r['ci95'][1]:.3f}] | {r['episodes']} | {r['mean_length']:.1f} |")
  lo, hi = results["ci95"]
  lines.append(f"| **mean of {len(results['tasks'])} tasks** | **{results['mean_success']:.3f}**"
               f" | [{lo:.3f}, {hi:.3f}] (pooled) | {results['episodes']} | |")
  return "\n".join(lines) + "\n"


def run(policy: str, out_dir: str, *, config: ml_collections.ConfigDict | None = None,
        suite: str | None = None, tasks: list[str] | None = None, episodes_per_task: int = 50,
        num_envs: int | None = None, env_workers: int | None = None, seed: int = DEFAULT_SEED,
        replan_steps: int | None = None, videos_per_task: int = 1, step: int | None = None,
        asset_id: str | None = None, progress: bool = True) -> dict:
  """Evaluates ``policy`` (see the module docstring) and writes the files to ``out_dir``.

  Returns:
    :func:`summarize`'s results.

  Raises:
    ValueError / FileNotFoundError: a bad flag, suite, task or policy, naming it.
  """
  if episodes_per_task < 1:
    raise ValueError(f"--episodes_per_task={episodes_per_task} must be >= 1")
  loaded = policy_io.load(policy, config if config is not None and policy_io.detect(policy)
                          == "openpi" else None, step=step, asset_id=asset_id)
  env_base = (config if config is not None else loaded.config).env
  configs = task_env_configs(env_base, suite, list(tasks or []))
  for task, c in configs.items():  # Fail before anything runs: the spec alone.
    if c.name != "maniskill":  # (ManiSkill's spec needs its simulator: checked per task.)
      check_fits(loaded.spec, spec_from_config(c), loaded.path, task)
  libero = env_base.name == "libero"
  run_config = config if config is not None else loaded.config
  num_envs = num_envs or run_config.num_envs
  replan = replan_steps or (LIBERO_REPLAN_STEPS if libero else loaded.config.model.chunk_len)
  if not 1 <= replan <= loaded.config.model.chunk_len:
    raise ValueError(f"--replan_steps={replan} must be in [1, model.chunk_len="
                     f"{loaded.config.model.chunk_len}]")
  settings = Settings(
      policy=loaded.path, policy_kind=loaded.kind, env=env_base.name, tasks=tuple(configs),
      episodes_per_task=episodes_per_task, num_envs=min(num_envs, episodes_per_task),
      seed=seed, reset_seed=LIBERO_RESET_SEED if libero else seed, replan_steps=replan,
      env_config=json.dumps({k: v for k, v in env_base.to_dict().items() if k != "task"},
                            sort_keys=True))
  workers = min(run_config.env_workers if env_workers is None else env_workers,
                settings.num_envs)
  if workers < 0 or (workers and settings.num_envs % workers):
    raise ValueError(f"--env_workers={workers} must be >= 0 and divide the episodes run in "
                     f"parallel ({settings.num_envs}, --num_envs)")
  done = _start(out_dir, settings)
  act_fn = evaluate_lib.row_keyed_act(loaded.policy)
  total = len(configs) * episodes_per_task
  # The bar on a terminal; elsewhere (a log file) a progress line every 30 s.
  lines = progress_lib.PhaseLog("evaluation (episodes)", total,
                                0.0 if progress and progress_lib.on_terminal() else 30.0,
                                initial=len(done))
  with tqdm.tqdm(total=total, initial=len(done), unit="episode",
                 disable=not (progress and progress_lib.on_terminal()), file=sys.stderr) as bar, \
      open(os.path.join(out_dir, EPISODES_FILE), "a", encoding="utf-8") as log_file:
    for task, c in configs.items():
      task_done = [d for d in done if d["task"] == task]
      _evaluate_task(loaded, task, c, settings, task_done, out_dir, act_fn, videos_per_task,
                     workers, bar, log_file, lines)
      done = [d for d in done if d["task"] != task] + task_done
  results = summarize(settings, done)
  with open(os.path.join(out_dir, RESULTS_FILE), "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)
  with open(os.path.join(out_dir, TABLE_FILE), "w", encoding="utf-8") as f:
    f.write(markdown_table(results))
  return results


def main(argv: list[str]) -> None:
  """Parses the flags (see the module docstring) and runs :func:`run`."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Config file (':variant'): the env to evaluate in; for an openpi "
      "checkpoint also the model. Default: the policy's own run config.", lock_config=True)
  policy_flags = policy_io.define_flags()
  out = flags.DEFINE_string("out", None, "Output directory (resumed if it holds a "
                            "killed evaluation with the same flags).", required=True)
  suite = flags.DEFINE_string("suite", None, "LIBERO suite: every task of it.")
  tasks = flags.DEFINE_list("tasks", [], "Tasks: LIBERO '<suite>/<i>' or ManiSkill3 ids.")
  episodes = flags.DEFINE_integer("episodes_per_task", 50, "Episodes per task.")
  num_envs = flags.DEFINE_integer("num_envs", None, "Episodes in parallel (default: the "
                                  "policy's run's num_envs).")
  workers = flags.DEFINE_integer("env_workers", None, "Env worker processes (default: the "
                                 "run's env_workers; 0: in this process).")
  seed = flags.DEFINE_integer("seed", DEFAULT_SEED, "Sampler seed (and the episodes' seed "
                              "outside LIBERO, whose episodes are its fixed init states).")
  replan = flags.DEFINE_integer("replan_steps", None, "Actions executed per chunk (default: "
                                "LIBERO 5, else model.chunk_len).")
  videos = flags.DEFINE_integer("videos_per_task", 1, "Episodes per task recorded as mp4.")

  def body(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    from jaxvla import simulator_env  # pylint: disable=import-outside-toplevel
    simulator_env.ensure()
    try:
      where = policy_flags.load_kwargs()
      results = run(where["path"], out.value, config=config_flag.value, suite=suite.value,
                    tasks=tasks.value, episodes_per_task=episodes.value,
                    num_envs=num_envs.value, env_workers=workers.value, seed=seed.value,
                    replan_steps=replan.value, videos_per_task=videos.value,
                    step=where["step"], asset_id=where["asset_id"])
    except (ValueError, FileNotFoundError) as e:
      sys.stderr.write(f"error: {e}\n")
      sys.exit(1)
    sys.stdout.write(markdown_table(results))

  app.run(body, argv)


if __name__ == "__main__":
  main(sys.argv)
