"""OpenVLA-style action-token VLA: the network, its action discretisation, KV-cached decoding
and the teacher-forced pass, and :class:`ActionTokenPolicy` (the policy contract of
:mod:`jaxvla.models.policy`, so PPO / GRPO use it unchanged).

Network: a SigLIP ViT turns each camera image into tokens and ONE Gemma decoder (PaliGemma's
language model, expert 0 only) runs over ``[image tokens, language tokens | <bos>, action
tokens]``. The prefix (images + language) is bidirectional, as pi0's; ``<bos>`` (the
tokenizer's bos embedding, the start-of-action token) and the action tokens are causal, each
seeing the prefix and every earlier action token. The output at ``<bos>`` predicts action token
1, the output at action token j predicts token j + 1.

Actions: each of the env's A action dims in [-1, 1] is cut into ``config.model.num_bins``
uniform bins; bin k's centre ``-1 + (2k + 1) / num_bins`` is the executed value. A chunk of H
actions is H * A tokens emitted in (h, a) order. As in OpenVLA, bin k is the token id
``vocab_size - num_bins + k`` (the last ``num_bins`` rows of the tied embedding table).

Next-token distribution: a categorical over the bin tokens only. The decoder's logits
(``gemma.decode``, tied embedding) are restricted to the bin ids and log-softmaxed over those
ids alone, so the other vocabulary entries get no probability mass (computed by decoding
against the bin rows of the table only, which equals slicing the full logits).

Tree: ``PaliGemma/{img, llm}`` with openpi's keys (so PaliGemma weights from an openpi
checkpoint load) plus ``rl/{value_hidden, value_out}``, the value head on the masked mean of
the decoder's prefix outputs (pi0's 'prefix' value source). Per-camera image masks work as
pi0's (:func:`jaxvla.models.pi0.image_token_mask`): a masked camera is invisible. Variants ``tiny`` / ``small`` /
``full`` reuse the LLM and ViT of :data:`jaxvla.models.pi0.VARIANTS` (full: PaliGemma 2B +
So400m/14, vocabulary 257152).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxvla.envs import protocol
from jaxvla.models import contract, gemma, layers, pi0, siglip
from jaxvla.models import tokenizer as tokenizer_lib

MODES = ("train", "eval")  # act(): 'train' samples (temperature 1), 'eval' is greedy.
# PaliGemma's SentencePiece vocabulary: 256000 Gemma text pieces, then 1024 <locXXXX> and 128
# <segXXX> tokens that instruction text never produces; action bins may reuse that tail.
PALIGEMMA_TEXT_VOCAB_SIZE = 256_000


def _text_vocab_size(tok: tokenizer_lib.Tokenizer) -> int:
  """Ids ``[0, n)`` the tokenizer can emit for an instruction (action bins must lie above)."""
  if isinstance(tok, tokenizer_lib.PaligemmaTokenizer):
    return min(tok.vocab_size, PALIGEMMA_TEXT_VOCAB_SIZE)
  return tok.vocab_size


@dataclasses.dataclass(frozen=True)
class ActionTokenConfig:
  """Static structure of one action-token network (derived once from ``config.model``)."""
  llm: gemma.GemmaConfig
  vit: siglip.SiglipConfig
  image_size: int
  num_cameras: int
  action_dim: int
  chunk_len: int
  num_bins: int
  vocab_size: int
  bos_id: int
  dtype: str
  remat: bool
  value_hidden: int
  value_detach: bool = False  # as pi0.Pi0Config.value_detach

  @classmethod
  def from_config(cls, model: ml_collections.ConfigDict, *, image_size: int, num_cameras: int,
                  action_dim: int, tok: tokenizer_lib.Tokenizer) -> "ActionTokenConfig":
    """Resolves ``config.model`` against the env's sizes and the tokenizer; errors name the key."""
    if model.variant not in pi0.VARIANTS:
      raise ValueError(f"config.model.variant={model.variant!r} is not one of "
                       f"{sorted(pi0.VARIANTS)}")
    llm, _, vit = pi0.VARIANTS[model.variant]
    vit = dataclasses.replace(vit, posemb=model.posemb)
    if model.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"config.model.dtype={model.dtype!r} is not 'float32' or 'bfloat16'")
    if model.action_dim not in (0, action_dim):
      raise ValueError(f"config.model.action_dim={model.action_dim}: action_token_vla emits "
                       f"tokens for the env's {action_dim} action dims only; set it to 0 or "
                       f"{action_dim}")
    if model.chunk_len < 1:
      raise ValueError(f"config.model.chunk_len={model.chunk_len} must be >= 1")
    num_bins = int(model.num_bins)
    if num_bins < 2:
      raise ValueError(f"config.model.num_bins={model.num_bins} must be >= 2")
    if model.variant == "full" and model.vocab_size != pi0.PALIGEMMA_VOCAB_SIZE:
      raise ValueError(f"config.model.vocab_size must be {pi0.PALIGEMMA_VOCAB_SIZE} "
                       f"(PaliGemma's) for the full variant, got {model.vocab_size}")
    vocab = model.vocab_size or tok.vocab_size + num_bins
    if vocab < tok.vocab_size:
      raise ValueError(f"config.model.vocab_size={vocab} is smaller than the tokenizer's "
                       f"{tok.vocab_size}")
    text = _text_vocab_size(tok)
    if vocab - num_bins < text:
      raise ValueError(
          f"config.model.vocab_size={vocab} with config.model.num_bins={num_bins} puts the "
          f"action bins at ids [{vocab - num_bins}, {vocab}), overlapping the tokenizer's text "
          f"ids [0, {text}); need vocab_size >= {text + num_bins} (or 0 for the default "
          f"tokenizer vocab + num_bins), or fewer bins")
    return cls(llm=llm, vit=vit, image_size=model.image_size or image_size,
               num_cameras=num_cameras, action_dim=action_dim, chunk_len=model.chunk_len,
               num_bins=num_bins, vocab_size=vocab, bos_id=tok.bos_id, dtype=model.dtype,
               remat=model.remat, value_hidden=model.value_hidden,
               value_detach=model.value_detach)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def bin_offset(self) -> int:
    """Token id of bin 0 (bins are the last ``num_bins`` ids)."""
    return self.vocab_size - self.num_bins

  @property
  def num_tokens(self) -> int:
    """Action tokens per chunk, ``H * A``."""
    return self.chunk_len * self.action_dim


