"""pi0-FAST (openpi's ``Pi0FAST``, ``openpi/models/pi0_fast.py``): the network with openpi's
parameter tree, its prefix-LM token layout, the next-token loss, KV-cached decoding, the
teacher-forced pass that scores stored token sequences, and :class:`Pi0FastPolicy`, the policy
contract for RL over its variable-length action tokens.

Network: a SigLIP ViT turns each camera image into tokens and ONE Gemma decoder (PaliGemma's,
openpi's ``gemma_fast``) runs over ``[image tokens, prefix tokens | postfix tokens]``
(:mod:`jaxvla.models.fast_prompt` owns the token layout). The prefix is bidirectional, the
postfix causal (openpi's ``make_attn_mask`` with ``ar_mask`` 0 / 1, here
:func:`jaxvla.models.layers.prefix_lm_mask`). Logits come from the tied embedding over the
whole vocabulary; the last valid prefix token predicts postfix token 0.

Tree: ``PaliGemma/{img, llm}`` exactly as openpi's pi0-FAST checkpoints hold it (``gemma_fast``
has the same keys and shapes as expert 0 of :mod:`jaxvla.models.gemma`: ``q_einsum``,
``kv_einsum``, ``attn_vec_einsum``, ``mlp/{gating_einsum, linear}``, the norms, the embedder),
plus ``rl/{value_hidden, value_out}`` (the value head on the masked mean of the prefix
outputs), which is not part of an openpi checkpoint. Variants ``tiny`` / ``small`` / ``full``
take the LLM and ViT of :data:`jaxvla.models.pi0.VARIANTS` (full: Gemma 2B + So400m/14,
vocabulary 257152).

Positions: openpi numbers the valid tokens (``cumsum(mask) - 1``), but its ``sample_actions``
feeds the token sampled at step ``j`` at position ``prefill_len + j + 1``, one more than
``compute_loss`` gives the same token in training. ``model.fast_positions`` chooses what
:func:`decode` and the scoring pass (:meth:`Pi0FastPolicy.evaluate`) use: 'openpi', the
sampling positions, so an openpi checkpoint acts as it does in openpi; 'train', the positions
:meth:`Pi0FastPolicy.bc_loss` trains at (openpi's loss's). Either way RL scores exactly what
was sampled. A small model trained here from scratch decodes far better at the positions it
was trained at (docs/design/policy.md, "π0-FAST").

Actions: the emitted ids become actions on the host (:meth:`FastPrompt.decode_actions`, BPE and
inverse DCT), called from the jitted ``act`` through ``jax.pure_callback``; a malformed row
gives zero actions and is counted in ``Pi0FastPolicy.decode_counts``, never an exception.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx, struct

from jaxvla.envs import protocol
from jaxvla.models import contract, fast_prompt, gemma, layers, lora, pi0, siglip
from jaxvla.models import fast_tokenizer as fast_lib

MODES = ("train", "eval")  # act(): 'train' samples at model.temperature, 'eval' is greedy.
# model.fast_positions -> what decoding adds to an emitted token's training position: openpi's
# sample_actions puts sampled token j at prefill_len + j + 1 (compute_loss: prefill_len + j).
DECODE_OFFSETS = {"openpi": 1, "train": 0}


@dataclasses.dataclass(frozen=True)
class Pi0FastConfig:
  """Static structure of one pi0-FAST network (derived once from ``config.model``)."""
  llm: gemma.GemmaConfig
  vit: siglip.SiglipConfig
  image_size: int
  num_cameras: int
  action_dim: int  # A_net: the FAST chunks' dims (>= the env's)
  chunk_len: int
  vocab_size: int
  max_action_tokens: int  # T: emitted tokens per chunk, at most
  eos_id: int
  temperature: float
  dtype: str
  remat: bool
  value_hidden: int
  value_detach: bool = False
  decode_offset: int = DECODE_OFFSETS["openpi"]  # (model.fast_positions)

  @classmethod
  def from_config(cls, model: ml_collections.ConfigDict, *, image_size: int, num_cameras: int,
                  action_dim: int, vocab_size: int, eos_id: int,
                  min_tokens: int) -> "Pi0FastConfig":
    """Resolves ``config.model`` against the env and the token layout; errors name the key.

    Args:
      vocab_size, eos_id: the layout's (:func:`jaxvla.models.fast_prompt.make_prompt`).
      min_tokens: the shortest postfix the layout can emit.
    """
    if model.variant not in pi0.VARIANTS:
      raise ValueError(f"config.model.variant={model.variant!r} is not one of "
                       f"{sorted(pi0.VARIANTS)}")
    llm, _, vit = pi0.VARIANTS[model.variant]
    if model.lora not in ("none", "llm"):
      raise ValueError(f"config.model.lora={model.lora!r}: pi0_fast has no action expert; use "
                       f"'none' or 'llm'")
    llm = dataclasses.replace(llm, lora=lora.expert_configs(model)[0])
    if model.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"config.model.dtype={model.dtype!r} is not 'float32' or 'bfloat16'")
    if model.chunk_len < 1:
      raise ValueError(f"config.model.chunk_len={model.chunk_len} must be >= 1")
    a_net = model.action_dim or action_dim
    if a_net < action_dim:
      raise ValueError(f"config.model.action_dim={model.action_dim} is smaller than the env's "
                       f"{action_dim}")
    if model.max_action_tokens < min_tokens:
      raise ValueError(f"config.model.max_action_tokens={model.max_action_tokens} is below the "
                       f"shortest action postfix ({min_tokens} tokens)")
    if not model.temperature > 0:
      raise ValueError(f"config.model.temperature={model.temperature} must be > 0")
    if model.fast_positions not in DECODE_OFFSETS:
      raise ValueError(f"config.model.fast_positions={model.fast_positions!r} is not one of "
                       f"{sorted(DECODE_OFFSETS)}")
    if model.variant == "full" and vocab_size != pi0.PALIGEMMA_VOCAB_SIZE:
      raise ValueError(f"config.model.tokenizer: the full variant needs PaliGemma's "
                       f"{pi0.PALIGEMMA_VOCAB_SIZE} ids ('paligemma'), got a vocabulary of "
                       f"{vocab_size}")
    return cls(llm=llm, vit=dataclasses.replace(vit, posemb=model.posemb),
               image_size=model.image_size or image_size, num_cameras=num_cameras,
               action_dim=a_net, chunk_len=model.chunk_len, vocab_size=vocab_size,
               max_action_tokens=model.max_action_tokens, eos_id=eos_id,
               temperature=float(model.temperature), dtype=model.dtype, remat=model.remat,
               value_hidden=model.value_hidden, value_detach=model.value_detach,
               decode_offset=DECODE_OFFSETS[model.fast_positions])

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


def build(cfg: Pi0FastConfig, rngs: nnx.Rngs) -> layers.Node:
  """The parameter tree: ``PaliGemma/{img, llm}`` (openpi's pi0-FAST keys) and ``rl/``."""
  return layers.Node(
      PaliGemma=layers.Node(
          img=siglip.build(cfg.vit, rngs, image_size=cfg.image_size, out_width=cfg.llm.width),
          llm=gemma.build([cfg.llm], rngs, vocab_size=cfg.vocab_size, adarms=[False])),
      rl=layers.Node(
          value_hidden=layers.dense(rngs, cfg.llm.width, cfg.value_hidden, ("embed", "mlp")),
          value_out=layers.dense(rngs, cfg.value_hidden, 1, ("mlp", None))))


# ------------------------------------------------------------------ network --
def encode_prefix(cfg: Pi0FastConfig, p: dict, images: jax.Array, tokens: jax.Array,
                  token_mask: jax.Array,
                  image_mask: jax.Array) -> tuple[jax.Array, jax.Array, gemma.KVCache]:
  """The bidirectional prefix pass: hidden ``[B, P, D]``, mask ``[B, P]``, KV ``[L, B, P, K, H]``."""
  x, mask = pi0.embed_prefix(cfg, p, images, tokens, token_mask, image_mask)
  attn = layers.prefix_lm_mask(mask, jnp.zeros(mask.shape[1], jnp.int32))
  (hidden,), kv = gemma.forward([cfg.llm], p["PaliGemma"]["llm"], [x],
                                positions=jnp.cumsum(mask, axis=1) - 1, mask=attn,
                                dtype=cfg.compute_dtype, remat=cfg.remat)
  return hidden, mask, kv


def last_valid(hidden: jax.Array, mask: jax.Array) -> jax.Array:
  """``[B, D]``: each row's output at its last valid prefix token (``hidden [B, P, D]``)."""
  idx = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)
  return jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]


