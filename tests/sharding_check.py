"""Sharded vs unsharded learner on fake CPU devices (run by tests/test_sharding.py).

``python tests/sharding_check.py DATA,FSDP,TENSOR [...]`` needs
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before jax is imported
(launch/test.sh's compile-time flags as well save compile time). For each mesh
it checks that parameters are really sharded and that one sharded ``bc_step`` and
one sharded ``update`` match the unsharded learner on one device (loss,
metrics, new params and optimizer state, rtol = atol = 1e-5). Prints one
``OK ...`` line per mesh and ``ALL OK`` at the end; any mismatch raises.
"""

from __future__ import annotations

import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from configs import default  # noqa: E402
from jaxvla.envs import builtin  # noqa: E402
from jaxvla.learner import learner as learner_lib  # noqa: E402
from jaxvla.learner import optimizers as optimizers_lib  # noqa: E402
from jaxvla.models import policy as policy_lib  # noqa: E402
from jaxvla.parallel import sharding  # noqa: E402
from jaxvla.rollout import rollout as rollout_lib  # noqa: E402

RTOL = ATOL = 1e-5


def _well_conditioned_optimizer(learning_rate: float, max_grad_norm: float, b1: float = 0.9,
                                **_):
  """The learner's optimizer with Adam ``eps=1e-3`` instead of ``1e-8``.

  Adam's first steps map a gradient ``g`` to about ``lr * g / (|g| + eps)``: with
  ``eps=1e-8`` a gradient that is exactly zero up to float32 rounding (so its
  rounding differs between a sharded and an unsharded reduction) moves its
  parameter by up to ``lr`` in either direction, and a 1e-5 comparison of the new
  params would test Adam's conditioning, not the sharding. With ``eps=1e-3``
  (still well below the clipped gradients' typical size, so most parameters still
  move by ~``lr``) such noise stays below 1e-9. The state tree is the same.
  """
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adam(learning_rate, b1=b1, eps=1e-3))


def _close(name, got, want):
  got, want = jax.device_get(got), jax.device_get(want)
  assert jax.tree.structure(got) == jax.tree.structure(want), name
  paths = jax.tree_util.tree_flatten_with_path(want)[0]
  for (path, w), g in zip(paths, jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=ATOL,
                               err_msg=f"{name}{jax.tree_util.keystr(path)}")


def _copy(tree):
  """A fresh host copy (the updates donate their state)."""
  return jax.tree.map(np.array, jax.device_get(tree))


def main(meshes: list[tuple[int, int, int]]) -> None:
  t0 = time.perf_counter()
  c = default.get_config("smoke")
  c.num_envs, c.rollout_len, c.rl.num_minibatches = 8, 2, 2
  c.model.num_denoise_steps = 2  # (compile time; the chain length is not what is tested)
  optimizers_lib.make_optimizer = _well_conditioned_optimizer
  env = builtin.make(c.env, c.num_envs, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  plain = learner_lib.Learner(pol, c)

  # Inputs: a BC batch of the env's first observations, and a short rollout.
  params = pol.init(jax.random.PRNGKey(0))
  bc_batch = pol.prepare(env.observe())
  bc_actions = np.random.default_rng(0).uniform(-1, 1, (c.num_envs, c.model.chunk_len, 2)
                                                ).astype(np.float32)
  traj = rollout_lib.collect_segments(
      env, pol, jax.jit(functools.partial(pol.act, mode="train")), jax.jit(pol.value), params,
      c.rollout_len, jax.random.PRNGKey(1), seed=0)
  bc_state0 = _copy(learner_lib.init_state(params, plain.bc_tx, jax.random.PRNGKey(2)))
  ppo_state0 = _copy(learner_lib.init_state(params, plain.ppo_tx, jax.random.PRNGKey(3)))

  # Reference: unsharded, one device.
  ref_bc_state, ref_bc_loss = plain.bc_step(jax.device_put(bc_state0), bc_batch, bc_actions)
  ref_ppo_state, ref_metrics = plain.update(jax.device_put(ppo_state0), traj)
  print(f"reference done {time.perf_counter() - t0:.1f}s", flush=True)

  for shape in meshes:
    mesh = sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)))
    lrn = learner_lib.Learner(pol, c, mesh=mesh, rules=c.mesh.rules)

    # (a) parameters are really sharded.
    bc_state = lrn.shard_state(bc_state0)
    sharded = [x for x in jax.tree.leaves(bc_state.params)
               if "fsdp" in jax.tree.leaves(tuple(x.sharding.spec))
               and x.addressable_shards[0].data.shape != x.shape]
    assert sharded, f"no parameter is sharded over fsdp on mesh {shape}"
    mu = bc_state.opt_state[1][0].mu
    assert mu["PaliGemma"]["llm"]["embedder"]["input_embedding"].sharding == \
        bc_state.params["PaliGemma"]["llm"]["embedder"]["input_embedding"].sharding
    if shape[2] > 1:
      tensor = [x for x in jax.tree.leaves(bc_state.params)
                if "tensor" in jax.tree.leaves(tuple(x.sharding.spec))]
      assert tensor, f"no parameter is sharded over tensor on mesh {shape}"

    # (b) one sharded BC step and one sharded PPO update match the reference.
    new_bc_state, bc_loss = lrn.bc_step(bc_state, bc_batch, bc_actions)
    _close("bc_loss", bc_loss, ref_bc_loss)
    _close("bc_state", new_bc_state, ref_bc_state)
    new_ppo_state, metrics = lrn.update(lrn.shard_state(ppo_state0), traj)
    _close("ppo_metrics", metrics, ref_metrics)
    _close("ppo_state", new_ppo_state, ref_ppo_state)
    leaf = new_ppo_state.params["PaliGemma"]["llm"]["layers"]["mlp"]["linear"]
    assert leaf.sharding == lrn.param_shardings["PaliGemma"]["llm"]["layers"]["mlp"]["linear"]
    print(f"OK mesh={shape} sharded_leaves={len(sharded)} bc_loss={float(bc_loss['loss']):.6f} "
          f"ppo_loss={float(metrics['loss']):.6f} {time.perf_counter() - t0:.1f}s", flush=True)
  print("ALL OK", flush=True)


if __name__ == "__main__":
  main([tuple(int(v) for v in arg.split(",")) for arg in sys.argv[1:]])
