"""``jaxvla.bench.by_instruction``: an export's evaluation split by instruction."""

import jax
import numpy as np

from configs import default
from jaxvla.bench import by_instruction
from jaxvla.envs import builtin
from jaxvla.evaluation import exported
from jaxvla.models import policy as policy_lib
from jaxvla.storage import checkpoint, policy_io


def test_every_episode_is_counted_under_its_instruction(tmp_path):
  c = default.get_config("smoke")
  c.eval.num_episodes = 48
  spec = builtin.spec_from_config(c.env)
  policy = policy_lib.make_policy(c.model, spec)
  path = checkpoint.export_policy(str(tmp_path / "export"), policy.init(jax.random.PRNGKey(0)),
                                  c.to_json_best_effort())
  policy_io.write_spec(path, spec)
  table = by_instruction.split(path, 48)
  assert sum(sum(row.values()) for row in table.values()) == 48
  assert set(table) <= {f"move to the {colour} target" for colour in builtin.COLOURS}
  assert all(set(row) == set(by_instruction.OUTCOMES) for row in table.values())
  # The same episodes as the run's evaluation: the same success.
  success = sum(row["success"] for row in table.values()) / 48
  np.testing.assert_allclose(success, exported.evaluate_export(path, 48)["success_rate"])