def value(cfg: Pi0FastConfig, p: dict, hidden: jax.Array, mask: jax.Array) -> jax.Array:
  """State value ``[B]`` from the masked mean of prefix outputs ``[B, P, D]`` (mask ``[B, P]``)."""
  m = mask[..., None].astype(jnp.float32)
  pooled = (hidden.astype(jnp.float32) * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
  return pi0.value_head(p, pooled, cfg.value_detach)


def emitted_mask(tokens: jax.Array, eos_id: int) -> jax.Array:
  """``bool [B, T]``: the tokens up to and including each row's first eos (all if none)."""
  is_eos = (tokens == eos_id).astype(jnp.int32)
  return jnp.cumsum(is_eos, axis=1) - is_eos == 0


@struct.dataclass
class Decoded:
  """:func:`decode`'s output: tokens ``int32 [B, T]`` (0 after the end), their log-probs
  ``float32 [B, T]`` at the temperature (0 after the end), mask ``bool [B, T]``
  (:func:`emitted_mask`), prefix hidden ``[B, P, D]`` and prefix mask ``[B, P]``."""
  tokens: jax.Array
  log_prob: jax.Array
  mask: jax.Array
  hidden: jax.Array
  prefix_mask: jax.Array


def decode(cfg: Pi0FastConfig, p: dict, images: jax.Array, tokens: jax.Array,
           token_mask: jax.Array, image_mask: jax.Array, rng: jax.Array, *,
           greedy: bool) -> Decoded:
  """KV-cached autoregressive decoding of the postfix, up to eos or ``max_action_tokens``.

  One prefix pass fills the cache; then single-token steps (``lax.while_loop``, stopping
  when every row has emitted eos) run against a buffer of ``P + T`` keys/values: step t
  samples token t from the current logits, feeds it (at position ``prefill_len + t + 1``,
  openpi's) and writes its key/value at ``P + t``.

  Args:
    greedy: argmax (openpi's temperature 0), else sample ``softmax(logits / temperature)``.
  """
  llm = p["PaliGemma"]["llm"]
  dtype = cfg.compute_dtype
  hidden, mask, (k, v) = encode_prefix(cfg, p, images, tokens, token_mask, image_mask)
  b, num_prefix = mask.shape
  n = cfg.max_action_tokens
  pad = ((0, 0), (0, 0), (0, n), (0, 0), (0, 0))
  start = mask.sum(axis=1) + cfg.decode_offset  # RoPE position of emitted token 0, [B]
  slots = jnp.arange(n)

  def step(carry):
    t, k_buf, v_buf, logits, out_tokens, out_logp, done = carry
    logp_all = jax.nn.log_softmax(logits / cfg.temperature, axis=-1)
    tok = (jnp.argmax(logits, axis=-1) if greedy
           else jax.random.categorical(jax.random.fold_in(rng, t), logp_all, axis=-1))
    tok = tok.astype(jnp.int32)
    lp = jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]
    out_tokens = out_tokens.at[:, t].set(jnp.where(done, 0, tok))
    out_logp = out_logp.at[:, t].set(jnp.where(done, 0.0, lp))
    done = done | (tok == cfg.eos_id)
    seen = jnp.concatenate([mask, jnp.broadcast_to(slots < t, (b, n)),
                            jnp.ones((b, 1), bool)], axis=1)[:, None, :]
    (x,), (k_all, v_all) = gemma.forward(
        [cfg.llm], llm, [gemma.embed(llm, tok[:, None], dtype)], positions=(start + t)[:, None],
        mask=seen, kv_cache=(k_buf, v_buf), dtype=dtype)
    write = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(
        buf, new[:, :, -1:].astype(buf.dtype), num_prefix + t, axis=2)
    return (t + 1, write(k_buf, k_all), write(v_buf, v_all), gemma.decode(llm, x[:, 0]),
            out_tokens, out_logp, done)

  carry = (jnp.int32(0), jnp.pad(k, pad), jnp.pad(v, pad),
           gemma.decode(llm, last_valid(hidden, mask)), jnp.zeros((b, n), jnp.int32),
           jnp.zeros((b, n), jnp.float32), jnp.zeros((b,), bool))
  carry = jax.lax.while_loop(lambda c: (c[0] < n) & ~jnp.all(c[-1]), step, carry)
  out_tokens, out_logp = carry[4], carry[5]
  return Decoded(tokens=out_tokens, log_prob=out_logp,
                 mask=emitted_mask(out_tokens, cfg.eos_id), hidden=hidden, prefix_mask=mask)


