"""The FAST action tokenizer: openpi's ids, the round trip's error bound, the HF processor's
files, malformed sequences, the PaliGemma id map and input errors.

The golden ids were produced by HF's ``UniversalActionProcessor`` (``physical-intelligence/
fast``'s ``processing_action_tokenizer.py``, under openpi's transformers 4.53.2 and tokenizers
0.21.4) on the same closed-form chunks; transformers is not a dependency, so the test pins them.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
from scipy import fft

from jaxvla.models import fast_tokenizer as ft

H, A = 10, 7


def golden_chunks(n: int = 200, h: int = 10, a: int = 3) -> np.ndarray:
  """Closed-form smooth chunks ``[n, h, a]`` (no RNG, so the golden ids stay valid)."""
  i = np.arange(n)[:, None, None]
  t = np.arange(h)[None, :, None] / h
  d = np.arange(a)[None, None, :]
  return 0.8 * np.sin(2 * np.pi * (0.05 * (i % 20) + 0.3 * d) * t + 0.7 * i + d)


@pytest.fixture(scope="module")
def chunks() -> np.ndarray:
  return ft.smooth_chunks(np.random.default_rng(0), 1000, H, A)


@pytest.fixture(scope="module")
def tok(chunks) -> ft.FastTokenizer:
  return ft.FastTokenizer.fit(chunks, scale=10.0, vocab_size=512)


def test_ids_match_openpi_processor():
  x = golden_chunks()
  tok = ft.FastTokenizer.fit(x, scale=10, vocab_size=256)
  assert tok.min_token == -25 and tok.bpe_vocab_size == 256
  assert tok.encode(x[[0, 7, 123]]) == [
      [76, 46, 69, 102, 41, 112, 81, 170, 77, 115],
      [68, 36, 76, 63, 74, 235, 65, 79, 107, 68, 215],
      [52, 83, 82, 75, 61, 37, 123, 65, 168, 84, 145]]
  assert tok.encode_rows(x[[0, 7, 123]] * 0.5)[0] == [
      [76, 35, 73, 94, 33, 86, 79, 87, 90, 76],
      [72, 82, 76, 161, 33, 77, 191, 84, 72, 177],
      [64, 80, 79, 76, 68, 82, 86, 71, 84, 122, 115]]
  # With room to spare, training stops when no pair occurs twice (min_frequency=2).
  roomy = ft.FastTokenizer.fit(x, scale=10, vocab_size=4096)
  assert roomy.bpe_vocab_size == 495
  assert roomy.encode(x[[0, 7, 123]]) == [
      [76, 46, 69, 102, 325, 81, 461],
      [68, 309, 63, 74, 235, 65, 269, 360],
      [52, 83, 82, 75, 61, 37, 123, 65, 460]]


def test_string_is_frequency_major_shifted_coefficients(tok, chunks):
  # The BPE's text is openpi's: round(dct(chunk, time) * scale), flattened row-major
  # ([H, A]: every dim's frequency 0 first), minus min_token, as characters.
  ids = tok.encode(chunks[:5])
  for x, row in zip(chunks[:5], ids):
    expected = np.around(fft.dct(x, axis=0, norm="ortho") * 10.0).flatten() - tok.min_token
    assert tok._bpe.decode(row) == "".join(map(chr, expected.astype(int)))


def test_bpe_pipeline_is_byte_level_bpes():
  ours = json.loads(ft._byte_level_bpe().to_str())
  theirs = json.loads(tokenizers.ByteLevelBPETokenizer().to_str())
  for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
    assert ours[key] == theirs[key], key


def test_fit_is_deterministic(chunks, tok):
  again = ft.FastTokenizer.fit(chunks, scale=10.0, vocab_size=512)
  assert again._bpe.to_str() == tok._bpe.to_str() and again.min_token == tok.min_token


def test_round_trip_within_quantisation_bound(tok, chunks):
  ids = tok.encode(chunks)
  assert all(0 <= i < tok.vocab_size for row in ids for i in row)
  # Smooth chunks compress: far fewer tokens than the H * A values of binning.
  assert np.mean([len(row) for row in ids]) < 0.5 * H * A
  actions, ok = tok.decode(ids, H, A)
  assert ok.all() and actions.shape == (len(chunks), H, A) and actions.dtype == np.float32
  # Rounding leaves each coefficient within 0.5 / scale. The orthonormal inverse M
  # ([H, H], x = M c) turns that into at most 0.5 / scale * sum_k |M[t, k]| at step t,
  # itself at most 0.5 * sqrt(H) / scale (Cauchy-Schwarz: M's rows have unit norm).
  inverse = fft.idct(np.eye(H), axis=0, norm="ortho")
  bound = 0.5 / tok.scale * np.abs(inverse).sum(axis=1)  # [H]
  assert bound.max() <= 0.5 * np.sqrt(H) / tok.scale + 1e-12
  error = np.abs(actions - chunks)  # [N, H, A]
  assert (error <= bound[None, :, None] + 1e-6).all()
  # Energy per (chunk, dim) is preserved, so the error's norm is within sqrt(H) * 0.5 / scale.
  assert (np.linalg.norm(actions - chunks, axis=1) <= 0.5 * np.sqrt(H) / tok.scale + 1e-6).all()
  # A finer scale is a finer grid.
  fine = ft.FastTokenizer.fit(chunks[:300], scale=100.0, vocab_size=2048)
  fine_actions, _ = fine.decode(fine.encode(chunks[:300]), H, A)
  assert np.abs(fine_actions - chunks[:300]).max() < 0.2 * error.max()


def test_save_load_gives_identical_encodings(tok, chunks, tmp_path):
  tok.save(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted([ft.PROCESSOR_CONFIG, ft.TOKENIZER_FILE,
                                                 ft.TOKENIZER_CONFIG, ft.SPECIAL_TOKENS_MAP])
  config = json.loads((tmp_path / ft.PROCESSOR_CONFIG).read_text())
  assert config == {"action_dim": A, "auto_map": ft._AUTO_MAP, "min_token": tok.min_token,
                    "processor_class": "UniversalActionProcessor", "scale": 10.0,
                    "time_horizon": H, "vocab_size": 512}
  loaded = ft.FastTokenizer.load(str(tmp_path))
  assert loaded.encode(chunks) == tok.encode(chunks)
  # transformers 5 writes the BPE's files into bpe_tokenizer/; load reads that too.
  sub = tmp_path / "bpe_tokenizer"
  sub.mkdir()
  for name in (ft.TOKENIZER_FILE, ft.TOKENIZER_CONFIG, ft.SPECIAL_TOKENS_MAP):
    shutil.move(tmp_path / name, sub / name)
  assert ft.FastTokenizer.load(str(tmp_path)).encode(chunks[:50]) == tok.encode(chunks[:50])


def _write_hf_processor(directory, *, clean_up: bool = False) -> dict[str, int]:
  """The HF processor's files built by hand, as the hub has them (not through ``save``).

  A byte-level BPE over all 256 byte characters plus one merge, ``((``: with
  ``min_token=-40``, coefficient 0 is ``chr(40) == "("``.

  Returns:
    the vocabulary.
  """
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  vocab = {c: i for i, c in enumerate(alphabet)}
  vocab["(("] = len(vocab)
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[("(", "(")]))
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  bpe.save(str(directory / "tokenizer.json"))
  (directory / "processor_config.json").write_text(json.dumps({
      "action_dim": None, "min_token": -40, "processor_class": "UniversalActionProcessor",
      "auto_map": {"AutoProcessor": "processing_action_tokenizer.UniversalActionProcessor"},
      "scale": 10, "time_horizon": None, "vocab_size": len(vocab)}))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "clean_up_tokenization_spaces": clean_up, "processor_class": "UniversalActionProcessor",
      "tokenizer_class": "PreTrainedTokenizerFast"}))
  (directory / "special_tokens_map.json").write_text("{}")
  return vocab


def test_load_reads_the_hf_processor_format(tmp_path):
  vocab = _write_hf_processor(tmp_path)
  tok = ft.FastTokenizer.load(str(tmp_path))
  assert (tok.scale, tok.min_token, tok.time_horizon, tok.action_dim) == (10, -40, None, None)
  # A constant 0.5 over H = 2 steps has DCT coefficient 0.5 * sqrt(2) -> round(7.07) = 7
  # at frequency 0 of both dims and 0 elsewhere: "//((", i.e. "/", "/", "((".
  x = np.full((1, 2, 2), 0.5)
  assert tok.encode(x) == [[vocab["/"], vocab["/"], vocab["(("]]]
  actions, ok = tok.decode([[vocab["/"], vocab["/"], vocab["(("]]], 2, 2)
  np.testing.assert_allclose(actions, np.full((1, 2, 2), 0.7 / np.sqrt(2)), rtol=1e-6)
  assert ok.all()
  # Bytes that are not UTF-8 (a lone lead byte 0xC3, byte-level "Ã") decode to U+FFFD,
  # one character, which openpi would read as coefficient 65533 - 40.
  actions, ok = tok.decode([[vocab["Ã"]]], 1, 1)
  assert not ok[0] and (actions == 0).all()


def test_load_honours_clean_up_tokenization_spaces(tmp_path):
  # " ." (coefficients -8 and 6) becomes "." when transformers cleans up spaces.
  for clean_up, expected_ok in ((False, True), (True, False)):
    directory = tmp_path / str(clean_up)
    directory.mkdir()
    vocab = _write_hf_processor(directory, clean_up=clean_up)
    tok = ft.FastTokenizer.load(str(directory))
    _, ok = tok.decode([[vocab["Ġ"], vocab["."]]], 2, 1)
    assert ok[0] == expected_ok


def test_malformed_sequences_decode_to_zeros(tok, chunks):
  valid = tok.encode(chunks[:2])
  rows = [
      valid[0],
      [],  # empty
      valid[1][:-1],  # truncated
      valid[1] + valid[1],  # too long
      [tok.bpe_vocab_size],  # just past the BPE's vocabulary
      [-1, *valid[1]],
      [10**12],
      "garbage",
      None,
      [1.5, 2.0],
      [[1, 2], [3]],
      np.array(valid[1]),  # an int array is fine
  ]
  actions, ok = tok.decode(rows, H, A)
  assert ok.tolist() == [True] + [False] * 10 + [True]
  assert (actions[~ok] == 0).all()
  expected, _ = tok.decode([valid[0], valid[1]], H, A)
  np.testing.assert_array_equal(actions[[0, -1]], expected)
  with pytest.raises(ValueError, match="horizon >= 1"):
    tok.decode(valid, 0, A)


def test_paligemma_id_map():
  tokens = np.arange(2048)
  ids = ft.to_vlm_ids(tokens)
  # openpi: vocab_size() - 1 - 128 - t, so token 0 is 257023 and the last 128 ids are free.
  assert ids[0] == 257152 - 1 - 128 and ids.max() < 257152 - 128 and ids.min() == 257023 - 2047
  np.testing.assert_array_equal(ft.from_vlm_ids(ids), tokens)
  np.testing.assert_array_equal(ft.to_vlm_ids(ft.to_vlm_ids(tokens)), tokens)
  np.testing.assert_array_equal(ft.to_vlm_ids([[0, 1]], vlm_vocab_size=1000, skip_tokens=8),
                                [[991, 990]])
  assert ft.to_vlm_ids([]).shape == (0,)
  with pytest.raises(ValueError, match=r"\[0, 257023\]"):
    ft.to_vlm_ids([0, 257024])
  with pytest.raises(ValueError, match=r"\[0, 257023\]"):
    ft.to_vlm_ids([-1])
  with pytest.raises(ValueError, match="integers"):
    ft.to_vlm_ids([0.5])


def test_text_ids_map_to_undecodable_tokens(tok):
  # A model that emits a text id (PaliGemma's <bos> = 2) among action ids: its FAST id is
  # out of range, so the row decodes to zeros instead of raising.
  _, ok = tok.decode([ft.from_vlm_ids([2, 257023]).tolist()], H, A)
  assert not ok[0]


def test_bad_input_raises(tok, chunks, tmp_path):
  with pytest.raises(ValueError, match=r"\[B, H, A\].*shape \(10, 7\)"):
    tok.encode(chunks[0])
  for bad in (np.nan, np.inf):
    x = chunks[:4].copy()
    x[2, 3, 1] = bad
    with pytest.raises(ValueError, match=r"rows \[2\] contain NaN or inf"):
      tok.encode(x)
    with pytest.raises(ValueError, match=r"rows \[2\] contain NaN or inf"):
      ft.FastTokenizer.fit(x)
  with pytest.raises(ValueError, match="H, A >= 1"):
    ft.FastTokenizer.fit(np.zeros((3, 0, 2)))
  with pytest.raises(ValueError, match="vocab_size=16 is smaller"):
    ft.FastTokenizer.fit(chunks, vocab_size=16)
  with pytest.raises(ValueError, match="scale must be > 0"):
    ft.FastTokenizer.fit(chunks, scale=0.0)
  # Coefficients far beyond the fitted range: openpi would drop them silently.
  with pytest.raises(ValueError, match=r"rows \[0\] .*cannot encode"):
    tok.encode(np.concatenate([chunks[:1] * 50, chunks[1:3]]))
  with pytest.raises(FileNotFoundError, match="no such FAST tokenizer directory"):
    ft.FastTokenizer.load(str(tmp_path / "absent"))
  tok.save(str(tmp_path))
  (tmp_path / ft.TOKENIZER_FILE).unlink()
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    ft.FastTokenizer.load(str(tmp_path))
  tok.save(str(tmp_path))
  (tmp_path / ft.PROCESSOR_CONFIG).unlink()
  with pytest.raises(FileNotFoundError, match="processor_config.json: missing"):
    ft.FastTokenizer.load(str(tmp_path))
  (tmp_path / ft.PROCESSOR_CONFIG).write_text("{not json")
  with pytest.raises(ValueError, match="processor_config.json: not valid JSON"):
    ft.FastTokenizer.load(str(tmp_path))
  (tmp_path / ft.PROCESSOR_CONFIG).write_text(json.dumps({"scale": 10, "vocab_size": 512}))
  with pytest.raises(ValueError, match="'min_token' must be an integer, got None"):
    ft.FastTokenizer.load(str(tmp_path))


def test_dataset_chunks_repeat_the_last_action():
  actions = np.arange(5, dtype=np.float32)[:, None]  # episodes [0, 1, 2] and [3, 4]
  got = ft.dataset_chunks(actions, np.array([3, 2]), horizon=3)[..., 0]
  np.testing.assert_array_equal(got, [[0, 1, 2], [1, 2, 2], [2, 2, 2], [3, 4, 4], [4, 4, 4]])


def test_command_prints_the_figures():
  out = subprocess.run(
      [sys.executable, "-m", "jaxvla.models.fast_tokenizer", "--num_chunks=400",
       "--horizon=5", "--action_dim=3", "--vocab_size=256"],
      capture_output=True, text=True, timeout=120, check=True)
  figures = json.loads(out.stdout.strip().splitlines()[-1])
  assert figures["fit"]["chunks"] == 320 and figures["held_out"]["chunks"] == 80
  assert figures["fit"]["raw_tokens"] == 15 and figures["fit"]["lossless"] == 1.0
  assert figures["fit"]["compression"] > 1.0


def test_cover_makes_every_chunk_in_range_encodable():
  """A fit on a cautious demonstrator's chunks (|a| <= 0.4) has no ids for a faster chunk;
  ``cover=1`` gives every chunk within [-1, 1] ids, round-tripping within the rounding bound,
  and leaves the data's own encoding as short."""
  rng = np.random.default_rng(0)
  slow = 0.4 * ft.smooth_chunks(rng, 400, 5, 2)
  fast = np.concatenate([np.ones((1, 5, 2)), -np.ones((1, 5, 2)),
                         rng.uniform(-1, 1, (50, 5, 2))])
  plain = ft.FastTokenizer.fit(slow, vocab_size=256)
  assert not plain.encode_rows(fast[:1])[1].any()  # (above the range: no ids)
  below, _ = plain.decode(plain.encode(fast[1:2]), 5, 2)  # (below: clamped, as openpi does)
  assert np.abs(below - fast[1:2]).max() > 0.3
  covered = ft.FastTokenizer.fit(slow, vocab_size=256, cover=1.0)
  ids, ok = covered.encode_rows(fast)
  assert ok.all()
  actions, decoded = covered.decode(ids, 5, 2)
  assert decoded.all() and np.abs(actions - fast).max() <= 0.5 * np.sqrt(5) / 10 + 1e-9
  lengths = lambda tok: np.mean([len(i) for i in tok.encode(slow)])
  assert lengths(covered) <= 1.1 * lengths(plain)
  with pytest.raises(ValueError, match="cover"):
    ft.FastTokenizer.fit(slow, cover=-1.0)
