"""A policy-sampled ``Trajectory`` for learner tests (no env stepping, random rewards)."""

from __future__ import annotations

import jax
import numpy as np

from jaxvla import types


def sampled(pol, env, params, t: int = 2, mode: str = "train") -> types.Trajectory:
  """A ``[t, B]`` trajectory of ``env``'s current observation acted on by ``pol`` in
  ``mode`` (a new sampler key per step; rewards random, no episode ends)."""
  rng = np.random.default_rng(0)
  batches, chains, logps, logp_dims, values = [], [], [], [], []
  for i in range(t):
    batch = pol.prepare(env.observe())
    out = pol.act(params, batch, jax.random.PRNGKey(i), mode)
    batches.append(batch)
    chains.append(np.asarray(out.chain))
    logps.append(np.asarray(out.log_prob))
    logp_dims.append(np.asarray(out.log_prob_dims))
    values.append(np.asarray(out.value))
  b = chains[0].shape[0]
  zeros = np.zeros((t, b), np.float32)
  return types.Trajectory(
      batch=jax.tree.map(lambda *x: np.stack(x), *batches), chain=np.stack(chains),
      log_prob=np.stack(logps), log_prob_dims=np.stack(logp_dims), value=np.stack(values),
      reward=rng.standard_normal((t, b)).astype(np.float32), done=np.zeros((t, b), bool),
      terminated=np.zeros((t, b), bool), final_value=zeros, steps=np.ones((t, b), np.int32),
      bootstrap_value=np.zeros((b,), np.float32),
      policy_version=np.zeros((t, b), np.int32))
