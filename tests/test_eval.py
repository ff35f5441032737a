"""``python -m jaxvla.eval`` on ColorReach: tables, determinism, resume, videos, errors.

LIBERO's protocol (a suite's tasks, init states, step limits) is checked against the
real simulator in tests/sim/test_eval_libero.py.

Checked here:

* the Wilson interval against published values;
* the same flags give the same per-episode outcomes, whatever the parallelism of
  the policy's batch (episode noise is per episode);
* a killed evaluation (its log cut mid-task, the last line torn) resumes with only
  the episodes it had not played, and ends with exactly the uninterrupted run's
  episodes; different flags on the same ``--out`` are refused, naming the flag;
* results.json / results.md / an mp4 per chosen episode (decodable, one frame per
  chunk plus the first);
* the training loop's evaluation is the same code (``evaluate`` = ``play_episodes``
  one episode per env);
* bad input fails at the start naming what is wrong: a LIBERO suite for another env,
  a bad LIBERO task, a policy whose sizes do not fit the env (both named), a
  directory that holds no policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import default
from jaxvla import eval as eval_lib
from jaxvla.envs import builtin, make_env
from jaxvla.evaluation import success as evaluate_lib
from jaxvla.models import policy as policy_lib
from jaxvla.storage import checkpoint, policy_io

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  """A tiny random policy's export on a ColorReach whose episodes end at different times."""
  c = default.get_config("smoke")
  c.env.max_episode_steps = 12
  # Fast moves and big targets: a random policy hits one (either) in some episodes.
  c.env.max_speed, c.env.goal_radius, c.env.wrong_target_radius = 0.4, 0.45, 0.45
  spec = builtin.spec_from_config(c.env)
  policy = policy_lib.make_policy(c.model, spec)
  params = policy.init(jax.random.PRNGKey(0))
  out = checkpoint.export_policy(str(tmp_path_factory.mktemp("run") / "export"), params,
                                 c.to_json_best_effort())
  policy_io.write_spec(out, spec)
  return out


def _run(export, out, **kw):
  args = dict(episodes_per_task=7, num_envs=3, env_workers=0, videos_per_task=2, seed=3,
              progress=False)
  args.update(kw)
  return eval_lib.run(export, str(out), **args)


def _episodes(out) -> list[dict]:
  with open(os.path.join(out, eval_lib.EPISODES_FILE)) as f:
    return sorted((json.loads(l) for l in f), key=lambda r: (r["task"], r["episode"]))


def test_wilson_interval_matches_published_values():
  # Wilson (1927) / Newcombe (1998) Table I: 81/263 -> 0.2553..0.3662; 8/10 and 0/10.
  lo, hi = eval_lib.wilson_interval(81, 263)
  assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
  lo, hi = eval_lib.wilson_interval(8, 10)
  assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
  assert eval_lib.wilson_interval(0, 10)[0] == 0.0


