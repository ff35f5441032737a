"""pi0 and pi0.5 flow-matching VLAs with openpi's parameter tree.

Shape (openpi's ``Pi0``): a SigLIP ViT turns each camera image into tokens, the
PaliGemma decoder (expert 0) runs bidirectionally over ``[image tokens, language
tokens]`` (pi0.5: the language tokens include the discretised state), and the
action expert (expert 1) runs over the suffix and attends to the prefix through
the prefix's key/value cache, so the prefix is computed once per observation.

* pi0: suffix ``[state token, H action tokens]``; the flow time enters through
  ``action_time_mlp_{in,out}`` (``concat(action, sincos(t))``).
* pi0.5: suffix ``[H action tokens]``; the time goes through ``time_mlp_{in,out}``
  into adaptive RMSNorm (scale, shift, residual gate) in every expert layer.

The top-level keys are openpi's (``PaliGemma``, ``action_in_proj``, ...); the RL
additions — the value head, the ``flow_noise`` std head and, with a steered
sampler ('latent', 'residual'), the steering head (:func:`steer`) and its pixel state
estimator (:func:`estimate_state`) — live under ``rl/`` and are not part of an openpi
checkpoint. Variants: ``tiny`` (CPU tests),
``small``, ``full`` (Gemma 2B + Gemma 300M + So400m/14, openpi's sizes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx, struct

from jaxvla.models import denoise, gemma, layers, lora, siglip

PALIGEMMA_VOCAB_SIZE = 257_152

# llm (expert 0), action expert (expert 1), ViT; the tiny / small ViTs use patch 8.
VARIANTS = {
    "tiny": (gemma.GemmaConfig(64, 2, 256, 4, 1, 16), gemma.GemmaConfig(64, 2, 256, 4, 1, 16),
             siglip.SiglipConfig(64, 1, 256, 4, 8)),
    "small": (gemma.GemmaConfig(512, 4, 2048, 8, 1, 64), gemma.GemmaConfig(256, 4, 1024, 8, 1, 64),
              siglip.SiglipConfig(256, 4, 1024, 4, 8)),
    "full": (gemma.VARIANTS["gemma_2b"], gemma.VARIANTS["gemma_300m"],
             siglip.VARIANTS["So400m/14"]),
}
VALUE_SOURCES = ("expert", "prefix")
# The state estimator (:func:`estimate_state`): each of the ViT's patches (the cameras
# stacked on channels) to ESTIMATOR_PATCH_CHANNELS features by one shared dense layer (a
# convolution whose stride is its kernel), all patches side by side into a dense layer of
# ESTIMATOR_HIDDEN units, then one to the critic state's size. Matrix products only: on
# CPU, NatureCNN's overlapping strided convolutions (ManiSkill's RGB PPO encoder) made
# RL three times slower (57 env steps/s against 188), this about 6 times cheaper per image.
ESTIMATOR_PATCH_CHANNELS = 32
ESTIMATOR_HIDDEN = 256
# Floor of a critic-state dim's spread in the estimator's loss (:func:`state_estimate_loss`),
# in the state's units (1 mm, 1 mrad): a constant dim's target stays near 0.
ESTIMATE_STD_FLOOR = 1e-3


@dataclasses.dataclass(frozen=True)
class Pi0Config:
  """Static structure of one pi0 / pi0.5 network (derived once from ``config.model``)."""
  pi05: bool
  llm: gemma.GemmaConfig
  expert: gemma.GemmaConfig
  vit: siglip.SiglipConfig
  image_size: int
  num_cameras: int
  action_dim: int
  state_dim: int
  chunk_len: int
  vocab_size: int
  dtype: str
  remat: bool
  value_source: str
  value_hidden: int
  noise_std_min: float
  noise_std_max: float
  # The steering head (:func:`steer`) of a steered sampler: 'latent', 'residual' or ''
  # (none); its hidden width, the bound of its mean, its initial std and std floor.
  steer: str = ""
  steer_hidden: int = 256
  steer_bound: float = 2.0
  steer_std_init: float = 1.0
  steer_std_min: float = 0.05
  # Channels per image token of the head's spatial read (:func:`steer_image_input`; 0: none).
  steer_image_channels: int = 0
  # The steering head also reads the critic state as estimated from the cameras by a
  # small network of its own (:func:`estimate_state`), trained by regression on the critic state.
  steer_state_estimator: bool = False
  # The value head trains on the features without moving them (no critic gradient into
  # the VLM or the expert; RLinf's detach_critic_input).
  value_detach: bool = False
  # Size of the privileged critic state the value head also reads (the env's
  # ``critic_state_dim``; 0: none). The policy's actions never read it.
  critic_state_dim: int = 0

  @classmethod
  def from_config(cls, model: ml_collections.ConfigDict, *, image_size: int, num_cameras: int,
                  state_dim: int, action_dim: int, vocab_size: int,
                  critic_state_dim: int = 0) -> "Pi0Config":
    """Resolves ``config.model`` against the env's sizes (0 in the config = the env's)."""
    if model.variant not in VARIANTS:
      raise ValueError(f"config.model.variant={model.variant!r} is not one of {sorted(VARIANTS)}")
    llm, expert, vit = VARIANTS[model.variant]
    vit = dataclasses.replace(vit, posemb=model.posemb)
    llm_lora, expert_lora = lora.expert_configs(model)
    llm = dataclasses.replace(llm, lora=llm_lora)
    expert = dataclasses.replace(expert, lora=expert_lora)
    pi05 = model.name == "pi05"
    if model.value_source not in VALUE_SOURCES:
      raise ValueError(f"config.model.value_source={model.value_source!r} is not one of "
                       f"{VALUE_SOURCES}")
    if pi05 and model.value_source == "expert":
      raise ValueError("config.model.value_source='expert' reads pi0's state token, which "
                       "pi0.5 does not have; use 'prefix' for pi05")
    dims = {}
    for key, env_dim in (("action_dim", action_dim), ("state_dim", state_dim)):
      dims[key] = model[key] or env_dim
      if dims[key] < env_dim:
        raise ValueError(f"config.model.{key}={model[key]} is smaller than the env's {env_dim}")
    size = model.image_size or image_size
    if model.variant == "full" and model.vocab_size != PALIGEMMA_VOCAB_SIZE:
      raise ValueError(f"config.model.vocab_size must be {PALIGEMMA_VOCAB_SIZE} (PaliGemma's) "
                       f"for the full variant, got {model.vocab_size}")
    estimator = model.steer_state_estimator
    if estimator and not (model.train_sampler in denoise.STEERED and critic_state_dim):
      raise ValueError("config.model.steer_state_estimator needs a steered train_sampler "
                       f"({sorted(denoise.STEERED)}, got {model.train_sampler!r}) and a critic "
                       f"state to regress on (config.env.critic_state_dim, got {critic_state_dim})")
    vocab = model.vocab_size or vocab_size
    if vocab < vocab_size:
      raise ValueError(f"config.model.vocab_size={vocab} is smaller than the tokenizer's "
                       f"{vocab_size}")
    if model.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"config.model.dtype={model.dtype!r} is not 'float32' or 'bfloat16'")
    return cls(pi05=pi05, llm=llm, expert=expert, vit=vit, image_size=size,
               num_cameras=num_cameras, action_dim=dims["action_dim"],
               state_dim=dims["state_dim"], chunk_len=model.chunk_len, vocab_size=vocab,
               dtype=model.dtype, remat=model.remat, value_source=model.value_source,
               value_hidden=model.value_hidden, noise_std_min=model.noise_std_min,
               noise_std_max=model.noise_std_max,
               steer=model.train_sampler if model.train_sampler in denoise.STEERED else "",
               steer_hidden=model.steer_hidden, steer_bound=model.steer_bound,
               steer_std_init=model.steer_std_init, steer_std_min=model.steer_std_min,
               steer_image_channels=model.steer_image_channels,
               steer_state_estimator=estimator, value_detach=model.value_detach,
               critic_state_dim=critic_state_dim)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


def build(cfg: Pi0Config, rngs: nnx.Rngs) -> layers.Node:
  """The parameter tree (openpi's keys plus ``rl/``)."""
  ew, a = cfg.expert.width, cfg.action_dim
  children = dict(
      PaliGemma=layers.Node(
          img=siglip.build(cfg.vit, rngs, image_size=cfg.image_size, out_width=cfg.llm.width),
          llm=gemma.build([cfg.llm, cfg.expert], rngs, vocab_size=cfg.vocab_size,
                          adarms=[False, cfg.pi05])),
      action_in_proj=layers.dense(rngs, a, ew, ("action", "embed")),
      action_out_proj=layers.dense(rngs, ew, a, ("embed", "action")))
  if cfg.pi05:
    children["time_mlp_in"] = layers.dense(rngs, ew, ew, ("embed", "embed"))
    children["time_mlp_out"] = layers.dense(rngs, ew, ew, ("embed", "embed"))
  else:
    children["state_proj"] = layers.dense(rngs, cfg.state_dim, ew, ("action", "embed"))
    children["action_time_mlp_in"] = layers.dense(rngs, 2 * ew, ew, ("embed", "embed"))
    children["action_time_mlp_out"] = layers.dense(rngs, ew, ew, ("embed", "embed"))
  value_in = feature_width(cfg)
  # (With a critic state the input is no longer the model's width: not sharded as one.)
  rl = dict(value_hidden=layers.dense(rngs, value_in + cfg.critic_state_dim, cfg.value_hidden,
                                     ("embed" if not cfg.critic_state_dim else None, "mlp")),
            value_out=layers.dense(rngs, cfg.value_hidden, 1, ("mlp", None)),
            std_out=layers.dense(rngs, ew, a, ("embed", "action")))
  if cfg.steer:
    hid = cfg.steer_hidden
    # The residual head also sees the base flow's chunk [H * A].
    din = (value_in + cfg.state_dim + (cfg.chunk_len * a if cfg.steer == "residual" else 0)
           + steer_image_width(cfg)
           + (cfg.critic_state_dim if cfg.steer_state_estimator else 0))
    if cfg.steer_image_channels:
      rl["steer_image"] = layers.dense(rngs, cfg.llm.width, cfg.steer_image_channels,
                                       ("embed", None))
    if cfg.steer_state_estimator:
      rl["estimator"] = _build_estimator(cfg, rngs)
    rl["steer_in"] = layers.dense(rngs, din, hid, (None, "mlp"))
    rl["steer_hidden"] = layers.dense(rngs, hid, hid, ("mlp", "mlp"))
    # Zero-initialised mean: the steered policy starts as the base policy (latent: noise
    # ~ N(0, 1); residual: no correction on average).
    rl["steer_mean"] = layers.dense(rngs, hid, cfg.chunk_len * a, ("mlp", None),
                                    kernel_init=layers.zeros)
    log_std = lambda key, shape, dtype: jnp.full(shape, math.log(cfg.steer_std_init), dtype)
    rl["steer_log_std"] = layers.param(rngs, log_std, (cfg.chunk_len, a), (None, "action"))
  children["rl"] = layers.Node(**rl)
  return layers.Node(**children)


def _build_estimator(cfg: Pi0Config, rngs: nnx.Rngs) -> layers.Node:
  """``rl/estimator``: the patch layer, the hidden layer and the output layer (module
  constants; replicated, about a million parameters for the tiny ViT's 64 patches)."""
  k = cfg.vit.patch_size
  return layers.Node(
      patch=layers.dense(rngs, k * k * 3 * cfg.num_cameras, ESTIMATOR_PATCH_CHANNELS,
                         (None, None)),
      hidden=layers.dense(rngs, tokens_per_image(cfg) * ESTIMATOR_PATCH_CHANNELS,
                          ESTIMATOR_HIDDEN, (None, "mlp")),
      out=layers.dense(rngs, ESTIMATOR_HIDDEN, cfg.critic_state_dim, ("mlp", None)))


def tokens_per_image(cfg: Pi0Config) -> int:
  """Image tokens ``P`` the ViT makes of one camera (``(image_size // patch)^2``)."""
  return (cfg.image_size // cfg.vit.patch_size) ** 2


def steer_image_width(cfg: Pi0Config) -> int:
  """Width of :func:`steer_image_input` (0 without the spatial read)."""
  return cfg.num_cameras * tokens_per_image(cfg) * cfg.steer_image_channels


def feature_width(cfg: Pi0Config) -> int:
  """Width of :func:`features` (the value head's and the steering head's input)."""
  return cfg.expert.width if cfg.value_source == "expert" else cfg.llm.width


@struct.dataclass
class Prefix:
  """The prefix pass: hidden ``[B, P, D0]``, mask ``bool [B, P]``, KV ``[L, B, P, K, H]``."""
  hidden: jax.Array
  mask: jax.Array
  kv: gemma.KVCache


class PrefixConfig(Protocol):
  """What :func:`embed_prefix` reads of a model's config (pi0's, pi0-FAST's, the token VLA's)."""

  vit: siglip.SiglipConfig
  image_size: int
  remat: bool

  @property
  def compute_dtype(self) -> jnp.dtype: ...


def _images(cfg: PrefixConfig, images: jax.Array) -> jax.Array:
  """``uint8 [B, N, H, W, 3]`` -> ``float [B * N, S, S, 3]`` in [-1, 1] at the model's size."""
  b, n, h, w, c = images.shape
  x = images.reshape(b * n, h, w, c).astype(jnp.float32) / 127.5 - 1.0
  if (h, w) != (cfg.image_size, cfg.image_size):
    x = jax.image.resize(x, (b * n, cfg.image_size, cfg.image_size, c), "bilinear")
  return x


def image_token_mask(image_mask: jax.Array, images: jax.Array,
                     tokens_per_image: int) -> jax.Array:
  """``bool [B, N * P]``: each camera's mask ``[B, N]`` repeated over its ``P`` image tokens.

  openpi's ``embed_prefix`` puts a masked camera's tokens into the sequence and
  marks them invalid: they are left out of attention (no token sees them, they
  see nothing) and out of the position numbering (``cumsum(mask) - 1``), so a
  masked camera changes nothing that a valid token computes.
  """
  if image_mask.shape != images.shape[:2]:
    raise ValueError(f"image_mask has shape {tuple(image_mask.shape)}; the images need "
                     f"[B, N_cam] = {tuple(images.shape[:2])}")
  return jnp.repeat(image_mask.astype(bool), tokens_per_image, axis=1)


def embed_prefix(cfg: PrefixConfig, p: dict, images: jax.Array, tokens: jax.Array,
                 token_mask: jax.Array, image_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Prefix tokens ``[B, P, D0]`` and mask ``[B, P]`` (image tokens, then language).

  The one prefix of every model here (pi0, pi0-FAST, the action-token VLA): images
  ``uint8 [B, N_cam, H, W, 3]`` through the ViT at ``cfg.image_size``, then the tokens
  ``int32 [B, L]`` (``token_mask`` ``bool [B, L]``) through the LLM's embedding.
  ``image_mask`` ``bool [B, N_cam]``: a False camera's tokens are masked out, as in openpi.
  """
  dtype = cfg.compute_dtype
  b, n = images.shape[:2]
  img = siglip.encode(cfg.vit, p["PaliGemma"]["img"], _images(cfg, images), dtype=dtype,
                      remat=cfg.remat)
  per_image = img.shape[1]
  img = img.reshape(b, n * per_image, img.shape[2])
  text = gemma.embed(p["PaliGemma"]["llm"], tokens, dtype)
  mask = jnp.concatenate([image_token_mask(image_mask, images, per_image),
                          token_mask.astype(bool)], axis=1)
  return jnp.concatenate([img, text], axis=1), mask


def encode_prefix(cfg: Pi0Config, p: dict, images: jax.Array, tokens: jax.Array,
                  token_mask: jax.Array, image_mask: jax.Array) -> Prefix:
  """Runs expert 0 over the prefix (bidirectional) and keeps its KV cache.

  Args:
    images: ``uint8 [B, N_cam, H, W, 3]``; tokens ``int32 [B, L]``; token_mask ``bool [B, L]``;
      image_mask ``bool [B, N_cam]`` (False: the camera is left out, see :func:`image_token_mask`).
  """
  x, mask = embed_prefix(cfg, p, images, tokens, token_mask, image_mask)
  attn = mask[:, None, :] & mask[:, :, None]
  (hidden, _), kv = gemma.forward([cfg.llm, cfg.expert], p["PaliGemma"]["llm"], [x, None],
                                  positions=jnp.cumsum(mask, axis=1) - 1, mask=attn,
                                  dtype=cfg.compute_dtype, remat=cfg.remat)
  return Prefix(hidden=hidden, mask=mask, kv=kv)


def embed_suffix(cfg: Pi0Config, p: dict, state: jax.Array, x_t: jax.Array, t: jax.Array):
  """Suffix tokens ``[B, T_s, E]``, their ``ar_mask [T_s]`` and the adaRMS condition.

  Args:
    state: ``[B, state_dim]``; x_t: noisy chunk ``[B, H, A]``; t: flow time ``[B]``.
  """
  dtype = cfg.compute_dtype
  ew = cfg.expert.width
  act = layers.apply_dense(p["action_in_proj"], x_t.astype(jnp.float32))
  time_emb = layers.posemb_sincos(t, ew)
  horizon = x_t.shape[1]
  if cfg.pi05:
    cond = jax.nn.swish(layers.apply_dense(p["time_mlp_in"], time_emb))
    cond = jax.nn.swish(layers.apply_dense(p["time_mlp_out"], cond))
    ar = jnp.array([1] + [0] * (horizon - 1))
    return act.astype(dtype), ar, cond
  act = jnp.concatenate([act, jnp.broadcast_to(time_emb[:, None], act.shape)], axis=-1)
  act = layers.apply_dense(p["action_time_mlp_out"],
                           jax.nn.swish(layers.apply_dense(p["action_time_mlp_in"], act)))
  state_tok = layers.apply_dense(p["state_proj"], state.astype(jnp.float32))[:, None]
  ar = jnp.array([1, 1] + [0] * (horizon - 1))
  return jnp.concatenate([state_tok, act], axis=1).astype(dtype), ar, None


def _suffix_pass(cfg: Pi0Config, p: dict, prefix: Prefix, tokens: jax.Array, ar: jax.Array,
                 cond: jax.Array | None) -> jax.Array:
  """Expert 1 over suffix ``tokens [B, T_s, E]`` against the prefix cache; ``[B, T_s, E]``."""
  b, ts = tokens.shape[:2]
  suffix_mask = jnp.ones((b, ts), bool)
  mask = jnp.concatenate([
      jnp.broadcast_to(prefix.mask[:, None, :], (b, ts, prefix.mask.shape[1])),
      layers.prefix_lm_mask(suffix_mask, ar)], axis=-1)
  positions = prefix.mask.sum(-1)[:, None] + jnp.cumsum(suffix_mask, axis=1) - 1
  (_, out), _ = gemma.forward([cfg.llm, cfg.expert], p["PaliGemma"]["llm"], [None, tokens],
                              positions=positions, mask=mask, kv_cache=prefix.kv,
                              adarms_cond=[None, cond], dtype=cfg.compute_dtype, remat=cfg.remat)
  return out


def _heads(cfg: Pi0Config, p: dict, out: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Velocity and bounded std ``[B, H, A]`` (float32) from action-token outputs."""
  out = out.astype(jnp.float32)
  unit = jax.nn.sigmoid(layers.apply_dense(p["rl"]["std_out"], out))
  std = cfg.noise_std_min + (cfg.noise_std_max - cfg.noise_std_min) * unit
  return layers.apply_dense(p["action_out_proj"], out), std


def velocity(cfg: Pi0Config, p: dict, prefix: Prefix, state: jax.Array, x_t: jax.Array,
             t: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One denoise step's network pass with the prefix cache: velocity and std ``[B, H, A]``."""
  tokens, ar, cond = embed_suffix(cfg, p, state, x_t, t)
  out = _suffix_pass(cfg, p, prefix, tokens, ar, cond)
  return _heads(cfg, p, out[:, -x_t.shape[1]:])


def velocity_uncached(cfg: Pi0Config, p: dict, images, tokens, token_mask, image_mask, state,
                      x_t, t):
  """The same velocity from one joint pass over ``[prefix, suffix]`` (openpi's training path)."""
  x, prefix_mask = embed_prefix(cfg, p, images, tokens, token_mask, image_mask)
  suffix, ar, cond = embed_suffix(cfg, p, state, x_t, t)
  b, ts = suffix.shape[:2]
  mask = jnp.concatenate([prefix_mask, jnp.ones((b, ts), bool)], axis=1)
  ar_all = jnp.concatenate([jnp.zeros(prefix_mask.shape[1], ar.dtype), ar])
  (_, out), _ = gemma.forward([cfg.llm, cfg.expert], p["PaliGemma"]["llm"], [x, suffix],
                              positions=jnp.cumsum(mask, axis=1) - 1,
                              mask=layers.prefix_lm_mask(mask, ar_all),
                              adarms_cond=[None, cond], dtype=cfg.compute_dtype, remat=cfg.remat)
  return _heads(cfg, p, out[:, -x_t.shape[1]:])


def features(cfg: Pi0Config, p: dict, prefix: Prefix, state: jax.Array) -> jax.Array:
  """The observation's pooled features ``[B, D]`` (float32) from the configured source.

  'expert': the action expert's output at pi0's state token. That token attends
  to the prefix and itself only, so it does not depend on the noisy actions or
  the flow time and costs one extra token per observation. 'prefix': the masked
  mean of the decoder's prefix outputs (pi0.5's choice); the mask leaves out
  padding and masked cameras' tokens, so neither source sees a masked camera.
  """
  if cfg.value_source == "expert":
    tok = layers.apply_dense(p["state_proj"], state.astype(jnp.float32))[:, None]
    pooled = _suffix_pass(cfg, p, prefix, tok.astype(cfg.compute_dtype), jnp.array([1]),
                          None)[:, 0]
  else:
    m = prefix.mask[..., None].astype(jnp.float32)
    pooled = (prefix.hidden.astype(jnp.float32) * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
  return pooled.astype(jnp.float32)


def value_head(p: dict, feats: jax.Array, detach: bool = False,
               critic_state: jax.Array | None = None) -> jax.Array:
  """State value ``[B]`` from :func:`features` ``[B, D]`` (``detach``: no gradient into
  the features, ``Pi0Config.value_detach``) and the critic state ``[B, C]`` if any."""
  if detach:
    feats = jax.lax.stop_gradient(feats)
  if critic_state is not None and critic_state.shape[-1]:
    feats = jnp.concatenate([feats, critic_state.astype(feats.dtype)], axis=-1)
  h = jax.nn.gelu(layers.apply_dense(p["rl"]["value_hidden"], feats))
  return layers.apply_dense(p["rl"]["value_out"], h)[:, 0]


def value(cfg: Pi0Config, p: dict, prefix: Prefix, state: jax.Array,
          critic_state: jax.Array | None = None) -> jax.Array:
  """State value ``[B]`` (:func:`value_head` of :func:`features` and the critic state)."""
  return value_head(p, features(cfg, p, prefix, state), cfg.value_detach, critic_state)


def steer_image_input(cfg: Pi0Config, p: dict, prefix: Prefix) -> jax.Array:
  """The steering head's spatial read of the cameras ``[B, N * P * C]`` (float32).

  Each image token's decoder output (the prefix's first ``N * P`` positions) is
  projected to ``steer_image_channels`` channels and the tokens are laid side by
  side, so the head sees *where* in the image a feature is: a pooled token keeps
  only a blurred summary of an object's position (a linear probe of the cube's x/y
  on PushCube: R^2 0.6 from pi0's state token). A masked camera's tokens read as 0.
  """
  n = cfg.num_cameras * tokens_per_image(cfg)
  tokens = prefix.hidden[:, :n].astype(jnp.float32)
  read = layers.apply_dense(p["rl"]["steer_image"], tokens) * prefix.mask[:, :n, None]
  return read.reshape(read.shape[0], -1)


def estimate_state(cfg: Pi0Config, p: dict, images: jax.Array,
                   image_mask: jax.Array) -> jax.Array:
  """The critic state as the steering head's own network reads it off the cameras ``[B, C]``.

  ``images`` ``uint8 [B, N, H, W, 3]`` (resized to the model's size, as the ViT sees
  them) are cut into the ViT's patches, the cameras stacked on channels, a masked camera (``image_mask`` ``bool [B, N]`` False) as zeros.
  The output is in the units :func:`state_estimate_loss` trains it in: each dim
  standardised by the training minibatch's spread. An asymmetric critic's privileged
  state (Pinto et al. 2018) thus also teaches the actor's perception: the head over a
  frozen flow reads what the flow's pooled features know only roughly (where the
  object is), and a deployed policy still needs its cameras and proprioception alone.
  """
  q = p["rl"]["estimator"]
  b, n = images.shape[:2]
  s, k = cfg.image_size, cfg.vit.patch_size
  x = _images(cfg, images).reshape(b, n, s // k, k, s // k, k, 3)
  x = x * image_mask.astype(x.dtype)[:, :, None, None, None, None, None]
  # [B, rows, cols, k, k, N, 3]: each patch's pixels of every camera together.
  x = x.transpose(0, 2, 4, 3, 5, 1, 6).reshape(b, (s // k) ** 2, k * k * n * 3)
  h = jax.nn.relu(layers.apply_dense(q["patch"], x))
  h = jax.nn.relu(layers.apply_dense(q["hidden"], h.reshape(b, -1)))
  return layers.apply_dense(q["out"], h)


def state_estimate_loss(estimate: jax.Array, critic_state: jax.Array) -> jax.Array:
  """The estimator's regression loss per row ``[B]``: the squared error against the
  critic state ``[B, C]`` standardised by this batch's mean and spread (floored at
  :data:`ESTIMATE_STD_FLOOR`), averaged over dims, so every dim counts alike whatever its
  units (about 1 for a constant guess of a varying dim, 0 for a perfect estimate)."""
  target = critic_state.astype(jnp.float32)
  mean, std = target.mean(0), target.std(0)
  z = jax.lax.stop_gradient((target - mean) / jnp.maximum(std, ESTIMATE_STD_FLOOR))
  return jnp.mean(jnp.square(estimate.astype(jnp.float32) - z), axis=-1)


def steer(cfg: Pi0Config, p: dict, feats: jax.Array, state: jax.Array,
          base: jax.Array | None = None, image: jax.Array | None = None,
          estimate: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The steering head's Gaussian: mean ``[B, H, A]`` and std ``[H, A]``.

  'latent': over the flow's initial noise; 'residual': over the correction added to
  the base flow's chunk ``base [B, H, A]`` (which it sees). An MLP on ``[features,
  state(, base)]`` (the state as the policy receives it); the mean is bounded to
  ``±steer_bound`` (tanh) so steered noise stays where the flow was trained and a
  correction stays a correction, and the std is a state-independent parameter
  (``steer_std_init`` at first) floored at ``steer_std_min``. The mean starts at 0.
  With ``steer_image_channels`` the MLP also reads ``image``, :func:`steer_image_input`;
  with ``steer_state_estimator`` the ``estimate`` of :func:`estimate_state`.
  """
  q = p["rl"]
  inputs = [feats, state.astype(jnp.float32)]
  if cfg.steer == "residual":
    inputs.append(base.reshape(base.shape[0], -1).astype(jnp.float32))
  if cfg.steer_image_channels:
    inputs.append(image)
  if cfg.steer_state_estimator:
    inputs.append(estimate.astype(jnp.float32))
  h = jnp.tanh(layers.apply_dense(q["steer_in"], jnp.concatenate(inputs, axis=-1)))
  h = jnp.tanh(layers.apply_dense(q["steer_hidden"], h))
  raw = layers.apply_dense(q["steer_mean"], h).reshape(-1, cfg.chunk_len, cfg.action_dim)
  mean = cfg.steer_bound * jnp.tanh(raw / cfg.steer_bound)
  std = jnp.maximum(jnp.exp(q["steer_log_std"]), cfg.steer_std_min)
  return mean, std
