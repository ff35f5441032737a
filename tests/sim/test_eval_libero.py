"""``jaxvla.eval`` on the real LIBERO (CPU): the suite protocol end to end.

A tiny random policy is evaluated on two libero_spatial tasks, one episode each, in
an env worker process. Checked: the suites' task lists come from LIBERO's benchmark;
episode ``e`` of a task starts from the suite's init state ``e``; a failed episode
runs the suite's full step limit (220 for libero_spatial) after the settle steps; the
table names LIBERO's instruction per task; a video is written; the policy's sizes are
checked against LIBERO's before anything runs.
"""

import json
import os

import jax
import pytest

from configs import libero as libero_config
from jaxvla import eval as eval_lib
from jaxvla.envs import libero as libero_env
from jaxvla.envs import spec_from_config
from jaxvla.models import policy as policy_lib
from jaxvla.storage import checkpoint, policy_io

pytestmark = [pytest.mark.sim, pytest.mark.timeout(600)]


def test_suites_list_their_tasks_and_bad_names_fail():
  for suite in ("libero_spatial", "libero_object", "libero_goal", "libero_10"):
    assert libero_env.suite_tasks(suite) == [f"{suite}/{i}" for i in range(10)]
  assert len(libero_env.suite_tasks("libero_90")) == 90
  with pytest.raises(ValueError, match="--suite='libero_11'.*libero_spatial"):
    libero_env.suite_tasks("libero_11")


def test_episode_e_starts_from_init_state_e():
  env = libero_env.LiberoEnv("libero_object/0", 2, image_size=32,
                             seed=eval_lib.LIBERO_RESET_SEED)
  try:
    env.reset(eval_lib.LIBERO_RESET_SEED)
    # eval plays episode e on env e % 2 as its episode e // 2.
    assert [env.init_state_index(e % 2, e // 2) for e in range(6)] == list(range(6))
  finally:
    env.close()


@pytest.mark.run_first  # (started first: the step's tests run in parallel)
def test_two_spatial_tasks_end_to_end(tmp_path):
  c = libero_config.get_config("libero_spatial/0")
  c.env.image_size = 32
  c.env.render_quality = "fast"  # (a third of the render's CPU; the protocol is the same)
  spec = spec_from_config(c.env)
  policy = policy_lib.make_policy(c.model, spec)
  export = checkpoint.export_policy(str(tmp_path / "export"), policy.init(jax.random.PRNGKey(0)),
                                    c.to_json_best_effort())
  policy_io.write_spec(export, spec)

  tasks = ["libero_spatial/0", "libero_spatial/1"]
  # One episode per task in one worker process: a fast-rendered LIBERO step on the CPU
  # costs ~0.07 s, most of it MuJoCo's software rendering of the two cameras. Several episodes
  # per task over several envs, and the video limit, are tests/test_eval.py's (built-in
  # env); LIBERO's init state per episode is test_episode_e_starts_from_init_state_e's.
  results = eval_lib.run(export, str(tmp_path / "eval"), tasks=tasks, episodes_per_task=1,
                         num_envs=1, env_workers=1, videos_per_task=1, progress=False)
  assert [r["task"] for r in results["tasks"]] == tasks
  from libero.libero import benchmark
  suite = benchmark.get_benchmark_dict()["libero_spatial"]()
  for i, row in enumerate(results["tasks"]):
    assert row["instruction"] == suite.get_task(i).language
    assert row["episodes"] == 1
  with open(tmp_path / "eval" / eval_lib.EPISODES_FILE) as f:
    episodes = [json.loads(l) for l in f]
  assert len(episodes) == len(tasks)
  for e in episodes:  # The suite's limit, settle steps not counted.
    assert e["length"] == 220 if not e["success"] else e["length"] <= 220, e
  assert sorted(os.listdir(tmp_path / "eval" / "videos")) == [
      "libero_spatial_0_ep0.mp4", "libero_spatial_1_ep0.mp4"]
  assert "| libero_spatial/0 (" in (tmp_path / "eval" / eval_lib.TABLE_FILE).read_text()

  # A policy built for 32 px does not fit LIBERO at 64 px: refused before any episode.
  c64 = libero_config.get_config("libero_spatial/0")
  with pytest.raises(ValueError, match=r"\(32, 32, 3\).*\(64, 64, 3\)"):
    eval_lib.run(export, str(tmp_path / "bad"), config=c64, suite="libero_spatial",
                 episodes_per_task=1, progress=False)
