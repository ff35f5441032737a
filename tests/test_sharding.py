"""Logical-axis sharding: rule resolution, mesh sizes, full-size pi0 layouts, and a
sharded train step on 8 fake CPU devices equal to the unsharded one."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from configs import default
from jaxvla import config_checks
from jaxvla.models import summary
from jaxvla.parallel import sharding
from tests import conftest

RULES = default.get_config().mesh.rules


def _abstract_mesh(data, fsdp, tensor):
  return AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES)


def test_resolve_mesh_shape():
  assert sharding.resolve_mesh_shape(dict(data=1, fsdp=-1, tensor=1), 8) == (1, 8, 1)
  assert sharding.resolve_mesh_shape(dict(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 2)
  assert sharding.resolve_mesh_shape(dict(data=2, fsdp=4, tensor=1), 8) == (2, 4, 1)
  with pytest.raises(ValueError, match="does not match the 8 devices"):
    sharding.resolve_mesh_shape(dict(data=2, fsdp=2, tensor=1), 8)
  with pytest.raises(ValueError, match=r"config.mesh.fsdp=-1: .*= 3 does not divide"):
    sharding.resolve_mesh_shape(dict(data=3, fsdp=-1, tensor=1), 8)
  with pytest.raises(ValueError, match="at most one"):
    sharding.resolve_mesh_shape(dict(data=-1, fsdp=-1, tensor=1), 8)
  with pytest.raises(ValueError, match="config.mesh.tensor must be >= 1"):
    sharding.resolve_mesh_shape(dict(data=1, fsdp=-1, tensor=0), 8)


def test_parse_rules_errors_name_the_rule():
  assert sharding.parse_rules(RULES)["batch"] == ("data", "fsdp")
  assert sharding.parse_rules(RULES)["kv_heads"] == ()
  with pytest.raises(ValueError, match=r"rules\[1\]: 'embed' -> unknown mesh axis 'model'"):
    sharding.parse_rules([("batch", "data"), ("embed", "model")])
  with pytest.raises(ValueError, match=r"rules\[1\]: logical axis 'embed' already has a rule"):
    sharding.parse_rules([("embed", "fsdp"), ("embed", "tensor")])
  with pytest.raises(ValueError, match=r"rules\[0\] must be a \(logical axis"):
    sharding.parse_rules(["embed"])
  with pytest.raises(ValueError, match="names a mesh axis twice"):
    sharding.parse_rules([("embed", ("fsdp", "fsdp"))])


def test_logical_to_spec():
  mesh = _abstract_mesh(2, 4, 2)
  # A mesh axis shards one dimension only: [embed, embed] on its first.
  assert sharding.logical_to_spec(("embed", "embed"), RULES) == P("fsdp", None)
  # batch takes data and fsdp, so embed's fsdp is gone.
  assert sharding.logical_to_spec(("batch", None, "embed"), RULES) == P(("data", "fsdp"), None,
                                                                        None)
  assert sharding.logical_to_spec(("layers", "embed", "mlp"), RULES, (18, 2048, 16384),
                                  mesh) == P(None, "fsdp", "tensor")
  # Indivisible: 1 kv head is not split; 6 embed not split over fsdp=4, which stays free.
  assert sharding.logical_to_spec(("embed", "heads"), RULES, (6, 8), mesh) == P(None, "tensor")
  with pytest.raises(ValueError, match="logical axis 'bogus' has no rule"):
    sharding.logical_to_spec(("bogus",), RULES)


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_full_variant_is_fsdp_sharded(name):
  """openpi-sized trees on an 8-way FSDP mesh: >99% of the bytes are split 8 ways."""
  pol = summary.make_policy(name, "full")
  abstract = pol.abstract_params()
  mesh = _abstract_mesh(1, 8, 1)
  specs, skipped = sharding.param_specs(pol.logical_axes(), abstract, mesh, RULES)
  total = sharded = 0
  for leaf, spec in zip(jax.tree.leaves(abstract), jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))):
    n = int(np.prod(leaf.shape))
    total += n
    if "fsdp" in jax.tree.leaves(tuple(spec)):
      sharded += n
  assert total > 3.2e9
  assert sharded / total > 0.99, (sharded / total, skipped[:10])
  # The embedding [vocab, embed] and the stacked MLP weights take fsdp on embed.
  emb = specs["PaliGemma"]["llm"]["embedder"]["input_embedding"]
  assert emb == P("tensor", "fsdp"), emb  # (tensor has size 1 here)
  mlp = specs["PaliGemma"]["llm"]["layers"]["mlp"]["gating_einsum"]
  assert "fsdp" in jax.tree.leaves(tuple(mlp)), mlp


def test_config_mesh_checks():
  c = default.get_config()
  c.mesh.fsdp, c.mesh.data = -1, -1
  with pytest.raises(ValueError, match="mesh"):
    config_checks.validate(c)
  c = default.get_config()
  c.mesh.rules = (("embed", "model"),)
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    config_checks.validate(c)
  c = default.get_config()
  c.num_envs = 6
  with pytest.raises(ValueError, match="num_envs"):
    config_checks.validate_batch_shards(c, 4)


@pytest.mark.slow  # A minute of compiling: the slow step.
@pytest.mark.run_first(5)
@pytest.mark.timeout(900)
def test_sharded_train_step_equals_unsharded():
  """tiny pi0 on 8 fake CPU devices, every mesh axis at once (data=2, fsdp=2,
  tensor=2: the batch split 4 ways, params over fsdp and tensor); one BC step and
  one PPO update match the unsharded learner."""
  env = conftest.fast_xla_env(dict(os.environ))
  # (launch/test.sh's compile-time flags, if set, and eight devices)
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  script = os.path.join(os.path.dirname(__file__), "sharding_check.py")
  out = subprocess.run([sys.executable, script, "2,2,2"], env=env,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  lines = out.stdout.splitlines()
  assert sum(line.startswith("OK mesh=") for line in lines) == 1, out.stdout
  assert lines[-1] == "ALL OK", out.stdout
