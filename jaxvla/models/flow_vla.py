"""A pi0-shaped flow-matching VLA in Flax NNX (the tiny/small variants).

Shape, following pi0: a ViT encodes each camera image into tokens; a Gemma-style
decoder (RMSNorm, RoPE, GeGLU) runs bidirectionally over the prefix
``[image tokens, instruction tokens]``; an *action expert* with its own weights
but the same heads runs over the suffix ``[state token, H action tokens]`` and
attends to the prefix through its per-layer key/value cache. The prefix never
attends to the suffix, so the prefix is computed once per observation and reused
by every denoise step. The expert predicts the flow velocity of the action chunk;
a value head reads the pooled prefix (pi0.5-style), and for the ``flow_noise``
sampler a head on the expert tokens predicts a bounded std.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

VARIANTS = {
    # vit_width, vit_depth, width, expert_width, depth, num_heads, head_dim
    "tiny": dict(vit_width=64, vit_depth=1, width=64, expert_width=64, depth=2,
                 num_heads=4, head_dim=16),
    "small": dict(vit_width=192, vit_depth=4, width=256, expert_width=128, depth=4,
                  num_heads=4, head_dim=64),
}


@dataclasses.dataclass(frozen=True)
class FlowVLAConfig:
  """Static hyper-parameters of the network (derived once from ``config.model``)."""
  image_size: int
  num_cameras: int
  patch_size: int
  posemb: str
  state_dim: int
  action_dim: int
  chunk_len: int
  vocab_size: int
  max_token_len: int
  vit_width: int
  vit_depth: int
  width: int
  expert_width: int
  depth: int
  num_heads: int
  head_dim: int
  mlp_ratio: int
  value_hidden: int
  noise_std_min: float
  noise_std_max: float

  @classmethod
  def from_config(cls, model: ml_collections.ConfigDict, *, image_size: int,
                  num_cameras: int, state_dim: int, action_dim: int,
                  vocab_size: int) -> "FlowVLAConfig":
    if model.variant not in VARIANTS:
      raise ValueError(f"config.model.variant={model.variant!r} is not one of "
                       f"{sorted(VARIANTS)}")
    if image_size % model.patch_size:
      raise ValueError(f"image size {image_size} is not a multiple of "
                       f"config.model.patch_size={model.patch_size}")
    return cls(image_size=image_size, num_cameras=num_cameras, patch_size=model.patch_size,
               posemb=model.posemb,
               state_dim=state_dim, action_dim=action_dim, chunk_len=model.chunk_len,
               vocab_size=vocab_size, max_token_len=model.max_token_len,
               mlp_ratio=model.mlp_ratio, value_hidden=model.value_hidden,
               noise_std_min=model.noise_std_min, noise_std_max=model.noise_std_max,
               **VARIANTS[model.variant])


def rope(x: jax.Array, positions: jax.Array, max_wavelength: float = 10_000.0) -> jax.Array:
  """Rotary embedding of ``x`` ``[B, T, N, D]`` at ``positions`` ``[B, T]``."""
  half = x.shape[-1] // 2
  freq = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[..., None, None].astype(jnp.float32) * freq  # [B, T, 1, D/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def posemb_sincos(t: jax.Array, dim: int, min_period: float = 4e-3,
                  max_period: float = 4.0) -> jax.Array:
  """Sine-cosine embedding of scalars ``t`` ``[B]`` -> ``[B, dim]`` (pi0's time embedding)."""
  fraction = jnp.linspace(0.0, 1.0, dim // 2)
  period = min_period * (max_period / min_period) ** fraction
  angle = t[:, None] * (2.0 * math.pi / period)[None]
  return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.0) -> jax.Array:
  """Fixed 2-D sine-cosine position embedding ``[h * w, width]`` (big_vision's)."""
  y, x = jnp.mgrid[:h, :w]
  omega = 1.0 / temperature ** (jnp.arange(width // 4) / (width // 4 - 1))
  y = y.reshape(-1)[:, None] * omega[None]
  x = x.reshape(-1)[:, None] * omega[None]
  return jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)


class DecoderLayer(nnx.Module):
  """One Gemma-style layer's weights (attention projections + GeGLU MLP)."""

  def __init__(self, width: int, num_heads: int, head_dim: int, mlp_ratio: int, *,
               rngs: nnx.Rngs):
    inner = num_heads * head_dim
    self.num_heads, self.head_dim = num_heads, head_dim
    self.pre_attn_norm = nnx.RMSNorm(width, rngs=rngs)
    self.q = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
    self.k = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
    self.v = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
    self.o = nnx.Linear(inner, width, use_bias=False, rngs=rngs)
    self.pre_mlp_norm = nnx.RMSNorm(width, rngs=rngs)
    self.gate = nnx.Linear(width, mlp_ratio * width, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(width, mlp_ratio * width, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(mlp_ratio * width, width, use_bias=False, rngs=rngs)

  def qkv(self, x: jax.Array, positions: jax.Array):
    """Projects ``x`` ``[B, T, W]`` to q, k, v ``[B, T, N, D]`` (RoPE on q, k)."""
    h = self.pre_attn_norm(x)
    split = lambda y: y.reshape(*y.shape[:2], self.num_heads, self.head_dim)
    q = rope(split(self.q(h)), positions)
    k = rope(split(self.k(h)), positions)
    return q, k, split(self.v(h))

  def finish(self, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual output projection and MLP; ``attn`` ``[B, T, N, D]``."""
    x = x + self.o(attn.reshape(*attn.shape[:2], -1))
    h = self.pre_mlp_norm(x)
    return x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Masked softmax attention: q ``[B, T, N, D]``, k/v ``[B, S, N, D]``, mask ``[B, T, S]``."""
  logits = jnp.einsum("btnd,bsnd->bnts", q, k) / math.sqrt(q.shape[-1])
  logits = jnp.where(mask[:, None], logits, -1e30)
  return jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(logits, axis=-1), v)


class ViTBlock(nnx.Module):
  def __init__(self, width: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads, width, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.mlp1 = nnx.Linear(width, mlp_ratio * width, rngs=rngs)
    self.mlp2 = nnx.Linear(mlp_ratio * width, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm1(x))
    return x + self.mlp2(jax.nn.gelu(self.mlp1(self.norm2(x))))


class ViT(nnx.Module):
  """SigLIP-shaped image encoder: patches -> pos-emb -> blocks -> tokens ``[B, P, width]``."""

  def __init__(self, cfg: FlowVLAConfig, *, rngs: nnx.Rngs):
    p = cfg.patch_size
    num_patches = (cfg.image_size // p) ** 2
    self.embedding = nnx.Conv(3, cfg.vit_width, (p, p), strides=(p, p), padding="VALID",
                              rngs=rngs)
    self.posemb = cfg.posemb
    if cfg.posemb == "learn":
      self.pos_embedding = nnx.Param(
          0.02 * jax.random.normal(rngs.params(), (num_patches, cfg.vit_width)))
    elif cfg.posemb != "sincos2d":  # sincos2d: fixed, computed in __call__ (big_vision's)
      raise ValueError(f"config.model.posemb={cfg.posemb!r} is not 'learn' or 'sincos2d'")
    for i in range(cfg.vit_depth):
      setattr(self, f"block_{i}",
              ViTBlock(cfg.vit_width, cfg.num_heads, cfg.mlp_ratio, rngs=rngs))
    self.depth = cfg.vit_depth
    self.norm = nnx.LayerNorm(cfg.vit_width, rngs=rngs)
    self.head = nnx.Linear(cfg.vit_width, cfg.width, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    """``uint8 [B, H, W, 3]`` -> ``[B, P, width]``."""
    x = images.astype(jnp.float32) / 127.5 - 1.0
    x = self.embedding(x)
    side = x.shape[1]
    pos = (self.pos_embedding[...] if self.posemb == "learn"
           else posemb_sincos_2d(side, side, x.shape[-1]))
    x = x.reshape(x.shape[0], -1, x.shape[-1]) + pos
    for i in range(self.depth):
      x = getattr(self, f"block_{i}")(x)
    return self.head(self.norm(x))


class FlowVLA(nnx.Module):
  """The network. Call sites: :meth:`encode_prefix` once, :meth:`velocity` per step."""

  def __init__(self, cfg: FlowVLAConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.img = ViT(cfg, rngs=rngs)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.width, rngs=rngs)
    for i in range(cfg.depth):
      setattr(self, f"prefix_{i}",
              DecoderLayer(cfg.width, cfg.num_heads, cfg.head_dim, cfg.mlp_ratio, rngs=rngs))
      setattr(self, f"expert_{i}",
              DecoderLayer(cfg.expert_width, cfg.num_heads, cfg.head_dim, cfg.mlp_ratio,
                           rngs=rngs))
    self.prefix_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
    self.expert_norm = nnx.RMSNorm(cfg.expert_width, rngs=rngs)
    ew = cfg.expert_width
    self.state_proj = nnx.Linear(cfg.state_dim, ew, rngs=rngs)
    self.action_in = nnx.Linear(cfg.action_dim, ew, rngs=rngs)
    self.time_mlp_in = nnx.Linear(2 * ew, ew, rngs=rngs)
    self.time_mlp_out = nnx.Linear(ew, ew, rngs=rngs)
    self.action_out = nnx.Linear(ew, cfg.action_dim, rngs=rngs)
    self.std_out = nnx.Linear(ew, cfg.action_dim, rngs=rngs)
    self.value_hidden = nnx.Linear(cfg.width, cfg.value_hidden, rngs=rngs)
    self.value_out = nnx.Linear(cfg.value_hidden, 1, rngs=rngs)

  # ----------------------------------------------------------------- prefix --
  def encode_prefix(self, images: jax.Array, tokens: jax.Array, token_mask: jax.Array):
    """Runs the decoder over ``[image tokens, instruction tokens]``.

    Args:
      images: ``uint8 [B, N_cam, H, W, 3]``.
      tokens: ``int32 [B, L]``; token_mask ``bool [B, L]``.

    Returns:
      dict with ``hidden`` ``[B, T, width]``, ``mask`` ``[B, T]``, ``kv`` (per layer
      ``(k, v)`` each ``[B, T, N, D]``) and ``next_pos`` ``[B]``.
    """
    b = images.shape[0]
    img_tokens = [self.img(images[:, c]) for c in range(images.shape[1])]
    text = self.embed(tokens) * math.sqrt(self.cfg.width)
    x = jnp.concatenate(img_tokens + [text], axis=1)
    img_mask = jnp.ones((b, sum(t.shape[1] for t in img_tokens)), bool)
    mask = jnp.concatenate([img_mask, token_mask], axis=1)
    positions = jnp.cumsum(mask, axis=1) - 1
    attn_mask = mask[:, None, :] & mask[:, :, None]
    kv = []
    for i in range(self.cfg.depth):
      layer = getattr(self, f"prefix_{i}")
      q, k, v = layer.qkv(x, positions)
      kv.append((k, v))
      x = layer.finish(x, attend(q, k, v, attn_mask))
    return dict(hidden=self.prefix_norm(x), mask=mask, kv=kv,
                next_pos=positions[:, -1] + 1)

  def value(self, prefix: dict) -> jax.Array:
    """Value from the masked mean of prefix tokens: ``[B]``."""
    m = prefix["mask"][..., None].astype(jnp.float32)
    pooled = (prefix["hidden"] * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
    return self.value_out(jax.nn.gelu(self.value_hidden(pooled)))[:, 0]

  # ----------------------------------------------------------------- suffix --
  def velocity(self, prefix: dict, state: jax.Array, x_t: jax.Array,
               t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Expert pass for one denoise step.

    Args:
      prefix: output of :meth:`encode_prefix` (its KV cache is reused).
      state: ``[B, S]``; x_t: noisy chunk ``[B, H, A]``; t: ``[B]``.

    Returns:
      velocity ``[B, H, A]`` and the bounded std head ``[B, H, A]``.
    """
    cfg = self.cfg
    b, horizon = x_t.shape[:2]
    time_emb = posemb_sincos(t, cfg.expert_width)
    act = self.action_in(x_t)
    act = jnp.concatenate([act, jnp.broadcast_to(time_emb[:, None], act.shape)], axis=-1)
    act = self.time_mlp_out(nnx.swish(self.time_mlp_in(act)))
    x = jnp.concatenate([self.state_proj(state)[:, None], act], axis=1)  # [B, 1 + H, ew]
    positions = prefix["next_pos"][:, None] + jnp.arange(1 + horizon)[None]
    # pi0's suffix mask: the state token sees the prefix and itself; action
    # tokens see the prefix, the state and every action token.
    suffix_mask = jnp.ones((1 + horizon, 1 + horizon), bool).at[0, 1:].set(False)
    mask = jnp.concatenate([
        jnp.broadcast_to(prefix["mask"][:, None, :], (b, 1 + horizon, prefix["mask"].shape[1])),
        jnp.broadcast_to(suffix_mask[None], (b, 1 + horizon, 1 + horizon))], axis=-1)
    for i in range(cfg.depth):
      layer = getattr(self, f"expert_{i}")
      q, k, v = layer.qkv(x, positions)
      k_all = jnp.concatenate([prefix["kv"][i][0], k], axis=1)
      v_all = jnp.concatenate([prefix["kv"][i][1], v], axis=1)
      x = layer.finish(x, attend(q, k_all, v_all, mask))
    out = self.expert_norm(x[:, 1:])
    unit = jax.nn.sigmoid(self.std_out(out))
    std = cfg.noise_std_min + (cfg.noise_std_max - cfg.noise_std_min) * unit
    return self.action_out(out), std
