"""The pi0 / pi0.5 flow-matching policy (:class:`FlowPolicy`) and the policy registry.

:func:`make_policy` builds any family by ``config.model.name`` from
:data:`POLICIES`; the contract every family implements (``Policy``,
``ActOutput``, ``Evaluation``) lives in :mod:`jaxvla.models.contract`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxvla.envs import protocol
from jaxvla.models import action_token_vla, contract, denoise, layers, pi0, pi0_fast
from jaxvla.models import tokenizer as tokenizer_lib
from jaxvla.models.contract import ActOutput, Evaluation, Params, Policy


class FlowPolicy(layers.TreeOwner):
  """pi0 / pi0.5 flow-matching VLA (``config.name``) with a stochastic sampler for RL.

  The network's action and state sizes may exceed the env's (openpi pads both to
  32): states are zero-padded, the first ``spec.action_dim`` action dims are
  executed, and chunk log-probs count those dims only (the padded dims are
  sampled too, but they act on nothing).

  Args:
    config: the ``model`` sub-config.
    spec: the environment's static description.
  """

  tree_builder = staticmethod(pi0.build)

  def __init__(self, config: ml_collections.ConfigDict, spec: protocol.EnvSpec):
    self.tokenizer = tokenizer_lib.make_tokenizer(config.tokenizer, config.max_token_len,
                                                  config.tokenizer_path)
    h, w, _ = spec.image_shape
    if h != w:
      raise ValueError(f"the flow VLA expects square images, got {spec.image_shape}")
    self.net = pi0.Pi0Config.from_config(
        config, image_size=h, num_cameras=len(spec.camera_names), state_dim=spec.state_dim,
        action_dim=spec.action_dim, vocab_size=self.tokenizer.vocab_size,
        critic_state_dim=spec.critic_state_dim)
    denoise.check_samplers(config)
    self.chunk_len = config.chunk_len
    self.action_dim = spec.action_dim
    self.state_dim = spec.state_dim
    self.discrete_state = self.net.pi05 and config.discrete_state_input
    self.num_steps = config.num_denoise_steps
    self.noise_level = config.noise_level
    self.train_sampler = config.train_sampler
    self.eval_sampler = config.eval_sampler
    # Steered samplers ('latent', 'residual'; '' for none): the chunk's log-prob is the
    # steering head's Gaussian (H x A terms), and RL trains the heads under rl/ alone (a
    # change of the frozen flow would move the actions without moving that log-prob).
    self.steer = self.net.steer
    self.rl_heads_only = bool(self.steer)
    # Which denoise steps are stochastic and how their densities combine (denoise's
    # module docstring); both apply to the Gaussian samplers' chains only.
    self.sde_steps = config.sde_steps
    self.log_prob_steps = config.log_prob_steps
    # Gaussian terms in a chunk's log-prob: each step's, or one per dim (the steering
    # head's draw, the one stochastic step, or a mean over the steps).
    per_dim = self.steer or self.sde_steps == "one" or self.log_prob_steps == "mean"
    self.log_prob_terms = (1 if per_dim else self.num_steps) * self.chunk_len * self.action_dim

  # ---------------------------------------------------------------- helpers --
  def prepare(self, obs: protocol.Observation) -> dict[str, np.ndarray]:
    """Observation -> ``images [B, N, H, W, 3]``, ``image_mask [B, N]``, ``state [B, S]``,
    ``tokens/token_mask [B, L]``.

    pi0.5 with ``discrete_state_input`` writes the state into the prompt (its
    256-bin discretisation of [-1, 1]); the state array is passed along anyway.
    """
    state = obs.state.astype(np.float32)
    if state.shape[-1] != self.state_dim:
      raise ValueError(f"observation state has {state.shape[-1]} dims, the env spec "
                       f"{self.state_dim}")
    tokens, token_mask = self.tokenizer.encode(
        obs.instruction, state=state if self.discrete_state else None)
    pad = self.net.state_dim - state.shape[-1]
    batch = dict(images=obs.images, image_mask=obs.image_mask,
                 state=np.pad(state, ((0, 0), (0, pad))), tokens=tokens, token_mask=token_mask)
    if self.net.critic_state_dim:
      critic = obs.critic_state.astype(np.float32)
      if critic.shape[-1] == 0:  # (a dataset's observation: BC never reads the value)
        critic = np.zeros((state.shape[0], self.net.critic_state_dim), np.float32)
      if critic.shape[-1] != self.net.critic_state_dim:
        raise ValueError(f"observation critic_state has {critic.shape[-1]} dims, the env spec "
                         f"{self.net.critic_state_dim}")
      batch["critic_state"] = critic
    return batch

  def _prefix(self, params: Params, batch: dict) -> pi0.Prefix:
    return pi0.encode_prefix(self.net, params, batch["images"], batch["tokens"],
                             batch["token_mask"], contract.image_mask(batch))

  def _velocity_fn(self, params, prefix, state):
    return lambda x, t: pi0.velocity(self.net, params, prefix, state, x, t)

  def _dim_mask(self) -> jax.Array:
    """``[A_net]``: 1 for the env's action dims, 0 for padding."""
    return (jnp.arange(self.net.action_dim) < self.action_dim).astype(jnp.float32)

  def _estimate(self, params: Params, batch: dict) -> jax.Array | None:
    """The state estimator's reading ``[B, C]`` of the cameras (``pi0.estimate_state``),
    None without one."""
    if not self.net.steer_state_estimator:
      return None
    return pi0.estimate_state(self.net, params, batch["images"], contract.image_mask(batch))

  def _steer(self, params: Params, prefix: pi0.Prefix, feats: jax.Array, state: jax.Array,
             base: jax.Array | None = None, estimate: jax.Array | None = None):
    """The steering head's ``(mean [B, H, A_net], std [H, A_net])`` (see ``pi0.steer``).

    ``estimate``: the state estimator's reading; the head takes it as an input, without
    a gradient into the estimator (which its own regression trains, not the actor's loss).
    """
    image = (pi0.steer_image_input(self.net, params, prefix)
             if self.net.steer_image_channels else None)
    if estimate is not None:
      estimate = jax.lax.stop_gradient(estimate)
    return pi0.steer(self.net, params, feats, state,
                     None if base is None else base * self._dim_mask(), image, estimate)

  def _steer_log_prob(self, x: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
    """Per-dimension log-density ``[B, H, A_net]`` of the steered draw (0 on padded dims)."""
    return denoise.gaussian_log_prob(x, mean, std) * self._dim_mask()

  def _steer_entropy(self, std: jax.Array, batch_size: int) -> jax.Array:
    """``[B]``: the steering Gaussian's entropy over the executed dims."""
    ent = (denoise.gaussian_entropy(std) * self._dim_mask()).sum()
    return jnp.broadcast_to(ent, (batch_size,))

  # --------------------------------------------------------------- contract --
  def act(self, params: Params, batch: dict, rng: jax.Array, mode: str) -> ActOutput:
    """Samples a chunk. ``mode``: a sampler name, or 'train'/'eval' for the configured one.

    The chain is ``[B, K + 1, H, A_net]``, or ``[B, K + 2, H, A_net]`` for the
    'residual' modes (the base flow's chain, then the executed, corrected chunk) and
    for a Gaussian sampler with ``sde_steps='one'`` (its stochastic step's index last).
    """
    mode = {"train": self.train_sampler, "eval": self.eval_sampler}.get(mode, mode)
    head = denoise.STEERED.get(mode)
    if head and head != self.steer:
      raise ValueError(f"the {mode!r} sampler needs the {head!r} steering head; set "
                       f"config.model.train_sampler={head!r}")
    prefix = self._prefix(params, batch)
    state = batch["state"]
    b = state.shape[0]
    noise_key, sample_key = jax.random.split(rng)
    noise = jax.random.normal(noise_key, (b, self.chunk_len, self.net.action_dim))
    feats = pi0.features(self.net, params, prefix, state)
    dims = self._dim_mask().astype(bool)
    estimate = self._estimate(params, batch) if head else None
    if head == "latent":
      mean, std = self._steer(params, prefix, feats, state, estimate=estimate)
      # Padded dims act on nothing and keep the base policy's N(0, 1) noise.
      noise = jnp.where(dims, mean + std * noise if mode == "latent" else mean, noise)
      draw = noise
    flow_key, residual_key = jax.random.split(sample_key)
    chain, logp = denoise.sample_chain(
        self._velocity_fn(params, prefix, state), noise, flow_key, num_steps=self.num_steps,
        mode="ode" if head else mode, noise_level=self.noise_level, **self._steps(mode))
    if head == "residual":
      base = chain[:, -1]
      mean, std = self._steer(params, prefix, feats, state, base, estimate)
      draw = mean
      if mode == "residual":
        draw = mean + std * jax.random.normal(residual_key, base.shape)
      chain = jnp.concatenate([chain, (base + jnp.where(dims, draw, 0.0))[:, None]], axis=1)
    if not head:
      logp = logp * self._dim_mask()
    elif mode == head:  # 'latent' / 'residual' draw; their '_mean' modes are deterministic
      logp = self._steer_log_prob(draw, mean, std)
    # The executed chunk: the flow's last state, or the residual's corrected chunk after it.
    executed = chain[:, self.num_steps + int(head == "residual")]
    return ActOutput(actions=executed[:, :, :self.action_dim], chain=chain,
                     log_prob=logp.sum((1, 2)), log_prob_dims=logp,
                     value=pi0.value_head(params, feats, self.net.value_detach,
                                          batch.get("critic_state")))

  def evaluate(self, params: Params, batch: dict, chain: jax.Array) -> Evaluation:
    """Log-prob ``[B]`` of stored chains (``act``'s shapes) under ``params``."""
    prefix = self._prefix(params, batch)
    if self.steer:
      # The flow is frozen and deterministic: only the steering head's draw has a
      # density (latent: the initial noise; residual: executed minus base chunk).
      want = self.num_steps + (2 if self.steer == "residual" else 1)
      if chain.shape[1] != want:
        raise ValueError(f"a {self.steer!r} chain has {want} entries, got {chain.shape[1]}")
      state = batch["state"]
      feats = pi0.features(self.net, params, prefix, state)
      estimate = self._estimate(params, batch)
      if self.steer == "latent":
        mean, std = self._steer(params, prefix, feats, state, estimate=estimate)
        logp = self._steer_log_prob(chain[:, 0], mean, std)
      else:
        mean, std = self._steer(params, prefix, feats, state, chain[:, -2], estimate)
        logp = self._steer_log_prob(chain[:, -1] - chain[:, -2], mean, std)
      return Evaluation(log_prob=logp.sum((1, 2)), log_prob_dims=logp,
                        value=pi0.value_head(params, feats, self.net.value_detach,
                                             batch.get("critic_state")),
                        entropy=self._steer_entropy(std, chain.shape[0]),
                        state_estimate_loss=(None if estimate is None else pi0.state_estimate_loss(
                            estimate, batch["critic_state"])))
    logp, stds = denoise.chain_log_prob(
        self._velocity_fn(params, prefix, batch["state"]), chain, num_steps=self.num_steps,
        mode=self.train_sampler, noise_level=self.noise_level,
        **self._steps(self.train_sampler))
    mask = self._dim_mask()
    logp = logp * mask
    # Entropy of the scored Gaussian transitions, summed over executed dims, averaged
    # over steps.
    entropy = (denoise.gaussian_entropy(stds) * mask).sum((2, 3)).mean(1)
    return Evaluation(log_prob=logp.sum((1, 2)), log_prob_dims=logp,
                      value=pi0.value(self.net, params, prefix, batch["state"],
                                      batch.get("critic_state")),
                      entropy=entropy)

  def step_log_probs(self, params: Params, batch: dict,
                     chain: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Gaussian steps of stored chains scored one by one, before
    ``model.log_prob_steps`` combines them (for diagnostics per denoise step and dim).

    Returns:
      ``(logps [B, S, H, A_env], steps [B, S])``: the executed dims' log-densities of
      each scored step and which denoise step it is
      (:func:`jaxvla.models.denoise.chain_step_log_probs`).

    Raises:
      ValueError: the train sampler has no Gaussian flow steps (a steered sampler
        trains a head over a frozen, deterministic flow).
    """
    if self.train_sampler not in denoise.GAUSSIAN:
      raise ValueError(f"the {self.train_sampler!r} train sampler has no Gaussian flow steps "
                       f"to score one by one (they are those of {denoise.GAUSSIAN})")
    logps, _, steps = denoise.chain_step_log_probs(
        self._velocity_fn(params, self._prefix(params, batch), batch["state"]), chain,
        num_steps=self.num_steps, mode=self.train_sampler, noise_level=self.noise_level,
        **self._steps(self.train_sampler))
    return logps[..., :self.action_dim], steps

  def _steps(self, mode: str) -> dict:
    """``sample_chain`` / ``chain_log_prob``'s step settings for ``mode``: the
    configured ones for a Gaussian sampler, the defaults (no choice) for the others."""
    if mode not in denoise.GAUSSIAN:
      return {}
    return dict(sde_steps=self.sde_steps, log_prob_steps=self.log_prob_steps)

  def value(self, params: Params, batch: dict) -> jax.Array:
    return pi0.value(self.net, params, self._prefix(params, batch), batch["state"],
                     batch.get("critic_state"))

  def bc_loss(self, params: Params, batch: dict, actions: jax.Array, rng: jax.Array,
              mask: jax.Array | None = None) -> jax.Array:
    """Flow-matching loss on expert chunks ``actions`` ``[B, H, A_env]`` (a scalar).

    ``mask`` ``[B, H]`` (bool, default all True): the mean runs over the real actions
    only (a chunk window past an episode's end is padded in the data). The padded
    actions still enter the action expert as noisy inputs, as in openpi.
    """
    prefix = self._prefix(params, batch)
    pad = self.net.action_dim - actions.shape[-1]
    actions = jnp.pad(actions, ((0, 0), (0, 0), (0, pad)))
    noise_key, time_key = jax.random.split(rng)
    noise = jax.random.normal(noise_key, actions.shape)
    # pi0's time distribution: Beta(1.5, 1) skewed towards noisy times.
    t = jax.random.beta(time_key, 1.5, 1.0, (actions.shape[0],)) * 0.999 + 0.001
    x_t = t[:, None, None] * noise + (1.0 - t[:, None, None]) * actions
    v, _ = pi0.velocity(self.net, params, prefix, batch["state"], x_t, t)
    err = jnp.square(v - (noise - actions)) * self._dim_mask()
    if mask is None:
      return err.sum() / (err.shape[0] * err.shape[1] * self.action_dim)
    mask = mask.astype(err.dtype)
    return (err * mask[..., None]).sum() / (jnp.maximum(mask.sum(), 1.0) * self.action_dim)


# config.model.name -> the family's constructor ``(model config, EnvSpec) -> Policy``.
POLICIES = {
    "pi0": FlowPolicy,
    "pi05": FlowPolicy,
    "action_token_vla": action_token_vla.ActionTokenPolicy,
    "pi0_fast": pi0_fast.Pi0FastPolicy,
}


def make_policy(config: ml_collections.ConfigDict, spec: protocol.EnvSpec) -> Policy:
  """Builds the policy named by ``config.name`` (the ``model`` sub-config)."""
  if config.name not in POLICIES:
    raise ValueError(f"config.model.name={config.name!r} is not one of {sorted(POLICIES)}")
  return POLICIES[config.name](config, spec)
