"""SigLIP-style ViT image encoder with openpi's parameter tree (``PaliGemma/img``).

Tree (``L`` = depth, scanned): ``embedding/{kernel [p, p, 3, W], bias}``,
``pos_embedding [1, P, W]`` (learned posemb only), ``Transformer/encoderblock/
{LayerNorm_0, MultiHeadDotProductAttention_0/{query,key,value,out}, LayerNorm_1,
MlpBlock_0/{Dense_0, Dense_1}}`` with a leading ``[L]`` axis,
``Transformer/encoder_norm`` and ``head`` (projection to the decoder width).
The full size is So400m/14: width 1152, depth 27, MLP 4304, 16 heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxvla.models import layers


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
  width: int
  depth: int
  mlp_dim: int
  num_heads: int
  patch_size: int
  posemb: str = "learn"  # 'learn' (SigLIP / openpi) or 'sincos2d' (fixed, no parameter)


VARIANTS = {
    "So400m/14": SiglipConfig(width=1152, depth=27, mlp_dim=4304, num_heads=16, patch_size=14),
}


def build(cfg: SiglipConfig, rngs: nnx.Rngs, *, image_size: int, out_width: int) -> layers.Node:
  """The ``PaliGemma/img`` parameter tree for ``image_size``-pixel square images."""
  if image_size % cfg.patch_size:
    raise ValueError(f"image size {image_size} is not a multiple of the ViT patch size "
                     f"{cfg.patch_size}")
  if cfg.posemb not in ("learn", "sincos2d"):
    raise ValueError(f"ViT posemb {cfg.posemb!r} is not 'learn' or 'sincos2d'")
  w, p, L = cfg.width, cfg.patch_size, (cfg.depth,)
  heads, head_dim = cfg.num_heads, cfg.width // cfg.num_heads
  qkv_init = layers.lecun(in_axis=-3, out_axis=(-2, -1), batch_axis=(0,))

  def qkv():
    return layers.Node(
        kernel=layers.param(rngs, qkv_init, (*L, w, heads, head_dim),
                            ("layers", "embed", "heads", "head_dim")),
        bias=layers.param(rngs, layers.zeros, (*L, heads, head_dim),
                          ("layers", "heads", "head_dim")))

  attention = layers.Node(
      query=qkv(), key=qkv(), value=qkv(),
      out=layers.Node(
          kernel=layers.param(rngs, layers.lecun(in_axis=(-3, -2), out_axis=-1, batch_axis=(0,)),
                              (*L, heads, head_dim, w), ("layers", "heads", "head_dim", "embed")),
          bias=layers.param(rngs, layers.zeros, (*L, w), ("layers", "embed"))))
  block = layers.Node(
      LayerNorm_0=layers.layer_norm_params(rngs, w, stack=L),
      MultiHeadDotProductAttention_0=attention,
      LayerNorm_1=layers.layer_norm_params(rngs, w, stack=L),
      MlpBlock_0=layers.Node(
          Dense_0=layers.dense(rngs, w, cfg.mlp_dim, ("embed", "mlp"), stack=L),
          Dense_1=layers.dense(rngs, cfg.mlp_dim, w, ("mlp", "embed"), stack=L)))
  children = dict(
      embedding=layers.Node(
          kernel=layers.param(rngs, layers.lecun(in_axis=(0, 1, 2), out_axis=-1), (p, p, 3, w),
                              (None, None, "channels", "embed")),
          bias=layers.param(rngs, layers.zeros, (w,), ("embed",))),
      Transformer=layers.Node(encoderblock=block,
                              encoder_norm=layers.layer_norm_params(rngs, w)),
      head=layers.dense(rngs, w, out_width, ("embed", "embed")))
  if cfg.posemb == "learn":
    num_patches = (image_size // p) ** 2
    children["pos_embedding"] = layers.param(
        rngs, jax.nn.initializers.normal(stddev=w ** -0.5), (1, num_patches, w),
        (None, "patch", "embed"))
  return layers.Node(**children)


def _block(p: dict, x: jax.Array, num_heads: int) -> jax.Array:
  """One encoder block on ``x [B, P, W]`` (pre-norm attention and GELU MLP)."""
  dtype = x.dtype
  a = p["MultiHeadDotProductAttention_0"]
  h = layers.layer_norm(p["LayerNorm_0"], x)
  proj = lambda q: (jnp.einsum("bpd,dnh->bpnh", h, q["kernel"].astype(dtype))
                    + q["bias"].astype(dtype))
  q, k, v = proj(a["query"]), proj(a["key"]), proj(a["value"])
  logits = jnp.einsum("bpnh,bsnh->bnps", q, k, preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits * q.shape[-1] ** -0.5, axis=-1).astype(dtype)
  y = jnp.einsum("bnps,bsnh->bpnh", probs, v)
  x = x + jnp.einsum("bpnh,nhd->bpd", y, a["out"]["kernel"].astype(dtype)) + a["out"]["bias"].astype(dtype)
  m = p["MlpBlock_0"]
  h = layers.layer_norm(p["LayerNorm_1"], x)
  h = jax.nn.gelu(layers.apply_dense(m["Dense_0"], h))
  return x + layers.apply_dense(m["Dense_1"], h)


def encode(cfg: SiglipConfig, p: dict, images: jax.Array, *, dtype=jnp.float32,
           remat: bool = False) -> jax.Array:
  """Image tokens ``[B, P, out_width]`` of ``images`` ``float [B, H, W, 3]`` in [-1, 1]."""
  e = p["embedding"]
  x = jax.lax.conv_general_dilated(
      images.astype(dtype), e["kernel"].astype(dtype), (cfg.patch_size,) * 2, "VALID",
      dimension_numbers=("NHWC", "HWIO", "NHWC")) + e["bias"].astype(dtype)
  b, gh, gw, w = x.shape
  if cfg.posemb == "learn":
    pos = p["pos_embedding"]
    if pos.shape[1] != gh * gw:
      raise ValueError(f"images give {gh * gw} patches but the learned position embedding "
                       f"has {pos.shape[1]} (wrong model.image_size?)")
  else:
    pos = layers.posemb_sincos_2d(gh, gw, w)[None]
  x = x.reshape(b, gh * gw, w) + pos.astype(dtype)
  body = lambda h, lp: (_block(lp, h, cfg.num_heads), None)
  if remat:
    body = jax.checkpoint(body, prevent_cse=False)
  x, _ = jax.lax.scan(body, x, p["Transformer"]["encoderblock"])
  x = layers.layer_norm(p["Transformer"]["encoder_norm"], x)
  return layers.apply_dense(p["head"], x)
