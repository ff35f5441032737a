"""Gemma-style decoder with a mixture of experts per token group (openpi's ``PaliGemma/llm``).

pi0 runs two weight sets ("experts") in one transformer: expert 0 (the PaliGemma
language model) over the prefix ``[image tokens, language tokens]`` and expert 1
(the action expert) over the suffix. They share every attention: queries, keys
and values of all groups are concatenated, so the suffix attends to the prefix.
Each expert has its own projections, norms and MLP; the depth, head count,
key/value head count and head size are shared.

Tree, as openpi's (``L`` = depth, expert ``i > 0`` names carry ``_i``):
``embedder/input_embedding [V, D0]``; ``layers/attn/{q_einsum [L, N, D, H],
kv_einsum [L, 2, K, D, H], attn_vec_einsum [L, N, H, D]}/w``;
``layers/{pre_attention_norm, pre_ffw_norm}/scale [L, D]`` (RMSNorm applied as
``1 + scale``) or, for an expert with adaptive RMSNorm (pi0.5's action expert),
``.../Dense_0/{kernel [L, D, 3D], bias}`` producing scale, shift and a residual
gate from a conditioning vector; ``layers/mlp/{gating_einsum [L, 2, D, F],
linear [L, F, D]}`` (GeGLU); ``final_norm/...``. An expert with LoRA
(``GemmaConfig.lora``) also holds openpi's adapters next to its attention and MLP
weights (:mod:`jaxvla.models.lora`).

:func:`forward` takes the token groups as a list (``None`` for a group not run),
an attention mask, and optionally a key/value cache from an earlier call: a
prefix pass returns the cache, and each denoise step runs the suffix alone
against it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxvla.models import layers, lora as lora_lib


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  width: int
  depth: int
  mlp_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  lora: lora_lib.LoraConfig | None = None  # adapters on attention and MLP (openpi's *_lora)


VARIANTS = {
    "gemma_2b": GemmaConfig(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1,
                            head_dim=256),
    "gemma_300m": GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1,
                              head_dim=256),
}

KVCache = tuple[jax.Array, jax.Array]  # k, v: [L, B, S, K, H]


def _name(name: str, expert: int) -> str:
  return name if expert == 0 else f"{name}_{expert}"


def _norm_params(rngs: nnx.Rngs, width: int, stack: tuple[int, ...], adarms: bool) -> layers.Node:
  lead = ("layers",) * len(stack)
  if not adarms:
    return layers.Node(scale=layers.param(rngs, layers.zeros, (*stack, width), lead + ("embed",)))
  # Zero-initialised modulation (openpi's): scale = shift = gate = 0 at init.
  return layers.Node(Dense_0=layers.dense(rngs, width, 3 * width, ("embed", "mlp"), stack=stack,
                                          kernel_init=layers.zeros))


def build(cfgs: Sequence[GemmaConfig], rngs: nnx.Rngs, *, vocab_size: int,
          adarms: Sequence[bool]) -> layers.Node:
  """The ``PaliGemma/llm`` tree for experts ``cfgs`` (the embedder is expert 0's)."""
  base = cfgs[0]
  for c in cfgs[1:]:
    if (c.depth, c.num_heads, c.num_kv_heads, c.head_dim) != (
        base.depth, base.num_heads, base.num_kv_heads, base.head_dim):
      raise ValueError("every expert must share depth, heads, kv heads and head_dim; got "
                       f"{cfgs}")
  L = (base.depth,)
  attn, blocks, finals = {}, {}, {}
  for i, c in enumerate(cfgs):

    def weight(init, shape, axes, c=c):
      """``w`` and, with LoRA, openpi's ``lora_a`` / ``lora_b`` next to it."""
      node = dict(w=layers.param(rngs, init, shape, axes))
      if c.lora is not None:
        node["lora_a"], node["lora_b"] = lora_lib.adapter_params(rngs, shape, axes, c.lora)
      return layers.Node(**node)

    attn[_name("q_einsum", i)] = weight(
        layers.lecun(in_axis=-2, out_axis=-1, batch_axis=(0, 1)),
        (*L, c.num_heads, c.width, c.head_dim), ("layers", "heads", "embed", "head_dim"))
    attn[_name("kv_einsum", i)] = weight(
        layers.lecun(in_axis=-2, out_axis=-1, batch_axis=(0, 1, 2)),
        (*L, 2, c.num_kv_heads, c.width, c.head_dim),
        ("layers", None, "kv_heads", "embed", "head_dim"))
    attn[_name("attn_vec_einsum", i)] = weight(
        layers.lecun(in_axis=(-3, -2), out_axis=-1, batch_axis=(0,)),
        (*L, c.num_heads, c.head_dim, c.width), ("layers", "heads", "head_dim", "embed"))
    blocks[_name("pre_attention_norm", i)] = _norm_params(rngs, c.width, L, adarms[i])
    blocks[_name("pre_ffw_norm", i)] = _norm_params(rngs, c.width, L, adarms[i])
    mlp_shapes = dict(
        gating_einsum=((*L, 2, c.width, c.mlp_dim), ("layers", None, "embed", "mlp")),
        linear=((*L, c.mlp_dim, c.width), ("layers", "mlp", "embed")))
    mlp = dict(
        gating_einsum=layers.param(rngs, layers.lecun(in_axis=-2, out_axis=-1, batch_axis=(0, 1)),
                                   *mlp_shapes["gating_einsum"]),
        linear=layers.param(rngs, layers.lecun(batch_axis=(0,)), *mlp_shapes["linear"]))
    if c.lora is not None:  # openpi's FeedForward names them <weight>_lora_{a,b}
      for w, (shape, axes) in mlp_shapes.items():
        mlp[f"{w}_lora_a"], mlp[f"{w}_lora_b"] = lora_lib.adapter_params(rngs, shape, axes, c.lora)
    blocks[_name("mlp", i)] = layers.Node(**mlp)
    finals[_name("final_norm", i)] = _norm_params(rngs, c.width, (), adarms[i])
  # Embeddings start at unit scale after the sqrt(width) multiplier, so language
  # tokens are as loud as image tokens when training from scratch.
  return layers.Node(
      embedder=layers.Node(input_embedding=layers.param(
          rngs, jax.nn.initializers.normal(base.width ** -0.5), (vocab_size, base.width),
          ("vocab", "embed"))),
      layers=layers.Node(attn=layers.Node(**attn), **blocks),
      **finals)


# ------------------------------------------------------------------ forward --
def embed(p: dict, tokens: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Token embeddings ``[B, T, D0]`` of ``tokens int [B, T]``, scaled by ``sqrt(D0)``."""
  table = p["embedder"]["input_embedding"]
  return (table[tokens] * jnp.sqrt(float(table.shape[1]))).astype(dtype)


def decode(p: dict, x: jax.Array) -> jax.Array:
  """Logits ``float32 [..., V]`` of hidden states ``x [..., D0]`` (tied embedding)."""
  table = p["embedder"]["input_embedding"]
  return jnp.dot(x.astype(jnp.float32), table.T.astype(jnp.float32))


def rms_norm(p: dict, x: jax.Array, cond: jax.Array | None):
  """Gemma RMSNorm (``1 + scale``) or adaptive RMSNorm from ``cond [B, D]``.

  Returns the normalised ``x`` and the residual gate (``None`` without ``cond``).
  """
  var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
  normed = x.astype(jnp.float32) * jax.lax.rsqrt(var + 1e-6)
  if "scale" in p:
    if cond is not None:
      raise ValueError("a conditioning vector was given to a plain RMSNorm")
    return (normed * (1.0 + p["scale"])).astype(x.dtype), None
  if cond is None:
    raise ValueError("an adaptive RMSNorm needs its conditioning vector")
  mod = layers.apply_dense(p["Dense_0"], cond, jnp.float32)[:, None, :]
  scale, shift, gate = jnp.split(mod, 3, axis=-1)
  return (normed * (1.0 + scale) + shift).astype(x.dtype), gate.astype(x.dtype)


def _residual(x, y, gate):
  return x + y if gate is None else x + y * gate


def _mlp(m: dict, h: jax.Array, lora: lora_lib.LoraConfig | None, dtype) -> jax.Array:
  """openpi's (``lora.``)``FeedForward``: GeGLU of ``h [B, T, D]`` -> ``[B, T, D]``."""

  def weights(name: str, part: int | None = None):
    """``(w, lora_a, lora_b)`` of one matmul (``part`` 0: gate, 1: up of ``gating_einsum``)."""
    pick = (lambda x: x) if part is None else (lambda x: x[part])
    if lora is None:
      return pick(m[name]), None, None
    return pick(m[name]), pick(m[f"{name}_lora_a"]), pick(m[f"{name}_lora_b"])

  gate = lora_lib.dot(h, *weights("gating_einsum", 0), dtype)
  up = lora_lib.dot(h, *weights("gating_einsum", 1), dtype)
  return lora_lib.dot(jax.nn.gelu(gate) * up, *weights("linear"), dtype)


def _layer(cfgs: Sequence[GemmaConfig], lp: dict, xs: list, positions: jax.Array,
           mask: jax.Array, cache: KVCache | None, conds: Sequence, dtype):
  """One decoder layer over the token groups ``xs`` (each ``[B, T_i, D_i]`` or None)."""
  a = lp["attn"]
  qs, ks, vs, gates = [], [], [], []
  for i, x in enumerate(xs):
    if x is None:
      gates.append(None)
      continue
    h, gate = rms_norm(lp[_name("pre_attention_norm", i)], x, conds[i])
    gates.append(gate)
    qs.append(lora_lib.einsum(lora_lib.ATTN_EQNS["q_einsum"], h, a[_name("q_einsum", i)],
                              cfgs[i].lora, dtype))
    k, v = lora_lib.einsum(lora_lib.ATTN_EQNS["kv_einsum"], h, a[_name("kv_einsum", i)],
                           cfgs[i].lora, dtype)
    ks.append(k)
    vs.append(v)
  c0 = cfgs[0]
  q = layers.rope(jnp.concatenate(qs, 1), positions) * jnp.asarray(c0.head_dim ** -0.5, dtype)
  k = layers.rope(jnp.concatenate(ks, 1), positions)
  v = jnp.concatenate(vs, 1)
  if cache is not None:
    k = jnp.concatenate([cache[0].astype(dtype), k], axis=1)
    v = jnp.concatenate([cache[1].astype(dtype), v], axis=1)
  b, t = q.shape[:2]
  q = q.reshape(b, t, c0.num_kv_heads, c0.num_heads // c0.num_kv_heads, c0.head_dim)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
  if mask.shape != (b, t, k.shape[1]):
    raise ValueError(f"attention mask {mask.shape} does not match queries {t} / keys "
                     f"{k.shape[1]} (batch {b})")
  logits = jnp.where(mask[:, None, None], logits, -2.3819763e38)
  probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
  enc = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, c0.num_heads, c0.head_dim)
  out, start = [], 0
  for i, x in enumerate(xs):
    if x is None:
      out.append(None)
      continue
    end = start + x.shape[1]
    y = lora_lib.einsum(lora_lib.ATTN_EQNS["attn_vec_einsum"], enc[:, start:end],
                        a[_name("attn_vec_einsum", i)], cfgs[i].lora, dtype)
    start = end
    x = _residual(x, y, gates[i])
    h, gate = rms_norm(lp[_name("pre_ffw_norm", i)], x, conds[i])
    y = _mlp(lp[_name("mlp", i)], h, cfgs[i].lora, dtype)
    out.append(_residual(x, y, gate))
  return out, (k, v)


def forward(cfgs: Sequence[GemmaConfig], p: dict, xs: Sequence[jax.Array | None], *,
            positions: jax.Array, mask: jax.Array, kv_cache: KVCache | None = None,
            adarms_cond: Sequence[jax.Array | None] | None = None, dtype=jnp.float32,
            remat: bool = False) -> tuple[list, KVCache]:
  """Runs the decoder over token groups ``xs`` (expert ``i`` on ``xs[i]``).

  Args:
    xs: per expert ``[B, T_i, D_i]`` or ``None``; run groups are concatenated.
    positions: ``int [B, T]`` RoPE positions of the concatenated run tokens.
    mask: ``bool [B, T, S]`` which keys each query sees; ``S`` = cache length + ``T``.
    kv_cache: keys/values ``[L, B, S_c, K, H]`` of earlier tokens (the prefix).
    adarms_cond: per expert ``[B, D_i]`` conditioning for adaptive-RMSNorm experts.
    remat: recompute each layer in the backward pass instead of storing activations.

  Returns:
    the final-normed outputs per expert (``None`` where not run) and the keys /
    values ``[L, B, S, K, H]`` of every token the queries saw.
  """
  conds = list(adarms_cond) if adarms_cond is not None else [None] * len(cfgs)
  xs = [None if x is None else x.astype(dtype) for x in xs]

  def body(carry, inputs):
    lp, cache = inputs
    return _layer(cfgs, lp, carry, positions, mask, cache, conds, dtype)

  if remat:
    body = jax.checkpoint(body, prevent_cse=False,
                          policy=jax.checkpoint_policies.nothing_saveable)
  xs, kv = jax.lax.scan(body, xs, (p["layers"], kv_cache))
  outs = [None if x is None else rms_norm(p[_name("final_norm", i)], x, conds[i])[0]
          for i, x in enumerate(xs)]
  return outs, kv
