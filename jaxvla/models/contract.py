"""The policy contract the rollout, the learner and the runtime program against.

A leaf of the model package: it imports only the env contract, so every policy
family (:mod:`jaxvla.models.policy`, :mod:`jaxvla.models.action_token_vla`) and
every user of a policy can import it without importing a family.

A policy is a stateless object holding static structure; parameters are a pure
pytree (nested dicts of arrays) so that optax, orbax and sharding code treat them
uniformly. Every method but :meth:`Policy.prepare` is pure and jittable.

* ``prepare(obs) -> batch``: host-side, observation -> arrays (tokenisation).
  Every batch carries ``image_mask`` ``bool [B, N_cam]`` (the observation's
  per-camera mask); :func:`image_mask` owns the rule for a batch without one.
* ``act(params, batch, rng, mode) -> ActOutput``: actions, the stored sampler
  chain, its log-prob and the value.
* ``evaluate(params, batch, chain) -> Evaluation``: log-prob of a stored chain,
  value and entropy under the current parameters (for PPO/GRPO).
* ``value(params, batch) -> [B]``: the state value alone (GAE bootstraps).
* ``bc_loss(params, batch, actions, rng, mask=None)``: the supervised loss on expert
  chunks; ``mask [B, H]`` (bool) leaves out the actions past an episode's end.

Optional: ``host_counts() -> {name: number}``, counters a policy keeps on the host (pi0-FAST's
decoded and malformed token rows); the run writes them with its metrics (:func:`host_counts`).
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np
from flax import struct

from jaxvla.envs import protocol

Params = dict
IMAGE_MASK = "image_mask"  # the batch key of the per-camera mask, bool [B, N_cam]


def image_mask(batch: dict) -> jax.Array:
  """The batch's per-camera mask ``bool [B, N_cam]`` (False: leave the camera out).

  A batch without one is an error rather than "every camera valid": batches only
  come from ``Policy.prepare`` and live in memory (queue, learner), so a missing
  mask means a caller dropped it, and treating a placeholder camera as real
  would silently change what an openpi checkpoint does.

  Raises:
    KeyError: naming the key, when ``batch`` has no mask.
  """
  if IMAGE_MASK not in batch:
    raise KeyError(f"the policy batch has no {IMAGE_MASK!r} (bool [B, N_cam]); build batches "
                   f"with policy.prepare(Observation(...)), which adds it (keys: {sorted(batch)})")
  return batch[IMAGE_MASK]


@struct.dataclass
class ActOutput:
  """What :meth:`Policy.act` returns.

  Attributes:
    actions: ``[B, H, A]`` the chunk to execute (the env's action dims).
    chain: ``[B, K + 1, H, A_net]`` the sampler chain (flow policies: every denoise
      state, noise first, and one more entry for some samplers, see
      ``FlowPolicy.act``; action-token policies: ``[B, 1, H, A]`` bin indices).
    log_prob: ``[B]`` log-probability of the chain (zeros in deterministic mode).
    log_prob_dims: ``[B, H, A_net]`` the same per action dimension (over the denoise
      steps as ``model.log_prob_steps`` says; zero on padded dims), so
      ``log_prob = log_prob_dims.sum((1, 2))``.
    value: ``[B]`` state value.
  """
  actions: jax.Array
  chain: jax.Array
  log_prob: jax.Array
  log_prob_dims: jax.Array
  value: jax.Array


@struct.dataclass
class Evaluation:
  """Log-prob ``[B]`` (and per dimension ``[B, H, A_net]``), value ``[B]`` and entropy ``[B]``;
  ``state_estimate_loss`` ``[B]``: a policy's auxiliary regression of the critic state
  (the flow VLA's steering-head estimator), None for a policy without one."""
  log_prob: jax.Array
  log_prob_dims: jax.Array
  value: jax.Array
  entropy: jax.Array
  state_estimate_loss: jax.Array | None = None


def host_counts(policy) -> dict[str, float]:
  """The policy's host-side counters (its optional ``host_counts()``), else ``{}``."""
  counts = getattr(policy, "host_counts", None)
  return dict(counts()) if counts is not None else {}


class Policy(Protocol):
  chunk_len: int
  action_dim: int
  # Terms summed in one chunk's log-prob: Gaussian transitions (denoise steps x actions
  # x executed dims) for flow policies, tokens for action-token ones.
  log_prob_terms: int
  # RL trains the heads under ``rl/`` alone (the steered samplers: the log-prob is the
  # steered noise's, so a change of the frozen network must not move the actions).
  rl_heads_only: bool

  def init(self, rng: jax.Array) -> Params: ...
  def abstract_params(self) -> Params: ...
  def logical_axes(self) -> dict: ...
  def prepare(self, obs: protocol.Observation) -> dict[str, np.ndarray]: ...
  def act(self, params: Params, batch: dict, rng: jax.Array, mode: str) -> ActOutput: ...
  def evaluate(self, params: Params, batch: dict, chain: jax.Array) -> Evaluation: ...
  def value(self, params: Params, batch: dict) -> jax.Array: ...
  def bc_loss(self, params: Params, batch: dict, actions: jax.Array, rng: jax.Array,
              mask: jax.Array | None = None) -> jax.Array: ...
