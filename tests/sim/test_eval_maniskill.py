"""``jaxvla.eval`` on the real ManiSkill3 (CPU, state observations): a list of tasks with
a fixed seed. Checked: one row per task in the given order, the config's step limit, the
same flags giving the same per-episode outcomes, a task id ManiSkill3 does not know
failing with its name, and a task whose state size differs failing with both sizes."""

import json

import jax
import pytest

from configs import maniskill as maniskill_config
from jaxvla import eval as eval_lib
from jaxvla.envs import spec_from_config
from jaxvla.models import policy as policy_lib
from jaxvla.storage import checkpoint, policy_io

pytestmark = [pytest.mark.sim, pytest.mark.timeout(600)]


def _episodes(out):
  with open(out / eval_lib.EPISODES_FILE) as f:
    return sorted((json.loads(l) for l in f), key=lambda r: (r["task"], r["episode"]))


def test_two_tasks_fixed_seed(tmp_path):
  c = maniskill_config.get_config("state")
  c.env.task, c.env.max_episode_steps = "PushCube-v1", 20
  spec = spec_from_config(c.env)
  policy = policy_lib.make_policy(c.model, spec)
  export = checkpoint.export_policy(str(tmp_path / "export"), policy.init(jax.random.PRNGKey(0)),
                                    c.to_json_best_effort())
  policy_io.write_spec(export, spec)
  tasks = ["PushCube-v1", "PullCube-v1"]  # Both 35 state dims.
  # One env in this process (the CPU simulator holds one per process): no worker start-up.
  kw = dict(tasks=tasks, episodes_per_task=2, num_envs=1, env_workers=0, videos_per_task=0,
            progress=False)
  results = eval_lib.run(export, str(tmp_path / "a"), **kw)
  assert [r["task"] for r in results["tasks"]] == tasks
  episodes = _episodes(tmp_path / "a")
  assert len(episodes) == 4 and all(e["length"] <= 20 for e in episodes)
  eval_lib.run(export, str(tmp_path / "b"), **kw)
  assert _episodes(tmp_path / "b") == episodes
  with pytest.raises(Exception, match="NoSuchCube-v1"):
    eval_lib.run(export, str(tmp_path / "c"), **{**kw, "tasks": ["NoSuchCube-v1"]})
  # PickCube's state has 42 dims: the policy's 35 do not fit, and the error says both.
  with pytest.raises(ValueError, match=r"state_dim=35.*'PickCube-v1' has .*state_dim=42"):
    eval_lib.run(export, str(tmp_path / "d"), **{**kw, "tasks": ["PickCube-v1"]})