def build(cfg: ActionTokenConfig, rngs: nnx.Rngs) -> layers.Node:
  """The parameter tree: ``PaliGemma/{img, llm}`` (openpi's keys, one expert) and ``rl/``."""
  return layers.Node(
      PaliGemma=layers.Node(
          img=siglip.build(cfg.vit, rngs, image_size=cfg.image_size, out_width=cfg.llm.width),
          llm=gemma.build([cfg.llm], rngs, vocab_size=cfg.vocab_size, adarms=[False])),
      rl=layers.Node(
          value_hidden=layers.dense(rngs, cfg.llm.width, cfg.value_hidden, ("embed", "mlp")),
          value_out=layers.dense(rngs, cfg.value_hidden, 1, ("mlp", None))))


# ------------------------------------------------------------ discretisation --
def discretize(actions: jax.Array, num_bins: int) -> jax.Array:
  """``float [...]`` actions -> ``int32 [...]`` uniform-bin indices over [-1, 1] (clipped)."""
  idx = jnp.floor((actions.astype(jnp.float32) + 1.0) * (0.5 * num_bins))
  return jnp.clip(idx, 0, num_bins - 1).astype(jnp.int32)


def bin_centers(indices: jax.Array, num_bins: int) -> jax.Array:
  """``int [...]`` bin indices -> ``float32 [...]`` bin centres ``-1 + (2k + 1) / num_bins``."""
  return -1.0 + (2.0 * indices.astype(jnp.float32) + 1.0) / num_bins


# ------------------------------------------------------------------ network --
def bin_log_probs(cfg: ActionTokenConfig, p: dict, hidden: jax.Array) -> jax.Array:
  """Next-token log-probs ``float32 [..., num_bins]`` from decoder outputs ``[..., D]``.

  ``gemma.decode`` restricted to the bin tokens (the last ``num_bins`` rows of the tied
  embedding), then log_softmax over the bins only: a categorical over the action bins.
  """
  table = p["PaliGemma"]["llm"]["embedder"]["input_embedding"][cfg.bin_offset:]
  logits = gemma.decode({"embedder": {"input_embedding": table}}, hidden)
  return jax.nn.log_softmax(logits, axis=-1)


