"""Env-pool throughput with a zero-cost policy: ``python -m jaxvla.bench.envs``.

For each adapter and worker count, steps the pool for ``--seconds`` with
pre-drawn random action chunks (no inference) in two modes:

* ``sync``: ``step_chunk`` on every env, lockstep (the baselines' path);
* ``first_ready``: ``send`` / ``recv(b_max, t_max)`` — each batch goes back to
  the envs that are ready, so a slow env does not hold up the rest.

Prints a table of env steps/s and the first-ready / sync ratio, and a last line
of JSON with every row. The built-in env runs with its slept long-tail latency
(``--latency_ms``, ``--latency_sigma``) to stand in for a slow simulator.
"""

from __future__ import annotations

import json
import os
import platform
import time

import ml_collections
import numpy as np
from absl import app, flags

from jaxvla import config_files
from jaxvla.envs import make_vec_env

_ADAPTERS = flags.DEFINE_list("adapters", ["builtin"],
                              "Adapters: builtin, maniskill_state, maniskill_rgb "
                              "(cameras per chunk), maniskill_rgb_every_step, libero; a "
                              "maniskill_rgb* one with the suffix _full draws ManiSkill's own "
                              "Panda meshes instead of the config's lowpoly ones.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 0, "maniskill_rgb*: camera side (0: the config's).")
_WORKERS = flags.DEFINE_list("workers", ["1", "2", "4", "8"], "Worker counts to measure.")
_ENVS_PER_WORKER = flags.DEFINE_integer("envs_per_worker", 2, "Envs owned by each worker.")
_SECONDS = flags.DEFINE_float("seconds", 5.0, "Measured time per (adapter, workers, mode).")
_CHUNK = flags.DEFINE_integer("chunk", 5, "Actions per chunk.")
_B_MAX_FRACTION = flags.DEFINE_float("b_max_fraction", 0.5,
                                     "first_ready: B_max as a fraction of the envs.")
_T_MAX_MS = flags.DEFINE_float("t_max_ms", 5.0, "first_ready: T_max in milliseconds.")
_LATENCY_MS = flags.DEFINE_float("latency_ms", 2.0, "builtin: median per-step latency (slept).")
_LATENCY_SIGMA = flags.DEFINE_float("latency_sigma", 1.0, "builtin: log-normal shape.")


def env_config(adapter: str) -> ml_collections.ConfigDict:
  """The ``env`` sub-config of ``adapter`` (from the project's configs)."""
  full = adapter.startswith("maniskill_rgb") and adapter.endswith("_full")
  adapter = adapter[:-len("_full")] if full else adapter
  config_file = {"builtin": "default", "maniskill_state": "maniskill",
                 "maniskill_rgb": "maniskill", "maniskill_rgb_every_step": "maniskill",
                 "libero": "libero"}.get(adapter)
  if config_file is None:
    raise ValueError(f"--adapters: unknown adapter {adapter!r}")
  path = os.path.join(config_files.CONFIG_DIR, f"{config_file}.py")
  if adapter == "builtin":
    c = config_files.load_config(path).env
    c.latency_ms, c.latency_sigma = _LATENCY_MS.value, _LATENCY_SIGMA.value
    return c
  if adapter == "maniskill_state":
    return config_files.load_config(path, "state").env
  if adapter in ("maniskill_rgb", "maniskill_rgb_every_step"):
    c = config_files.load_config(path, "").env
    c.render_every_step = adapter == "maniskill_rgb_every_step"
    c.image_size = _IMAGE_SIZE.value or c.image_size
    if full:
      c.render_meshes = "full"
    return c
  return config_files.load_config(path).env


def run_sync(env, actions: np.ndarray, seconds: float) -> float:
  """Lockstep chunk steps of every env; returns env steps/s."""
  env.reset(0)
  env.step_chunk(actions)  # warm-up
  steps, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    steps += int(env.step_chunk(actions).steps.sum())
  return steps / (time.perf_counter() - t0)


def run_first_ready(env, actions: np.ndarray, seconds: float, b_max: int,
                    t_max_s: float) -> float:
  """send / recv(b_max, t_max) over the ready envs; returns env steps/s."""
  env.reset(0)
  ids = np.arange(env.num_envs)
  env.send(actions, ids)
  steps, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    ready, result = env.recv(b_max, t_max_s)
    steps += int(result.steps.sum())
    env.send(actions[ready], ready)
  elapsed = time.perf_counter() - t0
  env.reset(0)  # waits for and discards the chunks still in flight
  return steps / elapsed


def measure(adapter: str, workers: int) -> list[dict]:
  cfg = env_config(adapter)
  num_envs = workers * _ENVS_PER_WORKER.value
  env = make_vec_env(cfg, num_envs, seed=0, num_workers=workers, step_timeout_s=300)
  try:
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (num_envs, _CHUNK.value, env.spec.action_dim)).astype(np.float32)
    sync = run_sync(env, actions, _SECONDS.value)
    b_max = max(1, int(round(_B_MAX_FRACTION.value * num_envs)))
    ready = run_first_ready(env, actions, _SECONDS.value, b_max, _T_MAX_MS.value / 1000)
  finally:
    env.close()
  base = dict(adapter=adapter, workers=workers, envs=num_envs)
  return [dict(base, mode="sync", env_steps_per_s=round(sync, 1), ratio=1.0),
          dict(base, mode=f"first_ready(B_max={b_max},T_max={_T_MAX_MS.value:g}ms)",
               env_steps_per_s=round(ready, 1), ratio=round(ready / sync, 3))]


def main(argv):
  del argv
  rows = []
  header = f"{'adapter':<16}{'workers':>8}{'envs':>6}  {'mode':<34}{'env steps/s':>12}{'ratio':>8}"
  print(f"# {platform.machine()}, {platform.processor() or 'cpu'}, chunk={_CHUNK.value}, "
        f"{_SECONDS.value:g} s per row; builtin latency {_LATENCY_MS.value:g} ms "
        f"(log-normal sigma {_LATENCY_SIGMA.value:g})")
  print(header)
  for adapter in _ADAPTERS.value:
    for workers in map(int, _WORKERS.value):
      for row in measure(adapter, workers):
        rows.append(row)
        print(f"{row['adapter']:<16}{row['workers']:>8}{row['envs']:>6}  {row['mode']:<34}"
              f"{row['env_steps_per_s']:>12.1f}{row['ratio']:>8.2f}", flush=True)
  print(json.dumps(dict(rows=rows)))


if __name__ == "__main__":
  app.run(main)
