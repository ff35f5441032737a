"""Success split by instruction: ``python -m jaxvla.bench.by_instruction --policy=EXPORT``.

Plays an export's fixed-seed evaluation episodes (its run's evaluation sampler, key and
episode seed, as ``jaxvla.evaluation.exported.evaluate_export`` does) in the env in this process,
and counts each episode's outcome by the instruction it was given: ``success``,
``timeout`` (the time limit) or ``other`` (ended otherwise: ColorReach's wrong target).
On ColorReach the instruction names the target's colour, so a policy that has not
grounded a colour word shows as one row far below the others (docs/results/default_run.md).

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import collections
import json

import jax
import numpy as np
from absl import app, flags

from jaxvla.envs import make_vec_env, normalized, protocol
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.storage import policy_io

OUTCOMES = ("success", "timeout", "other")

_POLICY = flags.DEFINE_string("policy", None, "A jaxvla export (or run).", required=True)
_EPISODES = flags.DEFINE_integer("episodes", 512, "Episodes (envs, one episode each).")


class _Recorder:
  """The env, recording each ended episode's instruction (the one its envs were given
  before the step that ends it: the auto-reset replaces it) and outcome."""

  def __init__(self, env: protocol.VecEnv):
    self.env = env
    self.outcomes: list[tuple[str, str]] = []
    self._given: np.ndarray | None = None

  def __getattr__(self, name):
    return getattr(self.env, name)

  def reset(self, seed: int, first_episode: np.ndarray | None = None) -> protocol.Observation:
    obs = self.env.reset(seed, first_episode)
    self._given = np.asarray(obs.instruction).copy()
    return obs

  def step_chunk(self, actions: np.ndarray) -> protocol.ChunkStep:
    out = self.env.step_chunk(actions)
    for e in out.episodes:
      outcome = "success" if e.success else ("timeout" if e.truncated else "other")
      self.outcomes.append((str(self._given[e.env_id]), outcome))
    self._given = np.asarray(out.obs.instruction).copy()
    return out


def split(policy: str, episodes: int) -> dict[str, dict[str, int]]:
  """``{instruction: {outcome: count}}`` over ``episodes`` evaluation episodes."""
  loaded = policy_io.load(policy)
  c = loaded.config
  env_config = c.env.copy_and_resolve_references()
  env_config.group_size = 1
  env = _Recorder(make_vec_env(env_config, episodes, c.seed + 1, num_workers=0,
                               step_timeout_s=c.env_step_timeout_s,
                               hang_floor_s=c.env_hang_floor_s))
  try:
    evaluate_lib.evaluate(normalized.wrap(env, loaded.normalizer), loaded.policy,
                          evaluate_lib.row_keyed_act(loaded.policy), loaded.params,
                          jax.random.PRNGKey(c.seed),
                          seed=c.seed + evaluate_lib.EVAL_SEED_OFFSET,
                          chunk_len=c.model.chunk_len)
  finally:
    env.close()
  counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for instruction, outcome in env.outcomes:
    counts[instruction][outcome] += 1
  return {k: {o: counts[k][o] for o in OUTCOMES} for k in sorted(counts)}


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  table = split(_POLICY.value, _EPISODES.value)
  width = max(len(k) for k in table)
  print(f"{'instruction':<{width}}  {'success':>8}  {'timeout':>8}  {'other':>6}  {'rate':>6}")
  for k, row in table.items():
    n = sum(row.values())
    print(f"{k:<{width}}  {row['success']:>8}  {row['timeout']:>8}  {row['other']:>6}  "
          f"{row['success'] / n:>6.3f}")
  print(json.dumps(table))


if __name__ == "__main__":
  app.run(main)