def value(cfg: ActionTokenConfig, p: dict, prefix_hidden: jax.Array,
          prefix_mask: jax.Array) -> jax.Array:
  """State value ``[B]`` from the masked mean of prefix outputs ``[B, P, D]`` (mask ``[B, P]``)."""
  m = prefix_mask[..., None].astype(jnp.float32)
  pooled = (prefix_hidden.astype(jnp.float32) * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
  if cfg.value_detach:
    pooled = jax.lax.stop_gradient(pooled)
  h = jax.nn.gelu(layers.apply_dense(p["rl"]["value_hidden"], pooled))
  return layers.apply_dense(p["rl"]["value_out"], h)[:, 0]


def encode_prefix(cfg: ActionTokenConfig, p: dict, images: jax.Array, tokens: jax.Array,
                  token_mask: jax.Array,
                  image_mask: jax.Array) -> tuple[jax.Array, jax.Array, gemma.KVCache]:
  """The bidirectional prefix pass: hidden ``[B, P, D]``, mask ``[B, P]``, KV ``[L, B, P, K, H]``."""
  x, mask = pi0.embed_prefix(cfg, p, images, tokens, token_mask, image_mask)
  attn = layers.prefix_lm_mask(mask, jnp.zeros(mask.shape[1], jnp.int32))
  (hidden,), kv = gemma.forward([cfg.llm], p["PaliGemma"]["llm"], [x],
                                positions=jnp.cumsum(mask, axis=1) - 1, mask=attn,
                                dtype=cfg.compute_dtype, remat=cfg.remat)
  return hidden, mask, kv


def decode(cfg: ActionTokenConfig, p: dict, images: jax.Array, tokens: jax.Array,
           token_mask: jax.Array, image_mask: jax.Array, rng: jax.Array, *, greedy: bool):
  """Autoregressive decoding of one chunk with a KV cache (jittable, static shapes).

  One prefix pass fills the cache; then ``H * A`` single-token steps (``lax.scan``) run
  against a pre-allocated buffer of ``P + H * A`` keys/values: step t's own token is
  appended by ``gemma.forward`` (so it sees ``P + 1 + H * A`` keys, the unwritten ones masked
  out) and its key/value are written at ``P + t`` with ``dynamic_update_slice``.

  Args:
    image_mask: ``bool [B, N_cam]`` (see :func:`jaxvla.models.pi0.embed_prefix`).
    greedy: argmax of each categorical, else sample it (temperature 1).

  Returns:
    action tokens ``int32 [B, H * A]`` (bin indices), their full bin log-probs
    ``float32 [B, H * A, num_bins]``, prefix hidden ``[B, P, D]`` and mask ``[B, P]``.
  """
  llm = p["PaliGemma"]["llm"]
  dtype = cfg.compute_dtype
  hidden, mask, (k, v) = encode_prefix(cfg, p, images, tokens, token_mask, image_mask)
  b, num_prefix = mask.shape
  n = cfg.num_tokens
  pad = ((0, 0), (0, 0), (0, n), (0, 0), (0, 0))
  k_buf, v_buf = jnp.pad(k, pad), jnp.pad(v, pad)  # [L, B, P + n, K, H]
  start = mask.sum(axis=1)  # RoPE position of <bos>, [B]
  slots = jnp.arange(n)

  def step(carry, inputs):
    k_buf, v_buf, x = carry
    t, key = inputs
    seen = jnp.concatenate([mask, jnp.broadcast_to(slots < t, (b, n)),
                            jnp.ones((b, 1), bool)], axis=1)[:, None, :]
    (out,), (k_all, v_all) = gemma.forward(
        [cfg.llm], llm, [x], positions=(start + t)[:, None], mask=seen, kv_cache=(k_buf, v_buf),
        dtype=dtype)
    logp = bin_log_probs(cfg, p, out[:, 0])  # [B, num_bins]
    tok = (jnp.argmax(logp, axis=-1) if greedy
           else jax.random.categorical(key, logp, axis=-1)).astype(jnp.int32)
    write = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(
        buf, new[:, :, -1:].astype(buf.dtype), num_prefix + t, axis=2)
    x = gemma.embed(llm, (cfg.bin_offset + tok)[:, None], dtype)
    return (write(k_buf, k_all), write(v_buf, v_all), x), (tok, logp)

  x0 = gemma.embed(llm, jnp.full((b, 1), cfg.bos_id, jnp.int32), dtype)
  _, (toks, logps) = jax.lax.scan(step, (k_buf, v_buf, x0), (slots, jax.random.split(rng, n)))
  return toks.T, logps.transpose(1, 0, 2), hidden, mask


def teacher_forced(cfg: ActionTokenConfig, p: dict, images: jax.Array, tokens: jax.Array,
                   token_mask: jax.Array, image_mask: jax.Array, action_tokens: jax.Array):
  """One uncached pass over ``[prefix, <bos>, action_tokens[:, :-1]]`` (training path).

  Args:
    image_mask: ``bool [B, N_cam]`` (see :func:`jaxvla.models.pi0.embed_prefix`).
    action_tokens: ``int [B, H * A]`` bin indices (not vocabulary ids).

  Returns:
    decoder outputs ``[B, H * A, D]`` that predict each action token, prefix hidden
    ``[B, P, D]`` and prefix mask ``[B, P]`` (the prefix never attends to the actions).
  """
  llm = p["PaliGemma"]["llm"]
  x, mask = pi0.embed_prefix(cfg, p, images, tokens, token_mask, image_mask)
  b, num_prefix = mask.shape
  n = action_tokens.shape[1]
  ids = jnp.concatenate([jnp.full((b, 1), cfg.bos_id, jnp.int32),
                         cfg.bin_offset + action_tokens[:, :-1].astype(jnp.int32)], axis=1)
  suffix = gemma.embed(llm, ids, cfg.compute_dtype)
  full_mask = jnp.concatenate([mask, jnp.ones((b, n), bool)], axis=1)
  ar = jnp.concatenate([jnp.zeros(num_prefix, jnp.int32), jnp.ones(n, jnp.int32)])
  (out,), _ = gemma.forward([cfg.llm], llm, [jnp.concatenate([x, suffix], axis=1)],
                            positions=jnp.cumsum(full_mask, axis=1) - 1,
                            mask=layers.prefix_lm_mask(full_mask, ar),
                            dtype=cfg.compute_dtype, remat=cfg.remat)
  return out[:, num_prefix:], out[:, :num_prefix], mask


# ------------------------------------------------------------------- policy --
class ActionTokenPolicy(layers.TreeOwner):
  """OpenVLA-style action-token VLA (``config.name='action_token_vla'``) for RL.

  The chain stored for PPO is ``[B, 1, H, A]`` float32 bin indices; its log-prob is the sum
  of the H * A token log-probs (also reported for greedy decoding).

  Args:
    config: the ``model`` sub-config.
    spec: the environment's static description.
  """

  tree_builder = staticmethod(build)

  def __init__(self, config: ml_collections.ConfigDict, spec: protocol.EnvSpec):
    self.tokenizer = tokenizer_lib.make_tokenizer(config.tokenizer, config.max_token_len,
                                                  config.tokenizer_path)
    h, w, _ = spec.image_shape
    if h != w:
      raise ValueError(f"action_token_vla expects square images, got {spec.image_shape}")
    self.net = ActionTokenConfig.from_config(
        config, image_size=h, num_cameras=len(spec.camera_names), action_dim=spec.action_dim,
        tok=self.tokenizer)
    self.chunk_len = config.chunk_len
    self.action_dim = spec.action_dim
    self.log_prob_terms = self.chunk_len * self.action_dim
    self.rl_heads_only = False
    self.state_dim = spec.state_dim
    self.num_bins = self.net.num_bins

  # ---------------------------------------------------------------- helpers --
  def prepare(self, obs: protocol.Observation) -> dict[str, np.ndarray]:
    """Observation -> ``images [B, N, H, W, 3]``, ``image_mask [B, N]``, ``state [B, S]``,
    ``tokens/token_mask [B, L]``.

    The prompt is the pi0 format (no state); the state is passed along unused by the network.
    """
    state = obs.state.astype(np.float32)
    if state.shape[-1] != self.state_dim:
      raise ValueError(f"observation state has {state.shape[-1]} dims, the env spec "
                       f"{self.state_dim}")
    tokens, token_mask = self.tokenizer.encode(obs.instruction)
    return dict(images=obs.images, image_mask=obs.image_mask, state=state, tokens=tokens,
                token_mask=token_mask)

  def chain_tokens(self, chain: jax.Array) -> jax.Array:
    """Stored chain ``[B, 1, H, A]`` (float bin indices) -> tokens ``int32 [B, H * A]``."""
    idx = jnp.round(chain[:, 0]).astype(jnp.int32)
    return jnp.clip(idx, 0, self.num_bins - 1).reshape(chain.shape[0], -1)

  def token_log_probs(self, params: contract.Params, batch: dict,
                      chain: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced full bin log-probs ``[B, H * A, num_bins]`` of a chain, and value ``[B]``.

    Position j is the distribution of action token j given the prefix and tokens ``< j``;
    :meth:`act` decodes from the same distributions (with a KV cache).
    """
    out, hidden, mask = teacher_forced(self.net, params, batch["images"], batch["tokens"],
                                       batch["token_mask"], contract.image_mask(batch),
                                       self.chain_tokens(chain))
    return bin_log_probs(self.net, params, out), value(self.net, params, hidden, mask)

  def _split(self, logp_all: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-dim log-probs ``[B, H, A]`` of ``tokens [B, H * A]`` and their sum ``[B]``."""
    logp = jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]
    logp = logp.reshape(tokens.shape[0], self.chunk_len, self.action_dim)
    return logp, logp.sum((1, 2))

  # --------------------------------------------------------------- contract --
  def act(self, params: contract.Params, batch: dict, rng: jax.Array,
          mode: str) -> contract.ActOutput:
    """Decodes a chunk: ``mode`` 'train' samples each token, 'eval' takes the argmax."""
    if mode not in MODES:
      raise ValueError(f"action_token_vla act mode {mode!r} is not one of {MODES}")
    tokens, logp_all, hidden, mask = decode(self.net, params, batch["images"], batch["tokens"],
                                            batch["token_mask"], contract.image_mask(batch), rng,
                                            greedy=mode == "eval")
    logp_dims, logp = self._split(logp_all, tokens)
    idx = tokens.reshape(tokens.shape[0], self.chunk_len, self.action_dim)
    return contract.ActOutput(
        actions=bin_centers(idx, self.num_bins), chain=idx[:, None].astype(jnp.float32),
        log_prob=logp, log_prob_dims=logp_dims, value=value(self.net, params, hidden, mask))

  def evaluate(self, params: contract.Params, batch: dict,
               chain: jax.Array) -> contract.Evaluation:
    """Log-prob ``[B]`` of stored chains ``[B, 1, H, A]`` (one teacher-forced pass).

    Entropy ``[B]``: the categorical entropies of the H * A token positions, summed.
    """
    logp_all, v = self.token_log_probs(params, batch, chain)
    logp_dims, logp = self._split(logp_all, self.chain_tokens(chain))
    entropy = -(jnp.exp(logp_all) * logp_all).sum((1, 2))
    return contract.Evaluation(log_prob=logp, log_prob_dims=logp_dims, value=v,
                                 entropy=entropy)

  def value(self, params: contract.Params, batch: dict) -> jax.Array:
    hidden, mask, _ = encode_prefix(self.net, params, batch["images"], batch["tokens"],
                                    batch["token_mask"], contract.image_mask(batch))
    return value(self.net, params, hidden, mask)

  def bc_loss(self, params: contract.Params, batch: dict, actions: jax.Array, rng: jax.Array,
              mask: jax.Array | None = None) -> jax.Array:
    """Cross-entropy (mean per token) of expert chunks ``actions [B, H, A]``, discretised.

    ``mask [B, H]`` (bool, default all True): the mean runs over the real actions' tokens.
    """
    del rng  # Teacher forcing is deterministic.
    tokens = discretize(actions, self.num_bins).reshape(actions.shape[0], -1)  # [B, H * A]
    out, _, _ = teacher_forced(self.net, params, batch["images"], batch["tokens"],
                               batch["token_mask"], contract.image_mask(batch), tokens)
    logp = jnp.take_along_axis(bin_log_probs(self.net, params, out), tokens[..., None], axis=-1)
    if mask is None:
      return -logp.mean()
    weight = jnp.repeat(mask.astype(logp.dtype), actions.shape[-1], axis=1)  # [B, H * A]
    return -(logp[..., 0] * weight).sum() / jnp.maximum(weight.sum(), 1.0)