def test_table_files_and_videos(export, tmp_path):
  results = _run(export, tmp_path / "a")
  (row,) = results["tasks"]
  assert row["task"] == "builtin" and row["episodes"] == 7
  assert row["ci95"] == list(eval_lib.wilson_interval(row["successes"], 7))
  assert {e["episode"] for e in _episodes(tmp_path / "a")} == set(range(7))
  with open(tmp_path / "a" / eval_lib.RESULTS_FILE) as f:
    assert json.load(f)["mean_success"] == results["mean_success"]
  table = (tmp_path / "a" / eval_lib.TABLE_FILE).read_text()
  assert "| builtin |" in table and "mean of 1 tasks" in table
  import imageio.v3 as iio
  videos = sorted(os.listdir(tmp_path / "a" / "videos"))
  assert videos == ["builtin_ep0.mp4", "builtin_ep1.mp4"]
  chunk = default.get_config("smoke").model.chunk_len
  for ep in _episodes(tmp_path / "a")[:2]:
    frames = iio.imread(tmp_path / "a" / "videos" / f"builtin_ep{ep['episode']}.mp4",
                        plugin="pyav")
    # The reset's frame, one per chunk but the last (whose end only a truncated episode
    # reports), then the last one held.
    want = -(-ep["length"] // chunk) + ep["truncated"] + eval_lib.EpisodeFrames.HOLD_FRAMES
    assert frames.shape[0] == want, ep
  assert frames.shape[1] >= 256 + 40  # Upscaled, with the caption strip.


def test_same_flags_same_outcomes_and_resume_continues_exactly(export, tmp_path):
  _run(export, tmp_path / "a")
  full = _episodes(tmp_path / "a")
  assert len({(e["length"], e["success"]) for e in full}) > 1  # Outcomes that can differ.
  _run(export, tmp_path / "b")
  strip = lambda rows: [{k: v for k, v in r.items()} for r in rows]
  assert strip(_episodes(tmp_path / "b")) == strip(full)

  # A kill after 3 episodes, the 4th line torn mid-write: only the rest is played.
  cut = tmp_path / "cut"
  os.makedirs(cut)
  (cut / eval_lib.SETTINGS_FILE).write_text((tmp_path / "a" / eval_lib.SETTINGS_FILE).read_text())
  lines = (tmp_path / "a" / eval_lib.EPISODES_FILE).read_text().splitlines()
  (cut / eval_lib.EPISODES_FILE).write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
  _run(export, cut)
  resumed = [json.loads(l) for l in (cut / eval_lib.EPISODES_FILE).read_text().splitlines()
             if l.strip() and l != lines[3][:20]]
  assert len(resumed) == 7
  assert sorted(resumed, key=lambda r: r["episode"]) == full

  with pytest.raises(ValueError, match="episodes_per_task=7"):
    _run(export, tmp_path / "a", episodes_per_task=9)
  with pytest.raises(ValueError, match="seed=3"):
    _run(export, tmp_path / "a", seed=4)


def test_training_evaluation_is_play_episodes(export):
  loaded = policy_io.load(export)
  env = make_env(loaded.config.env, 4, 11, group_size=1)
  act = evaluate_lib.row_keyed_act(loaded.policy)
  rng = jax.random.PRNGKey(5)
  got = evaluate_lib.evaluate(env, loaded.policy, act, loaded.params, rng, seed=11,
                              chunk_len=loaded.config.model.chunk_len)
  played = evaluate_lib.play_episodes(make_env(loaded.config.env, 4, 11, group_size=1),
                                      loaded.policy, act, loaded.params, rng, seed=11,
                                      episodes_per_env=np.ones(4, np.int64),
                                      replan_steps=loaded.config.model.chunk_len)
  assert got == evaluate_lib.summarize(played)
  assert sorted(r.env_id for r in played) == [0, 1, 2, 3]


def test_bad_input_fails_at_start_naming_it(export, tmp_path):
  with pytest.raises(ValueError, match="--suite=libero_object is LIBERO's"):
    _run(export, tmp_path / "x", suite="libero_object")
  libero_env = default.get_config().env.copy_and_resolve_references()
  libero_env.name, libero_env.task, libero_env.max_episode_steps = "libero", "", 0
  with pytest.raises(ValueError, match="libero_nope/1"):
    eval_lib.task_env_configs(libero_env, None, ["libero_nope/1"])
  c = default.get_config("smoke")
  c.env.image_size = 24  # The policy was built for 32 px.
  with pytest.raises(ValueError, match=r"acts with .*\(32, 32, 3\).*has .*\(24, 24, 3\)"):
    _run(export, tmp_path / "y", config=c)
  with pytest.raises(FileNotFoundError, match="is none of"):
    _run(str(tmp_path), tmp_path / "z")
  with pytest.raises(ValueError, match="--env_workers=2 must be >= 0 and divide"):
    _run(export, tmp_path / "w", num_envs=3, env_workers=2)
  # Nothing written before the checks.
  assert not os.path.exists(tmp_path / "y") and not os.path.exists(tmp_path / "w")


def test_command_line_prints_the_table(export, tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "jaxvla.eval", f"--policy={export}", f"--out={tmp_path / 'c'}",
       "--episodes_per_task=3", "--num_envs=3", "--env_workers=0", "--videos_per_task=0"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "| builtin |" in out.stdout
  bad = subprocess.run(
      [sys.executable, "-m", "jaxvla.eval", f"--policy={tmp_path / 'none'}",
       f"--out={tmp_path / 'd'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 1 and "no such directory" in bad.stderr


def test_an_openpi_checkpoint_evaluates_with_a_config(tmp_path):
  from jaxvla.models import openpi_export
  c = default.get_config("smoke")
  c.model.posemb = "learn"  # openpi's tree.
  spec = builtin.spec_from_config(c.env)
  policy = policy_lib.make_policy(c.model, spec)
  step_dir = tmp_path / "openpi" / "1000"
  openpi_export.export_openpi(str(step_dir), policy.init(jax.random.PRNGKey(0)), None,
                              "colorreach", model="pi0", image_size=policy.net.image_size,
                              patch_size=policy.net.vit.patch_size, identity_dims=(2, 2))
  with pytest.raises(ValueError, match="openpi checkpoint, which has no jaxvla config"):
    _run(str(step_dir), tmp_path / "no_config")
  results = _run(str(step_dir), tmp_path / "e", config=c, episodes_per_task=3)
  assert results["settings"]["policy_kind"] == "openpi" and results["episodes"] == 3
