"""A policy export used on its own (jaxvla.evaluation.exported), and rollout frames (jaxvla.envs.frames).

Checked:

* ColorReach's ``frame_hook`` and :class:`FirstEpisodeFrames`: each env's first
  episode, frame by frame, equals the same episode stepped one action at a time
  (each frame the observation after that step), with its instruction and outcome;
  recording changes nothing the env returns. :func:`tile` lays episodes out and
  holds each last frame in a green (success) or red (failure) border.
* :func:`evaluate_export` on an export with ``norm_stats.json`` gives exactly what
  ``jaxvla.evaluation.success.evaluate`` gives on those params through that
  normalisation on the run's evaluation episodes; :func:`record_export` plays the
  same episodes and returns their frames.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from configs import default
from jaxvla.data import norm_stats
from jaxvla.envs import builtin, frames, make_env, normalized
from jaxvla.evaluation import exported
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.models import policy as policy_lib
from jaxvla.storage import checkpoint


def _reach(n: int) -> builtin.ColorReach:
  return builtin.ColorReach(n, image_size=16, num_targets=2, num_colours=3,
                            max_episode_steps=10, goal_radius=0.2, seed=0)


def test_first_episode_frames_match_single_step_replay():
  n, horizon, chunks = 6, 5, 4
  env = _reach(n)
  rec = frames.FirstEpisodeFrames(env)
  plain = _reach(n)
  obs, want_obs = rec.reset(7), plain.reset(7)
  np.testing.assert_array_equal(obs.images, want_obs.images)
  first_end, actions = {}, []
  for c in range(chunks):  # The noisy expert: most first episodes succeed, not all.
    actions.append(plain.expert_chunk(horizon, noise=0.8, rng=np.random.default_rng(c)))
    got, want = rec.step_chunk(actions[c]), plain.step_chunk(actions[c])
    # Recording changes nothing the env returns.
    np.testing.assert_array_equal(got.obs.images, want.obs.images)
    np.testing.assert_array_equal(got.steps, want.steps)
    for ep in got.episodes:
      first_end.setdefault(ep.env_id, ep)
  assert len(first_end) == n  # (10-step limit, 20 actions: every first episode ended)
  episodes = rec.episodes()
  assert [e.success for e in episodes] == [first_end[i].success for i in range(n)]
  assert any(e.success for e in episodes)
  assert [e.instruction for e in episodes] == list(want_obs.instruction)

  # The same episodes, one action per chunk: each observation is the next frame.
  single = _reach(n)
  replay = [[img] for img in single.reset(7).images[:, 0]]
  flat = np.stack(actions, axis=1).reshape(n, chunks * horizon, 2)
  done = np.zeros(n, bool)
  next_episode = {}  # A terminated episode's env: the first image of its next episode.
  for t in range(chunks * horizon):
    out = single.step_chunk(flat[:, t:t + 1])
    for i in np.flatnonzero(~done):
      if not out.done[i]:
        replay[i].append(out.obs.images[i, 0])
        continue
      done[i] = True  # Auto-reset replaced the observation: a time limit keeps the last
      if out.truncated[i]:  # one in final_obs; a termination has none to compare with.
        replay[i].append(out.final_obs.images[list(np.flatnonzero(out.truncated)).index(i), 0])
      else:
        replay[i].append(None)
        next_episode[i] = out.obs.images[i, 0]
  assert next_episode  # (some first episodes ended in a termination)
  for i, e in enumerate(episodes):
    assert len(e.frames) == first_end[i].length + 1 == len(replay[i])
    for t, want in enumerate(replay[i]):
      if want is not None:
        np.testing.assert_array_equal(e.frames[t], want, err_msg=f"env {i} frame {t}")
    if i in next_episode:  # The last frame was drawn before the auto-reset.
      assert not np.array_equal(e.frames[-1], next_episode[i])


def test_tile_holds_each_last_frame_in_its_outcome_colour():
  a = frames.Episode(np.full((3, 4, 4, 3), 10, np.uint8), "a", True)
  b = frames.Episode(np.full((5, 4, 4, 3), 20, np.uint8), "b", False)
  clip = frames.tile([a, b], scale=2, border=1)
  assert clip.shape == (5, 10, 20, 3) and clip.dtype == np.uint8
  assert (clip[:, 1:9, 1:9] == 10).all() and (clip[:, 1:9, 11:19] == 20).all()
  grey, green, red = [128] * 3, [40, 200, 60], [220, 40, 40]
  assert clip[0, 0, 0].tolist() == grey and clip[1, 0, 0].tolist() == grey
  assert clip[2, 0, 0].tolist() == green and clip[4, 0, 0].tolist() == green  # held
  assert clip[3, 0, 10].tolist() == grey and clip[4, 0, 10].tolist() == red


def test_frames_need_an_env_that_reports_steps():
  with pytest.raises(TypeError, match="frame_hook"):
    frames.FirstEpisodeFrames(object())


@pytest.mark.run_first
def test_evaluate_export_applies_its_norm_stats_on_the_runs_episodes(tmp_path):
  c = default.get_config("smoke")
  c.env.num_targets, c.env.num_colours = 1, 1
  spec = builtin.spec_from_config(c.env)
  policy = policy_lib.make_policy(c.model, spec)
  params = policy.init(jax.random.PRNGKey(4))
  # Deliberately off-centre statistics, so that skipping them would change the actions.
  normalizer = norm_stats.Normalizer(dict(
      state=norm_stats.NormStats(np.full(2, 0.3), np.full(2, 0.2)),
      actions=norm_stats.NormStats(np.full(2, 0.5), np.full(2, 0.5))), "zscore")
  export_dir = checkpoint.export_policy(str(tmp_path / "export"), params,
                                        c.to_json_best_effort())
  norm_stats.save_normalizer(export_dir, normalizer)

  n = 4
  env_config = c.env.copy_and_resolve_references()
  env_config.group_size = 1
  act = evaluate_lib.row_keyed_act(policy)

  def direct(transform):
    env = make_env(env_config, n, 0)
    return evaluate_lib.evaluate(normalized.wrap(env, transform), policy, act, params,
                                 jax.random.PRNGKey(c.seed),
                                 seed=c.seed + evaluate_lib.EVAL_SEED_OFFSET,
                                 chunk_len=c.model.chunk_len)

  got = exported.evaluate_export(export_dir, num_episodes=n)
  assert got == direct(normalizer)
  assert got != direct(None)  # (the statistics matter: the check above would see them lost)

  figures, episodes = exported.record_export(export_dir, num_episodes=n)
  assert figures == got  # Recording plays the same episodes alike.
  assert len(episodes) == n
  assert sum(len(e.frames) - 1 for e in episodes) == got["eval_env_steps"]
  assert np.mean([e.success for e in episodes]) == got["success_rate"]
  assert all(e.frames.shape[1:] == spec.image_shape for e in episodes)
  assert os.path.exists(os.path.join(export_dir, "norm_stats.json"))
