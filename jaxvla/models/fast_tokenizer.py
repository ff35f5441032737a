"""The FAST action tokenizer (DCT + BPE) that openpi's pi0-FAST uses: fitting, encoding,
decoding, its files on disk, and the map of its ids into PaliGemma's vocabulary.

An action chunk ``[H, A]`` (normalised, about [-1, 1]) becomes a variable-length list of
ids in ``[0, vocab_size)``:

1. DCT-II along time, per action dim, orthonormal (``scipy.fft.dct(axis=time, norm="ortho")``);
2. ``round(coefficient * scale)``, flattened row-major: every dim's frequency 0, then every
   dim's frequency 1, ..., so the high frequencies (mostly 0) come last;
3. each integer minus ``min_token`` (the smallest one seen when fitting; anything below is
   clamped to 0, as openpi does) is written as the character ``chr(value)``;
4. a byte-level BPE (``tokenizers``, with ``ByteLevelBPETokenizer``'s pipeline) encodes
   that string; its ids are the tokens.

Decoding runs the steps backwards. This is ``UniversalActionProcessor`` of the HuggingFace
repository ``physical-intelligence/fast`` (``processing_action_tokenizer.py``: ``fit``,
``__call__``, ``decode``), which openpi's ``FASTTokenizer`` (``openpi/models/tokenizer.py``)
loads with ``AutoProcessor.from_pretrained``. It gives the same ids for the same chunks and
reads and writes the same files, without ``transformers``.

The BPE is byte-level: it sees the UTF-8 bytes of each character (GPT-2's byte alphabet),
split at GPT-2's pre-tokenizer boundaries (letters, digits, spaces, punctuation among the
characters), and no merge crosses a boundary. The fit's initial alphabet, ``chr(0)`` ..
``chr(max - min)``, is given in characters, not bytes. So a coefficient value that never
occurred in the fitting data may have bytes that the vocabulary lacks, even inside the fitted
range, and then the BPE cannot encode it.

Where openpi fails silently, this module says so:

* ``encode`` raises ValueError for a chunk the BPE cannot encode. openpi's BPE drops such
  characters, so its ids decode to the wrong length.
* ``decode`` returns zeros and ``ok=False`` for a row that is not a valid action sequence,
  as openpi does after printing the error. It also rejects ids outside the BPE's vocabulary,
  which openpi skips, and bytes that are not UTF-8, which openpi reads as U+FFFD, a
  coefficient of 65533 + ``min_token``.

PaliGemma ids (openpi's ``_act_tokens_to_paligemma_tokens``): FAST token ``t`` is the VLM id
``V - 1 - 128 - t``. This counts down from just below the last 128 ids, which are PaliGemma's
special tokens. For V = 257152, token 0 is 257023. The map is its own inverse.

Files (``save`` / ``load``), as the HuggingFace repository has them and transformers 4.x
(openpi pins 4.53.2) writes them:

* ``processor_config.json``: ``scale``, ``vocab_size``, ``min_token``, ``time_horizon``,
  ``action_dim`` (null in the released tokenizer), ``processor_class`` and ``auto_map``;
* ``tokenizer.json``: the BPE (``tokenizers``' own format);
* ``tokenizer_config.json`` and ``special_tokens_map.json``: what ``PreTrainedTokenizerFast``
  reads next to it.

transformers 5 puts the last three in ``bpe_tokenizer/``, and ``load`` reads that layout too.
``AutoProcessor.from_pretrained(directory, trust_remote_code=True)`` also needs the
repository's ``processing_action_tokenizer.py`` in the directory, and ``save`` does not write
it. Copy it from the HuggingFace cache.

``python -m jaxvla.models.fast_tokenizer [--dataset=DIR]`` fits a tokenizer and prints its
compression (:func:`main`; docs/design/policy.md, "The FAST action tokenizer").
"""

from __future__ import annotations

import json
import logging
import operator
import os
import sys
from typing import Any, Sequence

import numpy as np
import tokenizers
from scipy import fft

FAST_SKIP_TOKENS = 128  # openpi's: PaliGemma's last 128 ids are special tokens.
PALIGEMMA_VOCAB_SIZE = 257152  # PaliGemma's tokenizer.vocab_size(), openpi's V.

