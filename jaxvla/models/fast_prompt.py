"""pi0-FAST's token layout (openpi's ``FASTTokenizer``, ``openpi/models/tokenizer.py``): the
prompt prefix, the action postfix, and reading actions back out of emitted token ids.

A sample is ``prefix + postfix`` over the VLM's vocabulary:

* prefix ``[bos] + encode("Task: {text}, State: {bins};\\n")`` (text lower-cased, stripped,
  ``_`` -> space; the state cut into openpi's 256 bins), bidirectional (``ar_mask`` 0);
* postfix ``encode("Action: ") + FAST ids + encode("|") + [eos]``, causal (``ar_mask`` 1) and
  the only part the loss sees. FAST id ``t`` is the VLM id ``V - 1 - skip - t``
  (:func:`jaxvla.models.fast_tokenizer.to_vlm_ids`).

Two sources of text ids:

* ``paligemma``: PaliGemma's SentencePiece model (``config.model.tokenizer_path``), as openpi:
  ``V = 257152``, ``skip = 128``, eos id 1.
* ``builtin`` (tiny variants): the word tokenizer's pi0.5 prompt ``[bos, task] + words +
  [state] + bins + [action]`` split before its last token, so the prefix ends at the state and
  the postfix starts with the ``action`` word; two ids above the word vocabulary are ``|`` and
  eos, and the FAST ids sit at the top of the vocabulary (``skip = 0``).

Reading actions (:meth:`FastPrompt.decode_actions`) works on ids, not on text: openpi decodes
the ids to a string, splits it at ``"Action: "`` and ``"|"`` and re-encodes the middle, which
can re-tokenize differently; here a row must start with the ``Action: `` ids and hold only
FAST ids up to the first ``|`` ids, else it is malformed and decodes to zeros (never an error:
this runs inside the rollout's jitted act, through a host callback).
"""

from __future__ import annotations

import os
from typing import Sequence

import ml_collections
import numpy as np

from jaxvla.models import fast_tokenizer as fast_lib
from jaxvla.models import tokenizer as tokenizer_lib