def postfix_pass(cfg: Pi0FastConfig, p: dict, images: jax.Array, tokens: jax.Array,
                 token_mask: jax.Array, image_mask: jax.Array, postfix: jax.Array,
                 postfix_mask: jax.Array, *, offset: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One uncached pass over ``[prefix, postfix[:, :-1]]`` (teacher forcing).

  Args:
    postfix: ``int [B, T]`` VLM ids; postfix_mask ``bool [B, T]`` its valid tokens.
    offset: added to the postfix positions, ``cfg.decode_offset`` to score what
      :func:`decode` sampled, 0 for openpi's training positions.

  Returns:
    outputs ``[B, T, D]`` predicting each postfix token (the last valid prefix token's, then
    the postfix's), prefix hidden ``[B, P, D]`` and prefix mask ``[B, P]`` (the prefix never
    attends to the postfix).
  """
  llm = p["PaliGemma"]["llm"]
  x, mask = pi0.embed_prefix(cfg, p, images, tokens, token_mask, image_mask)
  b, num_prefix = mask.shape
  n = postfix.shape[1]
  emb = gemma.embed(llm, postfix[:, :-1].astype(jnp.int32), cfg.compute_dtype)
  full = jnp.concatenate([mask, postfix_mask[:, :-1].astype(bool)], axis=1)
  ar = jnp.concatenate([jnp.zeros(num_prefix, jnp.int32), jnp.ones(n - 1, jnp.int32)])
  post_pos = mask.sum(axis=1)[:, None] + jnp.arange(n - 1)[None] + offset
  positions = jnp.concatenate([jnp.cumsum(mask, axis=1) - 1, post_pos], axis=1)
  (out,), _ = gemma.forward([cfg.llm], llm, [jnp.concatenate([x, emb], axis=1)],
                            positions=positions, mask=layers.prefix_lm_mask(full, ar),
                            dtype=cfg.compute_dtype, remat=cfg.remat)
  hidden = out[:, :num_prefix]
  first = last_valid(hidden, mask)[:, None]
  return jnp.concatenate([first, out[:, num_prefix:]], axis=1), hidden, mask


def log_probs(cfg: Pi0FastConfig, p: dict, out: jax.Array, temperature: float) -> jax.Array:
  """``float32 [..., V]`` next-token log-probs of decoder outputs ``[..., D]`` at ``temperature``."""
  return jax.nn.log_softmax(gemma.decode(p["PaliGemma"]["llm"], out) / temperature, axis=-1)


# ------------------------------------------------------------------- policy --
class Pi0FastPolicy(layers.TreeOwner):
  """openpi's pi0-FAST (``config.name='pi0_fast'``) for RL over its action tokens.

  The chain stored for PPO is the emitted VLM ids ``[B, 1, T, 1]`` (float32, exact below
  2^24; 0 after the end), and ``log_prob_dims [B, T, 1]`` their log-probs at
  ``model.temperature`` (0 after the end), so a chunk's log-prob is the sum over the emitted
  tokens up to and including eos and the per-term ratios are per token. Greedy decoding
  ('eval') reports the log-prob of its tokens too.

  Host-side counts (``decode_counts``: rows decoded to actions and malformed ones;
  ``encode_counts``: expert chunks encoded for the loss and those left out) are updated by
  the callbacks of :meth:`act` and :meth:`bc_loss`, padding rows included.

  Args:
    config: the ``model`` sub-config.
    spec: the environment's static description.
  """

  tree_builder = staticmethod(build)

  def __init__(self, config: ml_collections.ConfigDict, spec: protocol.EnvSpec):
    if not config.fast_tokenizer_path:
      raise ValueError("config.model.fast_tokenizer_path is empty: pi0_fast needs a FAST "
                       "tokenizer directory (fit one with python -m jaxvla.models.fast_tokenizer "
                       "or copy HuggingFace's physical-intelligence/fast)")
    self.fast = fast_lib.FastTokenizer.load(config.fast_tokenizer_path)
    self.prompt = fast_prompt.make_prompt(config, self.fast)
    h, w, _ = spec.image_shape
    if h != w:
      raise ValueError(f"pi0_fast expects square images, got {spec.image_shape}")
    self.net = Pi0FastConfig.from_config(
        config, image_size=h, num_cameras=len(spec.camera_names), action_dim=spec.action_dim,
        vocab_size=self.prompt.vocab_size, eos_id=self.prompt.eos_id,
        min_tokens=self.prompt.min_postfix_len)
    self.chunk_len = config.chunk_len
    self.action_dim = spec.action_dim
    self.state_dim = spec.state_dim
    self.log_prob_terms = self.net.max_action_tokens
    self.rl_heads_only = False
    self._lock = threading.Lock()
    self.decode_counts = {"rows": 0, "malformed": 0}
    self.encode_counts = {"rows": 0, "left_out": 0}

  def host_counts(self) -> dict[str, float]:
    """The decode and encode counts since the policy was made (the run's metrics):
    ``fast_decoded_rows`` / ``fast_malformed_rows`` (and their ratio
    ``fast_malformed_frac``) over every act, evaluation's included;
    ``fast_encoded_chunks`` / ``fast_left_out_chunks`` over the BC loss's expert chunks."""
    with self._lock:
      dec, enc = dict(self.decode_counts), dict(self.encode_counts)
    return {"fast_decoded_rows": dec["rows"], "fast_malformed_rows": dec["malformed"],
            "fast_malformed_frac": dec["malformed"] / max(dec["rows"], 1),
            "fast_encoded_chunks": enc["rows"], "fast_left_out_chunks": enc["left_out"]}

  # ---------------------------------------------------------------- helpers --
  def prepare(self, obs: protocol.Observation) -> dict[str, np.ndarray]:
    """Observation -> ``images [B, N, H, W, 3]``, ``image_mask [B, N]``, ``state [B, S]``,
    ``tokens/token_mask [B, L]`` (the FAST prefix, the discretised state in it)."""
    state = obs.state.astype(np.float32)
    if state.shape[-1] != self.state_dim:
      raise ValueError(f"observation state has {state.shape[-1]} dims, the env spec "
                       f"{self.state_dim}")
    tokens, token_mask = self.prompt.prefix(obs.instruction, state)
    return dict(images=obs.images, image_mask=obs.image_mask, state=state, tokens=tokens,
                token_mask=token_mask)

  def _inputs(self, batch: dict) -> tuple:
    return (batch["images"], batch["tokens"], batch["token_mask"], contract.image_mask(batch))

  def chain_tokens(self, chain: jax.Array) -> jax.Array:
    """Stored chain ``[B, 1, T, 1]`` -> emitted ids ``int32 [B, T]``."""
    ids = jnp.round(chain[:, 0, :, 0]).astype(jnp.int32)
    return jnp.clip(ids, 0, self.net.vocab_size - 1)

  def decode_actions(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Emitted ids ``int32 [B, T]`` -> actions ``float32 [B, H, A_net]`` and ok ``bool [B]``,
    on the host (``jax.pure_callback``); malformed rows are zeros and counted."""
    b = tokens.shape[0]
    h, a = self.chunk_len, self.net.action_dim

    def host(ids):
      actions, ok = self.prompt.decode_actions(np.asarray(ids), h, a)
      with self._lock:
        self.decode_counts["rows"] += len(ok)
        self.decode_counts["malformed"] += int((~ok).sum())
      return actions, ok

    return jax.pure_callback(host, (jax.ShapeDtypeStruct((b, h, a), jnp.float32),
                                    jax.ShapeDtypeStruct((b,), jnp.bool_)),
                             tokens, vmap_method="sequential")

  def encode_actions(self, actions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Expert chunks ``[B, H, A_env]`` -> postfix ids ``int32 [B, T]`` and mask ``bool [B, T]``
    on the host; a chunk that cannot be encoded in T tokens has an all-False mask (counted)."""
    pad = self.net.action_dim - actions.shape[-1]
    actions = jnp.pad(actions.astype(jnp.float32), ((0, 0), (0, 0), (0, pad)))
    b, n = actions.shape[0], self.net.max_action_tokens

    def host(chunks):
      ids, mask, ok = self.prompt.encode_actions(np.asarray(chunks), n)
      with self._lock:
        self.encode_counts["rows"] += len(ok)
        self.encode_counts["left_out"] += int((~ok).sum())
      return ids, mask

    return jax.pure_callback(host, (jax.ShapeDtypeStruct((b, n), jnp.int32),
                                    jax.ShapeDtypeStruct((b, n), jnp.bool_)),
                             actions, vmap_method="sequential")

  # --------------------------------------------------------------- contract --
  def act(self, params: contract.Params, batch: dict, rng: jax.Array,
          mode: str) -> contract.ActOutput:
    """Decodes one chunk's tokens ('train': sampled at the temperature, 'eval': greedy)."""
    if mode not in MODES:
      raise ValueError(f"pi0_fast act mode {mode!r} is not one of {MODES}")
    dec = decode(self.net, params, *self._inputs(batch), rng, greedy=mode == "eval")
    actions, _ = self.decode_actions(dec.tokens)
    return contract.ActOutput(
        actions=actions[:, :, :self.action_dim],
        chain=dec.tokens[:, None, :, None].astype(jnp.float32),
        log_prob=dec.log_prob.sum(1), log_prob_dims=dec.log_prob[:, :, None],
        value=value(self.net, params, dec.hidden, dec.prefix_mask))

  def token_log_probs(self, params: contract.Params, batch: dict, chain: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Teacher-forced ``(log-probs [B, T, V], tokens [B, T], mask [B, T], value [B])`` of a chain.

    Position j is the distribution of emitted token j given the prefix and tokens ``< j``, at
    the positions and temperature :meth:`act` sampled it with.
    """
    tokens = self.chain_tokens(chain)
    mask = emitted_mask(tokens, self.net.eos_id)
    out, hidden, prefix_mask = postfix_pass(self.net, params, *self._inputs(batch), tokens, mask,
                                            offset=self.net.decode_offset)
    return (log_probs(self.net, params, out, self.net.temperature), tokens, mask,
            value(self.net, params, hidden, prefix_mask))

  def evaluate(self, params: contract.Params, batch: dict,
               chain: jax.Array) -> contract.Evaluation:
    """Log-prob ``[B]`` of stored chains ``[B, 1, T, 1]`` in one teacher-forced pass.

    Entropy ``[B]``: the categorical entropies at the emitted positions, summed.
    """
    logp_all, tokens, mask, v = self.token_log_probs(params, batch, chain)
    logp = jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0] * mask
    entropy = (-(jnp.exp(logp_all) * logp_all).sum(-1) * mask).sum(1)
    return contract.Evaluation(log_prob=logp.sum(1), log_prob_dims=logp[:, :, None], value=v,
                               entropy=entropy)

  def value(self, params: contract.Params, batch: dict) -> jax.Array:
    hidden, mask, _ = encode_prefix(self.net, params, *self._inputs(batch))
    return value(self.net, params, hidden, mask)

  def bc_loss(self, params: contract.Params, batch: dict, actions: jax.Array, rng: jax.Array,
              mask: jax.Array | None = None) -> jax.Array:
    """openpi's loss: next-token cross-entropy on the postfix of expert chunks ``[B, H, A]``.

    Each row's mean over its postfix tokens, then the mean over rows. ``mask [B, H]`` (bool)
    leaves out rows with no real action: the FAST tokens of a chunk mix all its actions, so,
    as openpi, a chunk padded past an episode's end is encoded whole. Chunks the FAST
    tokenizer cannot encode in ``max_action_tokens`` are left out (``encode_counts``).
    """
    del rng  # Teacher forcing is deterministic.
    post, post_mask = self.encode_actions(actions)
    out, _, _ = postfix_pass(self.net, params, *self._inputs(batch), post, post_mask, offset=0)
    logp = jnp.take_along_axis(log_probs(self.net, params, out, 1.0), post[..., None],
                               axis=-1)[..., 0]
    m = post_mask.astype(jnp.float32)
    row = -(logp * m).sum(1) / jnp.maximum(m.sum(1), 1.0)
    weight = post_mask.any(1)
    if mask is not None:
      weight = weight & mask.any(1)
    weight = weight.astype(jnp.float32)
    return (row * weight).sum() / jnp.maximum(weight.sum(), 1.0)
