"""Tokenizers: openpi's pi0 / pi0.5 prompt formats, padding, errors and the built-in vocab.

PaliGemma's model cannot be downloaded here, so a tiny SentencePiece model with the same
special ids (pad 0, bos 2) and a "\\n" piece is trained in the test.
"""

import numpy as np
import pytest
import sentencepiece

from jaxvla.models import tokenizer

_CORPUS = [
    "move to the red target", "pick up the blue cube and place it in the bowl",
    "Task: put the ball on the plate, State: 12 200 3 128 255 0;\nAction: ",
    "open the drawer then close it", "push the green block to the left",
] * 20


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
  prefix = tmp_path_factory.mktemp("sp") / "tiny"
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(_CORPUS), model_prefix=str(prefix), vocab_size=100,
      hard_vocab_limit=False, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
      user_defined_symbols=["\n"], normalization_rule_name="identity",
      add_dummy_prefix=False, remove_extra_whitespaces=False, split_digits=True,
      minloglevel=2)
  return f"{prefix}.model"


def test_discretize_state_matches_openpi():
  state = np.array([-1.0, 0.0, 0.999, 1.0, -0.5, 0.1, 0.8])
  openpi = np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
  np.testing.assert_array_equal(tokenizer.discretize_state(state), openpi)
  np.testing.assert_array_equal(tokenizer.discretize_state(state[:4]), [0, 128, 255, 255])
  # Outside [-1, 1] is clipped into the end bins.
  np.testing.assert_array_equal(tokenizer.discretize_state([-3.0, 7.0, -np.inf]), [0, 255, 0])
  with pytest.raises(ValueError, match="NaN"):
    tokenizer.discretize_state(np.array([[0.0, np.nan]]))


def test_paligemma_pi0_format(sp_path):
  tok = tokenizer.make_tokenizer("paligemma", 24, sp_path)
  sp = sentencepiece.SentencePieceProcessor(model_file=sp_path)
  assert (tok.bos_id, tok.pad_id, tok.vocab_size) == (2, 0, sp.vocab_size())
  assert sp.encode("\n") == [sp.piece_to_id("\n")]  # "\n" is a real token here
  texts = ["  move_to the red\ntarget ", "Pick up the cube"]
  ids, mask = tok.encode(texts)
  assert ids.shape == mask.shape == (2, 24) and ids.dtype == np.int32 and mask.dtype == bool
  for b, text in enumerate(texts):
    cleaned = text.strip().replace("_", " ").replace("\n", " ")
    want = [2] + sp.encode(cleaned) + sp.encode("\n")
    np.testing.assert_array_equal(ids[b], want + [0] * (24 - len(want)))
    np.testing.assert_array_equal(mask[b], [True] * len(want) + [False] * (24 - len(want)))
  assert ids.max() < tok.vocab_size


def test_paligemma_state_format(sp_path):
  tok = tokenizer.PaligemmaTokenizer(sp_path, max_len=64)
  sp = sentencepiece.SentencePieceProcessor(model_file=sp_path)
  state = np.array([[-1.0, 0.0, 0.999, 1.0]], np.float32)
  prompt = tokenizer.state_prompt(tokenizer.clean_text("put_the ball "),
                                  tokenizer.discretize_state(state)[0])
  assert prompt == "Task: put the ball, State: 0 128 255 255;\nAction: "
  ids, mask = tok.encode(["put_the ball "], state)
  want = [2] + sp.encode(prompt)
  np.testing.assert_array_equal(ids[0, :len(want)], want)
  assert mask.sum() == len(want) and not ids[0, len(want):].any()


def test_too_long_is_an_error(sp_path):
  tok = tokenizer.PaligemmaTokenizer(sp_path, max_len=6)
  long = r"'pick up the blue cube and place it' has \d+ tokens.*max_token_len"
  with pytest.raises(ValueError, match=long):
    tok.encode(["move", "pick up the blue cube and place it"])
  with pytest.raises(ValueError, match="max_token_len"):
    tok.encode(["move"], np.zeros((1, 8)))
  with pytest.raises(ValueError, match="shape"):
    tok.encode(["move"], np.zeros(8))
  with pytest.raises(ValueError, match="NaN"):
    tokenizer.WordTokenizer(32).encode(["move"], np.array([[np.nan, 0.0]]))


def test_missing_or_bad_tokenizer_path(tmp_path):
  with pytest.raises(ValueError, match="tokenizer_path.*paligemma_tokenizer.model"):
    tokenizer.make_tokenizer("paligemma", 48)
  with pytest.raises(ValueError, match="tokenizer_path"):
    tokenizer.make_tokenizer("paligemma", 48, str(tmp_path / "absent.model"))
  junk = tmp_path / "junk.model"
  junk.write_bytes(b"not a model")
  with pytest.raises(ValueError, match="not a SentencePiece model"):
    tokenizer.make_tokenizer("paligemma", 48, str(junk))


def test_builtin_formats():
  tok = tokenizer.make_tokenizer("builtin", 16)
  assert isinstance(tok, tokenizer.WordTokenizer) and (tok.bos_id, tok.pad_id) == (2, 0)
  ids, mask = tok.encode(["Move to the RED target"])
  v = tok.vocab
  np.testing.assert_array_equal(ids[0, :6], [2, v["move"], v["to"], v["the"], v["red"],
                                             v["target"]])
  assert mask.sum() == 6 and not ids[0, 6:].any()

  state = np.array([[-1.0, 0.0, 0.999, 1.0], [0.5, -0.5, 0.2, 0.3]])
  ids, mask = tok.encode(["move to red", "move to red"], state)
  s0 = tok.state_offset
  np.testing.assert_array_equal(
      ids[0, :11], [2, v["task"], v["move"], v["to"], v["red"], v["state"],
                    s0 + 0, s0 + 128, s0 + 255, s0 + 255, v["action"]])
  assert mask.sum(axis=1).tolist() == [11, 11]
  assert not (ids == tok.UNK).any()  # state bins are dedicated tokens, never <unk>
  assert not np.array_equal(ids[0], ids[1])  # different states, different ids
  assert ids.max() < tok.vocab_size and tok.vocab_size == s0 + 256
  # Numbers in the instruction are words (here <unk>), not state bins.
  ids, _ = tok.encode(["move 3"], np.zeros((1, 1)))
  assert ids[0, 3] == tok.UNK


def test_unknown_tokenizer_name():
  with pytest.raises(ValueError, match=r"config\.model\.tokenizer.*builtin.*paligemma"):
    tokenizer.make_tokenizer("gemma3", 48)