class FastPrompt:
  """The pi0-FAST token layout over one text tokenizer (see the module docstring).

  Attributes:
    vocab_size: V, the model's embedding rows.
    max_len: L, prefix tokens per sample (``config.model.max_token_len``).
    action_start: ids of ``"Action: "`` (the first postfix tokens).
    end: ids of ``"|"`` (after the FAST ids, before eos).
    eos_id: the end token; decoding stops after it.
    fast: the FAST tokenizer; ``skip``: VLM ids above the FAST block left alone.
  """

  def __init__(self, *, text: tokenizer_lib.Tokenizer, vocab_size: int, action_start: Sequence[int],
               end: Sequence[int], eos_id: int, fast: fast_lib.FastTokenizer, skip: int,
               sentencepiece=None):
    self.text, self.vocab_size, self.max_len = text, int(vocab_size), text.max_len
    self.action_start, self.end = tuple(int(i) for i in action_start), tuple(int(i) for i in end)
    self.eos_id, self.fast, self.skip = int(eos_id), fast, int(skip)
    self._sp = sentencepiece
    self.fast_top = self.vocab_size - 1 - self.skip  # VLM id of FAST token 0.
    self.fast_bottom = self.fast_top - (fast.vocab_size - 1)  # ... of the last FAST token.

  @property
  def min_postfix_len(self) -> int:
    """Tokens of the shortest postfix (one FAST id)."""
    return len(self.action_start) + 1 + len(self.end) + 1

  # ---------------------------------------------------------------- prefix --
  def prefix(self, texts: Sequence[str], state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prefix ids ``int32 [B, L]`` (right-padded) and mask ``bool [B, L]``.

    Args:
      texts: ``[B]`` instructions; state: float ``[B, S]`` normalised to [-1, 1].

    Raises:
      ValueError: a prompt longer than ``config.model.max_token_len``, or a NaN state.
    """
    if self._sp is None:  # builtin: the pi0.5 prompt without its trailing 'action' word.
      wide = tokenizer_lib.WordTokenizer(self.max_len + 1)
      try:
        ids, mask = wide.encode(texts, state=state)
      except ValueError as e:  # (its count includes the 'action' word, not in the prefix)
        if "max_token_len" not in str(e):
          raise
        raise ValueError(f"an instruction with its state has more than config.model."
                         f"max_token_len={self.max_len} prefix tokens; raise it") from e
      last = mask.sum(axis=1) - 1
      ids[np.arange(len(ids)), last], mask[np.arange(len(ids)), last] = wide.pad_id, False
      return ids[:, :self.max_len], mask[:, :self.max_len]
    bins = tokenizer_lib.discretize_state(np.asarray(state))
    ids = np.full((len(texts), self.max_len), self.text.pad_id, np.int32)
    mask = np.zeros((len(texts), self.max_len), bool)
    for b, text in enumerate(texts):
      if isinstance(text, bytes):
        text = text.decode("utf-8")
      cleaned = str(text).lower().strip().replace("_", " ")  # openpi's FAST cleaning.
      prompt = f"Task: {cleaned}, State: {' '.join(str(int(x)) for x in bins[b])};\n"
      toks = list(self._sp.encode(prompt, add_bos=True))
      if len(toks) > self.max_len:
        raise ValueError(f"instruction {text!r} with its state has {len(toks)} prefix tokens but "
                         f"config.model.max_token_len is {self.max_len}; raise it")
      ids[b, :len(toks)], mask[b, :len(toks)] = toks, True
    return ids, mask

  # --------------------------------------------------------------- postfix --
  def encode_actions(self, chunks: np.ndarray, length: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Postfix ids of expert chunks, for the loss.

    Args:
      chunks: float ``[B, H, A]`` normalised actions; length: T, postfix slots.

    Returns:
      ids ``int32 [B, T]`` (padded with eos), mask ``bool [B, T]`` (the postfix tokens) and
      ok ``bool [B]``: False for a chunk the BPE cannot encode losslessly or whose postfix is
      longer than T (its mask is all False, so the loss leaves it out).
    """
    fast_ids, ok = self.fast.encode_rows(np.asarray(chunks, np.float64))
    ids = np.full((len(fast_ids), length), self.eos_id, np.int32)
    mask = np.zeros((len(fast_ids), length), bool)
    for b, row in enumerate(fast_ids):
      if not ok[b] or not row:
        ok[b] = False
        continue
      vlm = fast_lib.to_vlm_ids(row, self.vocab_size, self.skip).tolist()
      post = [*self.action_start, *vlm, *self.end, self.eos_id]
      if len(post) > length:
        ok[b] = False
        continue
      ids[b, :len(post)], mask[b, :len(post)] = post, True
    return ids, mask, ok

  def decode_actions(self, ids: np.ndarray, horizon: int,
                     action_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Actions of emitted rows; a malformed row is zeros.

    Args:
      ids: int ``[B, T]`` emitted VLM ids (anything after the first eos is ignored).

    Returns:
      actions ``float32 [B, H, A]`` and ok ``bool [B]``. A row is malformed when it does not
      start with the ``Action: `` ids, has no ``|`` ids after them, holds a non-FAST id
      between, or its FAST ids do not decode to ``[H, A]``.
    """
    ids = np.asarray(ids).astype(np.int64)
    rows: list[list[int] | None] = [self._fast_ids(row) for row in ids]
    good = [r for r in rows if r is not None]
    actions = np.zeros((len(rows), horizon, action_dim), np.float32)
    ok = np.zeros(len(rows), bool)
    if good:
      decoded, decoded_ok = self.fast.decode(good, horizon, action_dim)
      where = [b for b, r in enumerate(rows) if r is not None]
      actions[where], ok[where] = decoded, decoded_ok
    return actions, ok

  def _fast_ids(self, row: np.ndarray) -> list[int] | None:
    """The FAST ids of one emitted row, or None if the row does not have the layout."""
    eos = np.flatnonzero(row == self.eos_id)
    row = row[:eos[0]] if eos.size else row
    n, m = len(self.action_start), len(self.end)
    if len(row) < n + 1 + m or tuple(row[:n]) != self.action_start:
      return None
    body = row[n:]
    stop = next((i for i in range(len(body) - m + 1) if tuple(body[i:i + m]) == self.end), None)
    if not stop:  # no '|', or no FAST id before it
      return None
    vlm = body[:stop]
    if vlm.min() < self.fast_bottom or vlm.max() > self.fast_top:
      return None
    return fast_lib.from_vlm_ids(vlm, self.vocab_size, self.skip).tolist()


def make_prompt(model: ml_collections.ConfigDict, fast: fast_lib.FastTokenizer) -> FastPrompt:
  """The layout ``config.model.tokenizer`` names, with the model's vocabulary size.

  Raises:
    ValueError: naming the config key: an unknown tokenizer, or a ``model.vocab_size`` that
      leaves no room for the FAST ids above the text ids.
  """
  if model.tokenizer == "builtin":
    text = tokenizer_lib.WordTokenizer(model.max_token_len)
    words = text.vocab_size + 2  # '|' and eos above the word ids
    vocab = model.vocab_size or words + fast.vocab_size
    if vocab - fast.vocab_size < words:
      raise ValueError(f"config.model.vocab_size={vocab} leaves no room for the FAST tokenizer's "
                       f"{fast.vocab_size} ids above the builtin tokenizer's {words}; use 0 "
                       f"(= {words + fast.vocab_size}) or more")
    return FastPrompt(text=text, vocab_size=vocab, action_start=(text.vocab["action"],),
                      end=(text.vocab_size,), eos_id=text.vocab_size + 1, fast=fast, skip=0)
  if model.tokenizer == "paligemma":
    text = tokenizer_lib.PaligemmaTokenizer(model.tokenizer_path, model.max_token_len)
    import sentencepiece  # Imported here so the builtin layout works without it.
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.expanduser(text.path))
    vocab = model.vocab_size or text.vocab_size
    if vocab != text.vocab_size:
      raise ValueError(f"config.model.vocab_size={vocab}: pi0_fast with the paligemma tokenizer "
                       f"maps FAST ids into its {text.vocab_size} ids; use 0 or that")
    prompt = FastPrompt(text=text, vocab_size=vocab, action_start=sp.encode("Action: "),
                        end=sp.encode("|"), eos_id=sp.eos_id(), fast=fast,
                        skip=fast_lib.FAST_SKIP_TOKENS, sentencepiece=sp)
    # openpi overwrites the top of PaliGemma's vocabulary (its <loc> tokens) with the FAST
    # ids; the ids the layout itself writes must stay below that block.
    layout = (*prompt.action_start, *prompt.end, prompt.eos_id, text.bos_id)
    if prompt.fast_bottom < 0 or max(layout) >= prompt.fast_bottom:
      raise ValueError(
          f"config.model.fast_tokenizer_path: a FAST vocabulary of {fast.vocab_size} ids "
          f"placed below the last {fast_lib.FAST_SKIP_TOKENS} of the tokenizer's {vocab} "
          f"(ids {max(prompt.fast_bottom, 0)}..{prompt.fast_top}) covers the ids of 'Action: ', "
          f"'|', eos or bos ({sorted(set(layout))}); use a smaller FAST vocabulary or "
          f"PaliGemma's own tokenizer")
    return prompt
  raise ValueError(f"config.model.tokenizer={model.tokenizer!r} is not one of "
                   f"{tokenizer_lib.TOKENIZERS}")