# A run's (and its export's) own tokenizer: <workdir>/fast_tokenizer, <export>/fast_tokenizer.
RUN_DIR = "fast_tokenizer"
PROCESSOR_CONFIG = "processor_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_HF5_SUBDIR = "bpe_tokenizer"  # Where transformers >= 5 saves the processor's tokenizer.
_PROCESSOR_CLASS = "UniversalActionProcessor"
_AUTO_MAP = {"AutoProcessor": "processing_action_tokenizer.UniversalActionProcessor"}
# transformers 4.x's tokenizer_config.json for the fitted BPE (its int "infinite" length).
_TOKENIZER_CONFIG = {"added_tokens_decoder": {}, "clean_up_tokenization_spaces": False,
                     "extra_special_tokens": {}, "model_max_length": int(1e30),
                     "processor_class": _PROCESSOR_CLASS,
                     "tokenizer_class": "PreTrainedTokenizerFast"}
# transformers' clean_up_tokenization, applied on decode when a loaded tokenizer_config.json
# says clean_up_tokenization_spaces (fitted tokenizers say false).
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
# A shifted coefficient at or above this is not a character BPE can take: the UTF-16
# surrogates start here and have no UTF-8 form. The fitted range is far below it.
_NO_CHAR = 0xD800
_ALPHABET_MARGIN = 100  # The fit warns when fewer merges than this fit in vocab_size (HF's).

log = logging.getLogger(__name__)


def _check_chunks(chunks: Any, what: str) -> np.ndarray:
  """``chunks`` as a float array ``[B, H, A]`` of finite values.

  Floating dtypes are kept (openpi's DCT runs in the input's precision, and rounding
  ``x.5`` can differ between float32 and float64); anything else becomes float64.
  """
  x = np.asarray(chunks)
  if x.ndim != 3 or x.shape[1] == 0 or x.shape[2] == 0:
    raise ValueError(f"{what} must be float [B, H, A] with H, A >= 1, got shape {x.shape}")
  if not np.issubdtype(x.dtype, np.floating):
    try:
      x = x.astype(np.float64)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{what} must be float [B, H, A], got dtype {x.dtype}") from e
  bad = np.flatnonzero(~np.isfinite(x).all(axis=(1, 2)))
  if bad.size:
    raise ValueError(f"{what} rows {bad[:10].tolist()} contain NaN or inf "
                     f"({bad.size} of {x.shape[0]} rows)")
  return x


def _quantise(x: np.ndarray, scale: float) -> np.ndarray:
  """Rounded scaled DCT coefficients, float ``[B, H * A]`` in openpi's order, from ``[B, H, A]``."""
  coefficients = np.around(fft.dct(x, axis=1, norm="ortho") * scale)
  return coefficients.reshape(x.shape[0], -1)  # row-major: frequency-major, dims inside.


def _to_text(values: np.ndarray) -> str:
  """Shifted coefficients ``int [H * A]`` (each in ``[0, _NO_CHAR)``) as the BPE's input string."""
  return "".join(map(chr, values.tolist()))


def _byte_level_bpe() -> tokenizers.Tokenizer:
  """An untrained BPE with ``tokenizers.ByteLevelBPETokenizer()``'s pipeline, the HF fit's."""
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  bpe.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
  return bpe


