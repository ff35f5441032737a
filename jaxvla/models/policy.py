"""The policy contract RL and the runtime program against, and its flow-VLA implementation.

A policy is a stateless object holding static structure; parameters are a pure
pytree (nested dicts of arrays) so that optax, orbax and sharding code treat them
uniformly. Every method but :meth:`prepare` is pure and jittable.

* ``prepare(obs) -> batch``: host-side, observation -> arrays (tokenisation).
* ``act(params, batch, rng, mode) -> ActOutput``: actions, the stored sampler
  chain, its log-prob and the value.
* ``evaluate(params, batch, chain) -> Evaluation``: log-prob of a stored chain,
  value and entropy under the current parameters (for PPO/GRPO).
* ``bc_loss(params, batch, actions, rng)``: the supervised flow-matching loss.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx, struct

from jaxvla.envs import protocol
from jaxvla.models import denoise, flow_vla, tokenizer as tokenizer_lib

Params = dict


@struct.dataclass
class ActOutput:
  """What :meth:`Policy.act` returns.

  Attributes:
    actions: ``[B, H, A]`` the chunk to execute.
    chain: ``[B, K + 1, H, A]`` the sampler chain (``K = 0`` policies store ``[B, 1, H, A]``).
    log_prob: ``[B]`` log-probability of the chain (zeros in deterministic mode).
    value: ``[B]`` state value.
  """
  actions: jax.Array
  chain: jax.Array
  log_prob: jax.Array
  value: jax.Array


@struct.dataclass
class Evaluation:
  """Log-prob ``[B]``, value ``[B]`` and entropy ``[B]`` of stored chains."""
  log_prob: jax.Array
  value: jax.Array
  entropy: jax.Array


class Policy(Protocol):
  chunk_len: int
  action_dim: int

  def init(self, rng: jax.Array) -> Params: ...
  def prepare(self, obs: protocol.Observation) -> dict[str, np.ndarray]: ...
  def act(self, params: Params, batch: dict, rng: jax.Array, mode: str) -> ActOutput: ...
  def evaluate(self, params: Params, batch: dict, chain: jax.Array) -> Evaluation: ...
  def bc_loss(self, params: Params, batch: dict, actions: jax.Array,
              rng: jax.Array) -> jax.Array: ...


class FlowPolicy:
  """pi0-shaped flow-matching VLA with a stochastic sampler for RL.

  Args:
    config: the ``model`` sub-config.
    spec: the environment's static description.
  """

  def __init__(self, config: ml_collections.ConfigDict, spec: protocol.EnvSpec):
    self.tokenizer = tokenizer_lib.make_tokenizer(config.tokenizer, config.max_token_len)
    h, w, _ = spec.image_shape
    if h != w:
      raise ValueError(f"the flow VLA expects square images, got {spec.image_shape}")
    self.net_config = flow_vla.FlowVLAConfig.from_config(
        config, image_size=h, num_cameras=len(spec.camera_names), state_dim=spec.state_dim,
        action_dim=spec.action_dim, vocab_size=self.tokenizer.vocab_size)
    denoise.check_mode(config.train_sampler, needs_log_prob=True)
    denoise.check_mode(config.eval_sampler, needs_log_prob=False)
    self.chunk_len = config.chunk_len
    self.action_dim = spec.action_dim
    self.num_steps = config.num_denoise_steps
    self.noise_level = config.noise_level
    self.train_sampler = config.train_sampler
    self.eval_sampler = config.eval_sampler
    abstract = nnx.eval_shape(lambda: flow_vla.FlowVLA(self.net_config, rngs=nnx.Rngs(0)))
    self._graphdef, _ = nnx.split(abstract)

  # ---------------------------------------------------------------- helpers --
  def init(self, rng: jax.Array) -> Params:
    """Fresh parameters (a pure nested dict)."""
    model = flow_vla.FlowVLA(self.net_config, rngs=nnx.Rngs(params=rng))
    return nnx.to_pure_dict(nnx.state(model))

  def abstract_params(self) -> Params:
    """Shapes and dtypes of the parameters, without allocating them."""
    return jax.eval_shape(self.init, jax.random.key(0))

  def _model(self, params: Params) -> flow_vla.FlowVLA:
    return nnx.merge(self._graphdef, params)

  def prepare(self, obs: protocol.Observation) -> dict[str, np.ndarray]:
    """Observation -> ``images [B, N, H, W, 3]``, ``state [B, S]``, ``tokens/token_mask [B, L]``."""
    tokens, token_mask = self.tokenizer.encode(obs.instruction)
    return dict(images=obs.images, state=obs.state.astype(np.float32), tokens=tokens,
                token_mask=token_mask)

  def _velocity_fn(self, model, prefix, state):
    return lambda x, t: model.velocity(prefix, state, x, t)

  # --------------------------------------------------------------- contract --
  def act(self, params: Params, batch: dict, rng: jax.Array, mode: str) -> ActOutput:
    """Samples a chunk. ``mode``: a sampler name, or 'train'/'eval' for the configured one."""
    mode = {"train": self.train_sampler, "eval": self.eval_sampler}.get(mode, mode)
    model = self._model(params)
    prefix = model.encode_prefix(batch["images"], batch["tokens"], batch["token_mask"])
    b = batch["state"].shape[0]
    noise_key, sample_key = jax.random.split(rng)
    noise = jax.random.normal(noise_key, (b, self.chunk_len, self.action_dim))
    chain, logp = denoise.sample_chain(
        self._velocity_fn(model, prefix, batch["state"]), noise, sample_key,
        num_steps=self.num_steps, mode=mode, noise_level=self.noise_level)
    return ActOutput(actions=chain[:, -1], chain=chain, log_prob=logp.sum((1, 2)),
                     value=model.value(prefix))

  def evaluate(self, params: Params, batch: dict, chain: jax.Array) -> Evaluation:
    """Log-prob ``[B]`` of stored chains ``[B, K + 1, H, A]`` under ``params``."""
    model = self._model(params)
    prefix = model.encode_prefix(batch["images"], batch["tokens"], batch["token_mask"])
    logp, stds = denoise.chain_log_prob(
        self._velocity_fn(model, prefix, batch["state"]), chain, num_steps=self.num_steps,
        mode=self.train_sampler, noise_level=self.noise_level)
    # Entropy of the Gaussian transitions, summed over dims, averaged over steps.
    entropy = (jnp.log(stds) + 0.5 * jnp.log(2 * jnp.pi * jnp.e)).sum((2, 3)).mean(1)
    return Evaluation(log_prob=logp.sum((1, 2)), value=model.value(prefix), entropy=entropy)

  def value(self, params: Params, batch: dict) -> jax.Array:
    model = self._model(params)
    return model.value(model.encode_prefix(batch["images"], batch["tokens"],
                                           batch["token_mask"]))

  def bc_loss(self, params: Params, batch: dict, actions: jax.Array,
              rng: jax.Array) -> jax.Array:
    """Flow-matching loss on expert chunks ``actions`` ``[B, H, A]`` (a scalar)."""
    model = self._model(params)
    prefix = model.encode_prefix(batch["images"], batch["tokens"], batch["token_mask"])
    noise_key, time_key = jax.random.split(rng)
    noise = jax.random.normal(noise_key, actions.shape)
    # pi0's time distribution: Beta(1.5, 1) skewed towards noisy times.
    t = jax.random.beta(time_key, 1.5, 1.0, (actions.shape[0],)) * 0.999 + 0.001
    x_t = t[:, None, None] * noise + (1.0 - t[:, None, None]) * actions
    v, _ = model.velocity(prefix, batch["state"], x_t, t)
    return jnp.mean(jnp.square(v - (noise - actions)))


_POLICIES = {"flow_vla": FlowPolicy}


def make_policy(config: ml_collections.ConfigDict, spec: protocol.EnvSpec) -> Policy:
  """Builds the policy named by ``config.name`` (the ``model`` sub-config)."""
  if config.name not in _POLICIES:
    raise ValueError(f"config.model.name={config.name!r} is not one of {sorted(_POLICIES)}")
  return _POLICIES[config.name](config, spec)
