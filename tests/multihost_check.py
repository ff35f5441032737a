"""A learner split over processes vs the same learner in one process (run by tests/test_multihost.py).

``python tests/multihost_check.py OUT.npz`` (one process, the reference) or
``python tests/multihost_check.py OUT.npz --coordinator=HOST:PORT --num_processes=P
--process_id=I`` (one of P processes joined through ``jax.distributed``; each
process owns one CPU device, so the learner mesh ``(data=1, fsdp=P, tensor=1)``
spans processes and the params are FSDP-sharded across them).

Every process builds the same inputs (an 8-env BC batch and an 8-env rollout).
The reference learner sees all of them; in the multi-process run process ``i``
passes only its rows (``jaxvla.parallel.distributed.to_global`` assembles the global
batch). Computed, in this order: one ``bc_step``; one ``update``; one
streamed update (``micro_grads`` of two micro-batches, ``accumulate``,
``apply``), where the multi-process micro-batch ``j`` is every process's ``j``-th
slice of its envs and the reference uses the same columns; then the params
gathered and taken as this process's replica (what the rollout receives).
Process 0 (or the single process) writes the new params, losses and metrics to
``OUT.npz``; the test compares the two files.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

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
from jaxvla.parallel import distributed, sharding  # noqa: E402
from jaxvla.rollout import rollout as rollout_lib  # noqa: E402

NUM_ENVS, ROLLOUT_LEN, MICRO = 8, 2, 2  # MICRO: micro-batches of the streamed update.


def _optimizer(learning_rate: float, max_grad_norm: float, b1: float = 0.9, **_):
  # Adam eps 1e-3: see tests/sharding_check.py (keeps reduction-order noise below 1e-9).
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adam(learning_rate, b1=b1, eps=1e-3))


def _flat(prefix: str, tree) -> dict[str, np.ndarray]:
  return {prefix + jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("--coordinator", default="")
  parser.add_argument("--num_processes", type=int, default=1)
  parser.add_argument("--process_id", type=int, default=0)
  args = parser.parse_args()

  c = default.get_config("smoke")
  c.num_envs, c.rollout_len, c.rl.num_minibatches = NUM_ENVS, ROLLOUT_LEN, 2
  c.model.num_denoise_steps = 2
  c.distributed.coordinator_address = args.coordinator
  c.distributed.num_processes, c.distributed.process_id = args.num_processes, args.process_id
  c.distributed.initialization_timeout_s = 120
  distributed.initialize(c.distributed)
  optimizers_lib.make_optimizer = _optimizer
  procs, rank = jax.process_count(), jax.process_index()
  assert procs == args.num_processes, (procs, args.num_processes)

  # Identical inputs on every process.
  env = builtin.make(c.env, NUM_ENVS, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  params = pol.init(jax.random.PRNGKey(0))
  bc_batch = pol.prepare(env.observe())
  bc_actions = np.random.default_rng(0).uniform(-1, 1, (NUM_ENVS, c.model.chunk_len, 2)
                                                ).astype(np.float32)
  traj = jax.device_get(rollout_lib.collect_segments(
      env, pol, jax.jit(functools.partial(pol.act, mode="train")), jax.jit(pol.value), params,
      ROLLOUT_LEN, jax.random.PRNGKey(1), seed=0))
  host = lambda tree: jax.tree.map(np.array, jax.device_get(tree))
  params = host(params)

  if procs == 1 and not args.coordinator:  # The reference: one process, one device.
    learner = learner_lib.Learner(pol, c)
    mine = np.arange(NUM_ENVS)
    micro_cols = [np.concatenate([np.arange(p * NUM_ENVS // 2, (p + 1) * NUM_ENVS // 2)
                                  [j * 2:(j + 1) * 2] for p in range(2)]) for j in range(MICRO)]
  else:
    learner_devices, _ = sharding.role_devices("")
    assert len(learner_devices) == procs, learner_devices
    mesh = sharding.make_mesh(c.mesh, learner_devices)
    learner = learner_lib.Learner(pol, c, mesh=mesh, rules=c.mesh.rules)
    per = NUM_ENVS // procs
    mine = np.arange(rank * per, (rank + 1) * per)
    micro_cols = [mine[j * 2:(j + 1) * 2] for j in range(MICRO)]
  rows = lambda tree, idx: jax.tree.map(lambda x: x[idx], tree)
  cols = lambda t, idx: jax.tree.map(lambda x: x[idx] if x.ndim == 1 else x[:, idx], t)

  place = learner.shard_state

  out = {}
  bc_state, bc_metrics = learner.bc_step(
      place(learner_lib.init_state(params, learner.bc_tx, jax.random.PRNGKey(2))),
      rows(bc_batch, mine), bc_actions[mine])
  out.update(_flat("bc_params", distributed.local_replica(bc_state.params, learner.mesh)))
  out["bc_loss"] = np.asarray(float(bc_metrics["loss"]))

  ppo_state, metrics = learner.update(
      place(learner_lib.init_state(params, learner.ppo_tx, jax.random.PRNGKey(3))),
      cols(traj, mine))
  out.update(_flat("ppo_params", distributed.local_replica(ppo_state.params, learner.mesh)))
  out.update({f"ppo_metric_{k}": np.asarray(float(v)) for k, v in metrics.items()})

  state = place(learner_lib.init_state(params, learner.ppo_tx, jax.random.PRNGKey(3)))
  acc = None
  local_chunks = ROLLOUT_LEN * NUM_ENVS // procs
  for j in range(MICRO):
    acc = learner.accumulate(acc, learner.micro_grads(state.params, cols(traj, micro_cols[j]),
                                                      local_chunks))
  state, metrics = learner.apply(state, acc)
  out.update(_flat("stream_params", distributed.local_replica(state.params, learner.mesh)))
  out.update({f"stream_metric_{k}": np.asarray(float(v)) for k, v in metrics.items()})
  out["step"] = np.asarray(int(state.step))

  # Host values every process agrees on.
  out["sum_over_hosts"] = distributed.sum_over_hosts(np.asarray([rank + 1, 10]))
  out["broadcast"] = np.asarray(distributed.broadcast_from_primary({"x": float(rank + 7)})["x"])
  if distributed.is_primary():
    np.savez(args.out, **out)
  distributed.barrier("multihost_check_done")
  print(f"OK process {rank} of {procs}", flush=True)


if __name__ == "__main__":
  main()