class FastTokenizer:
  """A fitted FAST tokenizer (see the module docstring for what it does).

  Attributes:
    scale: DCT coefficients are multiplied by it before rounding (quantisation step
      ``1 / scale``).
    vocab_size: the BPE's vocabulary budget; every id is in ``[0, vocab_size)``.
    min_token: the smallest rounded coefficient seen in fitting (character 0).
    time_horizon, action_dim: the chunk shape it was fitted on (None in openpi's released
      tokenizer, which takes any shape); stored, not enforced.
  """

  def __init__(self, bpe: tokenizers.Tokenizer, *, scale: float, vocab_size: int,
               min_token: int, time_horizon: int | None = None,
               action_dim: int | None = None, clean_up_spaces: bool = False):
    if not scale > 0:
      raise ValueError(f"FAST scale must be > 0, got {scale}")
    self.scale = scale
    self.vocab_size = int(vocab_size)
    self.min_token = int(min_token)
    self.time_horizon = time_horizon
    self.action_dim = action_dim
    self._bpe = bpe
    self._bpe_size = bpe.get_vocab_size(with_added_tokens=True)
    self._clean_up_spaces = clean_up_spaces

  @property
  def bpe_vocab_size(self) -> int:
    """Ids the BPE really has (``<= vocab_size``: fitting stops when no pair occurs twice)."""
    return self._bpe_size

  # --------------------------------------------------------------- fitting --
  @classmethod
  def fit(cls, chunks: np.ndarray, *, scale: float = 10.0, vocab_size: int = 1024,
          cover: float = 0.0) -> FastTokenizer:
    """Fits the BPE on action chunks, as the HF processor's ``fit`` does (``cover=0``).

    The initial alphabet is every character ``chr(0) .. chr(max - min)`` of the rounded
    coefficients' range. The trainer has ``min_frequency=2``, no special tokens and
    ``max_token_length=10000``, so a long run of zeros can become one token.

    A tokenizer fitted on a dataset can express only the coefficients the dataset spans: one
    fitted on a cautious demonstrator's chunks has no ids for a faster chunk, so RL could not
    move past the demonstrations. ``cover > 0`` widens the range to every chunk inside
    ``[-cover, cover]`` (an orthonormal DCT keeps each coefficient within ``sqrt(H) * cover``)
    and lets the BPE see each of those characters once (one string of them all), so every
    such chunk is encodable; the merges stay the data's (that string adds one count to the
    pairs of neighbouring values it holds).

    Args:
      chunks: float ``[N, H, A]`` normalised action chunks.
      scale: quantisation: coefficients are rounded to multiples of ``1 / scale``.
      vocab_size: BPE vocabulary size; must cover the coefficient range.
      cover: the action range every chunk within which must be encodable (0: the data's).

    Returns:
      the tokenizer, with ``time_horizon=H`` and ``action_dim=A``.

    Raises:
      ValueError: chunks not ``[N >= 1, H, A]`` or not finite, ``scale <= 0``, or a
        ``vocab_size`` smaller than the range of rounded coefficients.
    """
    x = _check_chunks(chunks, "fit chunks")
    if x.shape[0] == 0:
      raise ValueError("fit chunks must hold at least one chunk, got shape (0, ...)")
    if not scale > 0:
      raise ValueError(f"FAST scale must be > 0, got {scale}")
    if cover < 0:
      raise ValueError(f"FAST cover must be >= 0, got {cover}")
    coefficients = _quantise(x, scale)
    low, high = int(coefficients.min()), int(coefficients.max())
    if cover > 0:  # |coefficient| <= sqrt(H) * cover for a chunk within [-cover, cover]
      bound = int(np.ceil(np.sqrt(x.shape[1]) * cover * scale))
      low, high = min(low, -bound), max(high, bound)
    if high - low > vocab_size or high - low >= _NO_CHAR:
      raise ValueError(
          f"vocab_size={vocab_size} is smaller than the range of rounded DCT coefficients, "
          f"{high - low} ([{low}, {high}] at scale={scale}); raise vocab_size or lower scale")
    if high - low + _ALPHABET_MARGIN > vocab_size:
      log.warning("FAST fit: the alphabet (%d characters) leaves fewer than %d merges in "
                  "vocab_size=%d; consider a larger vocab_size", high - low + 1,
                  _ALPHABET_MARGIN, vocab_size)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=[],
        initial_alphabet=[chr(i) for i in range(high - low + 1)], max_token_length=10000)
    bpe = _byte_level_bpe()
    shifted = (coefficients - low).astype(np.int64)
    texts = [_to_text(row) for row in shifted]
    if cover > 0:  # Every character once: its UTF-8 bytes are in the vocabulary.
      texts.append(_to_text(np.arange(high - low + 1)))
    bpe.train_from_iterator(texts, trainer=trainer)
    return cls(bpe, scale=scale, vocab_size=vocab_size, min_token=low,
               time_horizon=x.shape[1], action_dim=x.shape[2])

  # -------------------------------------------------------------- encoding --
  def encode(self, chunks: np.ndarray) -> list[list[int]]:
    """Tokenizes action chunks: openpi's ``FASTTokenizer`` ids, before the PaliGemma map.

    Args:
      chunks: float ``[B, H, A]``.

    Returns:
      ``B`` lists of ids in ``[0, vocab_size)``, of varying length.

    Raises:
      ValueError: chunks not ``[B, H, A]`` or not finite, or a chunk with a coefficient
        the BPE cannot encode (naming the rows); refit on data that covers them.
    """
    ids, lossless = self.encode_rows(chunks)
    bad = np.flatnonzero(~lossless)
    if bad.size:
      raise ValueError(
          f"chunks rows {bad[:10].tolist()} ({bad.size} of {len(ids)}) have rounded DCT "
          f"coefficients this tokenizer's BPE cannot encode (fitted with min_token="
          f"{self.min_token}, scale={self.scale}); refit it on data that covers them")
    return ids

  def encode_rows(self, chunks: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
    """``encode`` without the error: ids per chunk and bool ``[B]``, whether it is lossless.

    A lossy row's ids are openpi's: characters the BPE lacks are dropped, and so they do
    not decode to ``[H, A]``.
    """
    x = _check_chunks(chunks, "chunks")
    shifted = np.clip(_quantise(x, self.scale) - self.min_token, 0, _NO_CHAR).astype(np.int64)
    representable = (shifted < _NO_CHAR).all(axis=1)
    texts = [_to_text(row) if good else "" for row, good in zip(shifted, representable)]
    ids = [e.ids for e in self._bpe.encode_batch(texts)]
    decoded = self._bpe.decode_batch(ids, skip_special_tokens=False)
    lossless = representable & np.array([d == t for d, t in zip(decoded, texts)], bool)
    return ids, lossless

  # -------------------------------------------------------------- decoding --
  def decode(self, tokens: Sequence[Sequence[int]], horizon: int,
             action_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Actions from FAST ids; a row that is not a valid sequence decodes to zeros.

    Args:
      tokens: ``B`` sequences of ids (lists or int arrays of any length).
      horizon: H, actions per chunk.
      action_dim: A.

    Returns:
      actions float32 ``[B, H, A]`` and ok bool ``[B]``. A row is not ok (zeros) when
      it is empty or not integers, holds an id outside the BPE's vocabulary, decodes to
      bytes that are not UTF-8, or decodes to other than ``H * A`` coefficients.

    Raises:
      ValueError: ``horizon`` or ``action_dim`` below 1 (a caller's error, not the
        sequence's).
    """
    if horizon < 1 or action_dim < 1:
      raise ValueError(f"decode needs horizon >= 1 and action_dim >= 1, got {horizon}, "
                       f"{action_dim}")
    coefficients = np.zeros((len(tokens), horizon, action_dim))
    ok = np.zeros(len(tokens), bool)
    for b, row in enumerate(tokens):
      values = self._coefficients(row, horizon * action_dim)
      if values is not None:
        coefficients[b] = values.reshape(horizon, action_dim)
        ok[b] = True
    actions = fft.idct(coefficients / self.scale, axis=1, norm="ortho")
    return actions.astype(np.float32), ok

  def _coefficients(self, row: Any, size: int) -> np.ndarray | None:
    """Rounded coefficients ``int [size]`` of one id sequence, or None if malformed."""
    try:
      ids = [operator.index(t) for t in row]
    except TypeError:  # not iterable, or not integers
      return None
    if not ids or min(ids) < 0 or max(ids) >= self._bpe_size:
      return None
    text = self._bpe.decode(ids, skip_special_tokens=False)
    if self._clean_up_spaces:
      for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    if len(text) != size or "\ufffd" in text:  # U+FFFD: the bytes were not UTF-8.
      return None
    return np.fromiter(map(ord, text), np.int64, size) + self.min_token

  # ----------------------------------------------------------------- files --
  def save(self, directory: str) -> None:
    """Writes the HF processor's files (module docstring) into ``directory``, creating it."""
    os.makedirs(directory, exist_ok=True)
    config = {"action_dim": self.action_dim, "auto_map": _AUTO_MAP, "min_token": self.min_token,
              "processor_class": _PROCESSOR_CLASS, "scale": self.scale,
              "time_horizon": self.time_horizon, "vocab_size": self.vocab_size}
    _write_json(os.path.join(directory, PROCESSOR_CONFIG), config)
    _write_json(os.path.join(directory, TOKENIZER_CONFIG),
                {**_TOKENIZER_CONFIG, "clean_up_tokenization_spaces": self._clean_up_spaces})
    _write_json(os.path.join(directory, SPECIAL_TOKENS_MAP), {})
    self._bpe.save(os.path.join(directory, TOKENIZER_FILE), pretty=True)

  @classmethod
  def load(cls, directory: str) -> FastTokenizer:
    """Reads a saved tokenizer, or the files of HF's ``physical-intelligence/fast``.

    Raises:
      FileNotFoundError: ``directory``, its ``processor_config.json`` or its
        ``tokenizer.json`` (at the top or in ``bpe_tokenizer/``) is missing.
      ValueError: a file is not valid JSON, or the config lacks or mistypes a field.
    """
    if not os.path.isdir(directory):
      raise FileNotFoundError(f"{directory}: no such FAST tokenizer directory")
    config = _read_json(os.path.join(directory, PROCESSOR_CONFIG))
    tokenizer_dir = directory
    if not os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
      tokenizer_dir = os.path.join(directory, _HF5_SUBDIR)
      if not os.path.isfile(os.path.join(tokenizer_dir, TOKENIZER_FILE)):
        raise FileNotFoundError(f"{directory}: no {TOKENIZER_FILE} (nor {_HF5_SUBDIR}/"
                                f"{TOKENIZER_FILE}); not a FAST tokenizer directory")
    file = os.path.join(tokenizer_dir, TOKENIZER_FILE)
    try:
      bpe = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # The Rust binding raises a bare Exception for bad files.
      raise ValueError(f"{file}: not a tokenizers BPE file ({e})") from e
    # transformers' default when tokenizer_config.json is absent: no clean-up.
    clean_up = False
    if os.path.isfile(os.path.join(tokenizer_dir, TOKENIZER_CONFIG)):
      clean_up = _read_json(os.path.join(tokenizer_dir, TOKENIZER_CONFIG)).get(
          "clean_up_tokenization_spaces", False)
    where = os.path.join(directory, PROCESSOR_CONFIG)
    return cls(bpe, scale=_field(config, "scale", where),
               vocab_size=_field(config, "vocab_size", where),
               min_token=_field(config, "min_token", where),
               time_horizon=_field(config, "time_horizon", where, optional=True),
               action_dim=_field(config, "action_dim", where, optional=True),
               clean_up_spaces=bool(clean_up))


def save_beside(directory: str, policy: Any) -> str | None:
  """Writes a pi0-FAST policy's tokenizer (its ``fast`` attribute) to ``directory/``
  :data:`RUN_DIR`, where the policy's readers look; returns that path (None, writing nothing,
  for a policy without one)."""
  fast = getattr(policy, "fast", None)
  if not isinstance(fast, FastTokenizer):
    return None
  out = os.path.join(directory, RUN_DIR)
  fast.save(out)
  return out


def _write_json(file: str, value: dict) -> None:
  with open(file, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write("\n")


def _read_json(file: str) -> dict:
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{file}: missing (a FAST tokenizer directory has "
                            f"{PROCESSOR_CONFIG} and {TOKENIZER_FILE})")
  try:
    with open(file, encoding="utf-8") as f:
      value = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file}: not valid JSON ({e})") from e
  if not isinstance(value, dict):
    raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
  return value


def _field(config: dict, key: str, file: str, optional: bool = False) -> Any:
  """``config[key]``: a number for ``scale``, else an integer (None allowed when optional)."""
  value = config.get(key)
  if value is None and optional:
    return None
  kind, types = ("a number", (int, float)) if key == "scale" else ("an integer", int)
  if isinstance(value, bool) or not isinstance(value, types):
    raise ValueError(f"{file}: '{key}' must be {kind}, got {value!r}")
  return value


# ------------------------------------------------------------ PaliGemma ids --
def to_vlm_ids(tokens: Any, vlm_vocab_size: int = PALIGEMMA_VOCAB_SIZE,
               skip_tokens: int = FAST_SKIP_TOKENS) -> np.ndarray:
  """FAST ids -> VLM ids, ``vlm_vocab_size - 1 - skip_tokens - tokens`` (openpi's map).

  Args:
    tokens: int ``[...]`` FAST ids.
    vlm_vocab_size: the VLM's vocabulary size (PaliGemma: 257152).
    skip_tokens: the VLM's last ids left alone (openpi: 128, PaliGemma's special tokens).

  Returns:
    int64 ``[...]`` in ``[0, vlm_vocab_size - skip_tokens)``.

  Raises:
    ValueError: tokens not integers, or outside ``[0, vlm_vocab_size - skip_tokens)``.
  """
  tokens = _int_array(tokens, "FAST tokens")
  top = vlm_vocab_size - 1 - skip_tokens
  if tokens.size and (tokens.min() < 0 or tokens.max() > top):
    raise ValueError(f"FAST tokens must be in [0, {top}] to map into a vocabulary of "
                     f"{vlm_vocab_size} ids minus {skip_tokens}, got [{tokens.min()}, "
                     f"{tokens.max()}]")
  return top - tokens


def from_vlm_ids(ids: Any, vlm_vocab_size: int = PALIGEMMA_VOCAB_SIZE,
                 skip_tokens: int = FAST_SKIP_TOKENS) -> np.ndarray:
  """VLM ids -> FAST ids, the inverse of :func:`to_vlm_ids` (the same formula).

  Ids that are not action tokens (text, the special tokens) map outside ``[0, vocab_size)``,
  which :meth:`FastTokenizer.decode` flags, so there is no range check here.

  Args:
    ids: int ``[...]`` VLM ids.

  Returns:
    int64 ``[...]``.
  """
  return vlm_vocab_size - 1 - skip_tokens - _int_array(ids, "VLM ids")


def _int_array(values: Any, what: str) -> np.ndarray:
  array = np.asarray(values)
  if array.size == 0:
    return array.astype(np.int64)
  if not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"{what} must be integers, got dtype {array.dtype}")
  return array.astype(np.int64)


# ------------------------------------------------------------- measurement --
def smooth_chunks(rng: np.random.Generator, n: int, horizon: int, action_dim: int, *,
                  components: int = 3, noise: float = 0.01) -> np.ndarray:
  """Random smooth chunks: per dim, a sum of low-frequency sinusoids plus noise, in [-1, 1].

  Each dim of each chunk sums ``components`` sinusoids of 0 to 1.5 cycles per chunk with
  random phases and amplitudes (at most 0.9 in all), then adds Gaussian noise of std
  ``noise`` and clips to [-1, 1].

  Returns:
    float64 ``[n, horizon, action_dim]``.
  """
  t = np.arange(horizon)[None, :, None, None] / horizon
  freq = rng.uniform(0.0, 1.5, (n, 1, action_dim, components))
  phase = rng.uniform(0.0, 2 * np.pi, (n, 1, action_dim, components))
  amp = rng.dirichlet(np.ones(components), (n, 1, action_dim)) * rng.uniform(
      0.2, 0.9, (n, 1, action_dim, 1))
  x = (amp * np.sin(2 * np.pi * freq * t + phase)).sum(-1)
  return np.clip(x + noise * rng.standard_normal(x.shape), -1.0, 1.0)


def measure(tokenizer: FastTokenizer, chunks: np.ndarray) -> dict[str, Any]:
  """Compression and round-trip error of ``tokenizer`` on ``chunks`` ``[N, H, A]``.

  Returns:
    ``{"chunks", "raw_tokens" (H * A, one token per value as binning uses),
    "mean_tokens", "p95_tokens", "max_tokens", "compression" (raw / mean),
    "lossless" (fraction of chunks the BPE encodes exactly),
    "max_abs_error" (round trip, over lossless chunks)}``; token counts over all chunks.
  """
  x = _check_chunks(chunks, "chunks")
  ids, lossless = tokenizer.encode_rows(x)
  lengths = np.array([len(i) for i in ids])
  actions, ok = tokenizer.decode([i for i, good in zip(ids, lossless) if good],
                                 x.shape[1], x.shape[2])
  raw = x.shape[1] * x.shape[2]
  error = np.abs(actions - x[lossless]).max() if ok.size else float("nan")
  return {"chunks": int(x.shape[0]), "raw_tokens": raw,
          "mean_tokens": round(float(lengths.mean()), 2),
          "p95_tokens": float(np.percentile(lengths, 95)), "max_tokens": int(lengths.max()),
          "compression": round(raw / float(lengths.mean()), 2),
          "lossless": round(float(lossless.mean()), 4),
          "max_abs_error": round(float(error), 4)}


def dataset_chunks(actions: np.ndarray, lengths: np.ndarray, horizon: int) -> np.ndarray:
  """Every step's chunk of the next ``horizon`` actions, openpi's (LeRobot's) way.

  A chunk that runs past its episode's end repeats the last action.

  Args:
    actions: float ``[N, A]``, the episodes one after another.
    lengths: int ``[E]`` steps per episode (summing to N).

  Returns:
    ``[N, horizon, A]``.
  """
  ends = np.cumsum(lengths) - 1
  episode = np.repeat(np.arange(len(lengths)), lengths)
  rows = np.minimum(np.arange(len(actions))[:, None] + np.arange(horizon)[None],
                    ends[episode][:, None])
  return actions[rows]


def main(argv: list[str]) -> None:
  """Fits on 80% of the chunks and prints :func:`measure` on both parts as one JSON line.

  ``--dataset=DIR``: an RLDS or LeRobot dataset, split by episode, actions normalised
  (``--norm``, openpi's quantile by default). Without it: random smooth chunks
  (:func:`smooth_chunks`, ``--num_chunks`` of ``--action_dim`` dims). ``--out=DIR`` also
  saves the fitted tokenizer.
  """
  from absl import app, flags  # pylint: disable=import-outside-toplevel

  dataset = flags.DEFINE_string("dataset", "", "RLDS / LeRobot dataset (empty: random "
                                "smooth chunks).")
  horizon = flags.DEFINE_integer("horizon", 10, "Actions per chunk H.")
  scale = flags.DEFINE_float("scale", 10.0, "FAST scale (quantisation step 1 / scale).")
  vocab_size = flags.DEFINE_integer("vocab_size", 1024, "BPE vocabulary size.")
  norm = flags.DEFINE_enum("norm", "quantile", ["quantile", "zscore", "none"],
                           "Action normalisation (dataset only).")
  action_key = flags.DEFINE_string("action_key", "action", "Dataset action key.")
  state_key = flags.DEFINE_string("state_key", "observation/state", "Dataset state key.")
  instruction_key = flags.DEFINE_string("instruction_key", "language_instruction",
                                        "Dataset instruction key.")
  action_dim = flags.DEFINE_integer("action_dim", 7, "A of the random chunks.")
  num_chunks = flags.DEFINE_integer("num_chunks", 5000, "Number of random chunks.")
  seed = flags.DEFINE_integer("seed", 0, "Seed of the random chunks.")
  out = flags.DEFINE_string("out", "", "Directory to save the fitted tokenizer in.")

  def run(_):
    if dataset.value:
      chunks, episode = _read_dataset(dataset.value, horizon.value, norm.value,
                                      action_key.value, state_key.value,
                                      instruction_key.value)
      fit_rows = episode < int(np.ceil(0.8 * (episode.max() + 1)))
      source = {"dataset": dataset.value, "norm": norm.value,
                "episodes": int(episode.max() + 1)}
    else:
      rng = np.random.default_rng(seed.value)
      chunks = smooth_chunks(rng, num_chunks.value, horizon.value, action_dim.value)
      fit_rows = np.arange(len(chunks)) < int(0.8 * len(chunks))
      source = {"dataset": "smooth_chunks", "seed": seed.value}
    tokenizer = FastTokenizer.fit(chunks[fit_rows], scale=scale.value,
                                  vocab_size=vocab_size.value)
    if out.value:
      tokenizer.save(out.value)
    print(json.dumps({**source, "horizon": horizon.value, "action_dim": chunks.shape[2],
                      "scale": scale.value, "vocab_size": vocab_size.value,
                      "bpe_vocab": tokenizer.bpe_vocab_size, "min_token": tokenizer.min_token,
                      "fit": measure(tokenizer, chunks[fit_rows]),
                      "held_out": measure(tokenizer, chunks[~fit_rows])}))

  app.run(run, argv)


def _read_dataset(path: str, horizon: int, norm: str, action_key: str, state_key: str,
                  instruction_key: str) -> tuple[np.ndarray, np.ndarray]:
  """A dataset's chunks ``[N, H, A]`` (normalised) and each one's episode ``int [N]``."""
  # Only the command reads datasets; the tokenizer itself does not import jaxvla.data.
  # pylint: disable-next=import-outside-toplevel
  from jaxvla.data import episodes, lerobot, norm_stats, readers, rlds

  features = episodes.Features(cameras=(), state=state_key, action=action_key,
                               instruction=instruction_key)
  try:
    fmt = readers.detect_format(path)
    reader = (rlds.RldsReader if fmt == "rlds" else lerobot.LeRobotReader)(path, features)
  except episodes.ONE_LINE_ERRORS as e:
    sys.exit(f"error: {e}")
  table = reader.table
  actions = table.actions
  if norm != "none":
    actions = norm_stats.normalize(actions, norm_stats.compute(table)["actions"], norm)
  episode = np.repeat(np.arange(table.num_episodes), table.lengths)
  return dataset_chunks(actions, table.lengths, horizon), episode


if __name__ == "__main__":
  main(sys.argv)
