"""Instruction tokenizers: the common ``Tokenizer`` interface, PaliGemma's SentencePiece
tokenizer for real-size variants and a small built-in word tokenizer for tiny ones.

Every tokenizer maps a batch of instructions (and optionally the robot state) to fixed-length
ids and a mask, in one of openpi's two prompt formats (``openpi/models/tokenizer.py``,
``PaligemmaTokenizer.tokenize``):

* pi0 format (``state=None``): ``[bos] + encode(text) + encode("\\n")``; the state goes to the
  action expert as a continuous input.
* pi0.5 format (``state`` given, "discrete state input"): the state, normalised to [-1, 1], is
  cut into 256 bins and written into the prompt
  ``f"Task: {text}, State: {bins};\\nAction: "``, tokenized as ``[bos] + encode(prompt)``.

Text is cleaned exactly as openpi does, ``text.strip().replace("_", " ").replace("\\n", " ")``
(no lower-casing). Unlike openpi, which cuts long prompts with a warning, a prompt longer than
``config.model.max_token_len`` is a ValueError.

PaliGemma's tokenizer model: openpi downloads ``gs://big_vision/paligemma_tokenizer.model``
from its assets bucket at start-up, which needs internet. This module never downloads anything:
on a machine without internet, copy ``paligemma_tokenizer.model`` onto it (e.g. from
``~/.cache/openpi/big_vision/paligemma_tokenizer.model`` of a machine that ran openpi, or
``gsutil cp gs://big_vision/paligemma_tokenizer.model .`` where there is network) and set
``config.model.tokenizer = "paligemma"`` and ``config.model.tokenizer_path`` to the file.
"""

from __future__ import annotations

import abc
import os
import re
from typing import Sequence

import numpy as np

NUM_STATE_BINS = 256  # openpi's discrete-state bins over [-1, 1].
TOKENIZERS = ("builtin", "paligemma")  # Valid values of ``config.model.tokenizer``.

# Words of common robot-manipulation instructions; anything else maps to <unk>.
_BUILTIN_WORDS = (
    "move go to the a an target reach touch pick up place put push pull on in into "
    "onto of and then from left right top bottom front back near far it object cube "
    "block ball bowl plate cup drawer door open close turn stack lift red green blue "
    "yellow purple cyan black white orange pink brown gray").split()
# The fixed words of the pi0.5 prompt "Task: ..., State: ...;\nAction: ".
_PROMPT_WORDS = ("task", "state", "action")


def clean_text(text: str) -> str:
  """openpi's prompt cleaning: strip, ``_`` -> space, newline -> space (case kept)."""
  if isinstance(text, bytes):
    text = text.decode("utf-8")
  return str(text).strip().replace("_", " ").replace("\n", " ")


def discretize_state(state: np.ndarray) -> np.ndarray:
  """Cuts a normalised state into openpi's 256 bins.

  Bin edges are ``np.linspace(-1, 1, 257)[:-1]``, so bin ``k`` holds
  ``[-1 + 2k/256, -1 + 2(k+1)/256)`` and 1.0 falls in bin 255 (e.g. ``[-1, 0, 0.999, 1]``
  -> ``[0, 128, 255, 255]``). Values outside [-1, 1] (and +-inf) are clipped into the end bins
  0 and 255; openpi would give -1 below -1, which is not a bin.

  Args:
    state: float ``[..., S]``, expected normalised to [-1, 1].

  Returns:
    int64 ``[..., S]`` bins in ``[0, 255]``.

  Raises:
    ValueError: the state contains NaN (it has no bin).
  """
  state = np.asarray(state, dtype=np.float64)
  if np.isnan(state).any():
    rows = np.unique(np.argwhere(np.isnan(state))[:, 0]).tolist() if state.ndim > 1 else []
    raise ValueError(f"state contains NaN (rows {rows}); it cannot be discretised into "
                     f"{NUM_STATE_BINS} bins")
  edges = np.linspace(-1.0, 1.0, NUM_STATE_BINS + 1)[:-1]
  return np.clip(np.digitize(state, bins=edges) - 1, 0, NUM_STATE_BINS - 1)


