"""Instruction tokenizers: a small built-in word tokenizer for tiny variants.

Real-size variants use PaliGemma's SentencePiece model (added with the policy
family); every tokenizer maps a batch of strings to fixed-length ids and a mask.
"""

from __future__ import annotations

import re

import numpy as np

# Words of common robot-manipulation instructions; anything else maps to <unk>.
_BUILTIN_WORDS = (
    "move go to the a an target reach touch pick up place put push pull on in into "
    "onto of and then from left right top bottom front back near far it object cube "
    "block ball bowl plate cup drawer door open close turn stack lift red green blue "
    "yellow purple cyan black white orange pink brown gray").split()


class WordTokenizer:
  """Lower-cased word-level tokenizer with a fixed vocabulary.

  Ids: 0 = <pad>, 1 = <unk>, 2 = <bos>, then the vocabulary words.

  Args:
    max_len: token length L (with <bos>); longer instructions are an error,
      not silently cut.
  """

  PAD, UNK, BOS = 0, 1, 2

  def __init__(self, max_len: int, words: tuple[str, ...] = _BUILTIN_WORDS):
    self.max_len = max_len
    self.vocab = {w: i + 3 for i, w in enumerate(dict.fromkeys(words))}
    self.vocab_size = len(self.vocab) + 3

  def encode(self, texts) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes ``texts`` ``[B]`` into ids ``int32 [B, L]`` and mask ``bool [B, L]``."""
    ids = np.zeros((len(texts), self.max_len), np.int32)
    for b, text in enumerate(texts):
      words = re.findall(r"[a-z0-9]+", str(text).lower())
      toks = [self.BOS] + [self.vocab.get(w, self.UNK) for w in words]
      if len(toks) > self.max_len:
        raise ValueError(
            f"instruction {text!r} has {len(toks)} tokens (with <bos>) but "
            f"model.max_token_len is {self.max_len}")
      ids[b, :len(toks)] = toks
    return ids, ids != self.PAD


def make_tokenizer(name: str, max_len: int) -> WordTokenizer:
  if name != "builtin":
    raise ValueError(f"model.tokenizer={name!r} is not available; use 'builtin'")
  return WordTokenizer(max_len)