def state_prompt(cleaned_text: str, bins: Sequence[int]) -> str:
  """openpi's pi0.5 prompt for one sample: ``"Task: {text}, State: {bins};\\nAction: "``."""
  state_str = " ".join(str(int(b)) for b in bins)
  return f"Task: {cleaned_text}, State: {state_str};\nAction: "


class Tokenizer(abc.ABC):
  """Interface of every instruction tokenizer.

  Attributes:
    vocab_size: number of ids; every id produced is in ``[0, vocab_size)``.
    max_len: token length L of the output (``config.model.max_token_len``).
    bos_id: id of <bos>, the first token of every prompt.
    pad_id: id filling positions after the prompt (mask False there).
  """

  vocab_size: int
  max_len: int
  bos_id: int
  pad_id: int

  def __init__(self, max_len: int):
    if int(max_len) < 1:
      raise ValueError(f"model.max_token_len={max_len} must be >= 1")
    self.max_len = int(max_len)

  @abc.abstractmethod
  def _pi0_tokens(self, cleaned_text: str) -> list[int]:
    """Ids of the pi0 prompt for one cleaned instruction, <bos> included."""

  @abc.abstractmethod
  def _state_tokens(self, cleaned_text: str, bins: np.ndarray) -> list[int]:
    """Ids of the pi0.5 prompt for one cleaned instruction and its state bins ``int [S]``."""

  def encode(self, texts: Sequence[str],
             state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes a batch of instructions, in the pi0 or (with ``state``) pi0.5 format.

    Args:
      texts: ``[B]`` instructions (a list or an object array of str).
      state: optional float ``[B, S]``, normalised to [-1, 1]; given, it is discretised into
        256 bins (see ``discretize_state``) and written into the prompt.

    Returns:
      ids int32 ``[B, L]`` (L = ``max_len``, right-padded with ``pad_id``) and
      mask bool ``[B, L]`` (True on the prompt's tokens).

    Raises:
      ValueError: a prompt longer than ``max_len`` tokens (naming the instruction, its token
        count and ``model.max_token_len``), a state of the wrong shape, or NaN in the state.
    """
    texts = list(texts)
    bins = None
    if state is not None:
      state = np.asarray(state)
      if state.ndim != 2 or state.shape[0] != len(texts):
        raise ValueError(f"state must be float [B, S] with B={len(texts)} instructions, got "
                         f"shape {state.shape}")
      bins = discretize_state(state)
    ids = np.full((len(texts), self.max_len), self.pad_id, np.int32)
    mask = np.zeros((len(texts), self.max_len), bool)
    for b, text in enumerate(texts):
      cleaned = clean_text(text)
      toks = self._pi0_tokens(cleaned) if bins is None else self._state_tokens(cleaned, bins[b])
      if len(toks) > self.max_len:
        what = "<bos>" if bins is None else "<bos> and the discretised state"
        raise ValueError(
            f"instruction {text!r} has {len(toks)} tokens (with {what}) but "
            f"model.max_token_len is {self.max_len}; shorten it or raise "
            f"config.model.max_token_len")
      ids[b, :len(toks)] = toks
      mask[b, :len(toks)] = True
    return ids, mask


class PaligemmaTokenizer(Tokenizer):
  """PaliGemma's SentencePiece tokenizer, as openpi's ``PaligemmaTokenizer``.

  pi0 format: ``[bos] + sp.encode(text) + sp.encode("\\n")`` ("\\n" is the start-of-answer
  token); pi0.5 format: ``[bos] + sp.encode(state_prompt(text, bins))``.

  Args:
    path: local ``paligemma_tokenizer.model`` (``config.model.tokenizer_path``); nothing is
      downloaded, see the module docstring.
    max_len: token length L (``config.model.max_token_len``).

  Raises:
    ValueError: a missing or empty path, a file that is not a SentencePiece model, or a model
      without a <bos> piece.
  """

  def __init__(self, path: str, max_len: int):
    super().__init__(max_len)
    hint = ("config.model.tokenizer_path must point at PaliGemma's paligemma_tokenizer.model "
            "(openpi fetches gs://big_vision/paligemma_tokenizer.model from its assets bucket, "
            "which needs internet; copy the file onto this machine and point the config at it)")
    if not path:
      raise ValueError(f"config.model.tokenizer='paligemma' needs a tokenizer file: {hint}")
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
      raise ValueError(f"config.model.tokenizer_path={path!r} is not a file; {hint}")
    import sentencepiece  # Imported here so the built-in tokenizer works without it.
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
      raise ValueError(f"config.model.tokenizer_path={path!r} is not a SentencePiece model "
                       f"({e}); {hint}") from e
    self.path = path
    self.vocab_size = int(self._sp.vocab_size())
    self.bos_id = int(self._sp.bos_id())
    if self.bos_id < 0:
      raise ValueError(f"config.model.tokenizer_path={path!r}: the SentencePiece model has no "
                       f"<bos> piece; {hint}")
    pad = int(self._sp.pad_id())
    self.pad_id = pad if pad >= 0 else 0  # openpi pads with 0 (PaliGemma's <pad>).

  def _pi0_tokens(self, cleaned_text: str) -> list[int]:
    return list(self._sp.encode(cleaned_text, add_bos=True)) + list(self._sp.encode("\n"))

  def _state_tokens(self, cleaned_text: str, bins: np.ndarray) -> list[int]:
    return list(self._sp.encode(state_prompt(cleaned_text, bins), add_bos=True))


class WordTokenizer(Tokenizer):
  """Lower-cased word-level tokenizer with a fixed vocabulary, for tiny variants.

  Ids: 0 = <pad>, 1 = <unk>, 2 = <bos>, then the vocabulary words (``words`` followed by
  "task", "state", "action" where missing), then ``NUM_STATE_BINS`` state-bin tokens.
  Words are the runs of ``[a-z0-9]`` in the lower-cased cleaned text; punctuation is dropped.

  pi0 format: ``[bos] + word ids`` (no "\\n" start-of-answer token: the tiny models are trained
  from scratch, so it would carry no information).
  pi0.5 format: ``"Task: {text}, State: {bins};\\nAction: "`` becomes
  ``[bos, task] + word ids + [state] + bin ids + [action]``: each state bin is its own token,
  never <unk>, and numbers inside the instruction stay words (not bins).

  Args:
    max_len: token length L (with <bos>); longer instructions are an error, not silently cut.
    words: the vocabulary, lower-case ``[a-z0-9]+`` words.
  """

  PAD, UNK, BOS = 0, 1, 2

  def __init__(self, max_len: int, words: Sequence[str] = _BUILTIN_WORDS):
    super().__init__(max_len)
    bad = [w for w in words if not re.fullmatch(r"[a-z0-9]+", w)]
    if bad:
      raise ValueError(f"WordTokenizer words must be lower-case [a-z0-9]+, got {bad}")
    self.vocab = {w: i + 3 for i, w in enumerate(dict.fromkeys((*words, *_PROMPT_WORDS)))}
    self.state_offset = len(self.vocab) + 3  # Id of state bin 0.
    self.vocab_size = self.state_offset + NUM_STATE_BINS
    self.bos_id, self.pad_id = self.BOS, self.PAD

  def _words(self, cleaned_text: str) -> list[int]:
    return [self.vocab.get(w, self.UNK) for w in re.findall(r"[a-z0-9]+", cleaned_text.lower())]

  def _pi0_tokens(self, cleaned_text: str) -> list[int]:
    return [self.BOS] + self._words(cleaned_text)

  def _state_tokens(self, cleaned_text: str, bins: np.ndarray) -> list[int]:
    return ([self.BOS, self.vocab["task"]] + self._words(cleaned_text) + [self.vocab["state"]]
            + [self.state_offset + int(b) for b in bins] + [self.vocab["action"]])


def make_tokenizer(name: str, max_len: int, path: str = "") -> Tokenizer:
  """The tokenizer ``config.model.tokenizer`` names.

  Args:
    name: 'builtin' (``WordTokenizer``) or 'paligemma' (``PaligemmaTokenizer``).
    max_len: token length L (``config.model.max_token_len``).
    path: ``config.model.tokenizer_path``, the SentencePiece file for 'paligemma' (unused by
      'builtin').
  """
  if name == "builtin":
    return WordTokenizer(max_len)
  if name == "paligemma":
    return PaligemmaTokenizer(path, max_len)
  raise ValueError(f"config.model.tokenizer={name!r} is not one of {TOKENIZERS}")
