"""The tiny pi0-FAST: openpi's parameter tree, KV-cached decoding against the teacher-forced
pass, the chain log-prob against NumPy, greedy determinism, malformed token rows, BC,
config errors, the run's own tokenizer, and openpi's PaliGemma token layout."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvla import warm_start
from jaxvla.envs import builtin
from jaxvla.models import fast_tokenizer as fast_lib, gemma, layers, pi0, pi0_fast, siglip
from jaxvla.models import policy as policy_lib
from jaxvla.models import tokenizer as tokenizer_lib

SPEC = os.path.join(os.path.dirname(pi0_fast.__file__), "fast_openpi_params.json")
T = 16  # max_action_tokens of the tests
_CACHE = {}


@pytest.fixture(scope="module")
def fast_dir(tmp_path_factory):
  """A FAST tokenizer fitted on smooth chunks and the builtin expert's (so both encode)."""
  rng = np.random.default_rng(0)
  smooth = fast_lib.smooth_chunks(rng, 300, 5, 2)
  env = builtin.make(_config().env, 16, 0)
  expert = np.concatenate([np.clip(env.expert_chunk(5), -1, 1) for _ in range(4)])
  path = str(tmp_path_factory.mktemp("fast"))
  fast_lib.FastTokenizer.fit(np.concatenate([smooth, expert]), vocab_size=256).save(path)
  return path


def _config(**model):
  from configs import default  # pylint: disable=import-outside-toplevel
  c = default.get_config("smoke")
  c.model.update(**{"name": "pi0_fast", "max_action_tokens": T, "max_token_len": 16, **model})
  return c


def _setup(fast_dir, **model):
  """Env, policy, params, a batch and jitted functions, once per model config."""
  c = _config(fast_tokenizer_path=fast_dir, **model)
  key = c.model.to_json()
  if key not in _CACHE:
    env = builtin.make(c.env, 3, 0)
    pol = policy_lib.make_policy(c.model, env.spec)
    _CACHE[key] = dict(env=env, pol=pol, params=pol.init(jax.random.PRNGKey(0)),
                       batch=pol.prepare(env.observe()),
                       act=jax.jit(pol.act, static_argnames="mode"),
                       evaluate=jax.jit(pol.evaluate),
                       token_log_probs=jax.jit(pol.token_log_probs))
  return _CACHE[key]


def _eos_likely(s):
  """Params with eos's embedding row scaled up, so sampled rows end inside T tokens."""
  p = jax.tree.map(lambda x: x, s["params"])
  emb = p["PaliGemma"]["llm"]["embedder"]["input_embedding"]
  p["PaliGemma"]["llm"]["embedder"]["input_embedding"] = emb.at[s["pol"].net.eos_id].multiply(6.)
  return p


def _flat_shapes(tree: dict, prefix: str = "") -> dict:
  """``{"a/b": [shape]}`` of a nested dict of arrays (the spec's form)."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else k
    out.update(_flat_shapes(v, path) if isinstance(v, dict) else {path: list(v.shape)})
  return out


def test_tree_is_openpis_for_tiny_and_full(fast_dir):
  """Paths and shapes equal openpi's Pi0FAST trees (the spec json, read from openpi's code)."""
  with open(SPEC) as f:
    spec = json.load(f)
  # tiny: the sizes the spec's openpi tree was built at (32 px, learned posemb, 600 ids).
  s = _setup(fast_dir, posemb="learn", vocab_size=600)
  ours = {k: v for k, v in _flat_shapes(s["pol"].abstract_params()).items()
          if not k.startswith("rl/")}
  assert ours == spec["tiny"]
  llm, _, vit = pi0.VARIANTS["full"]
  net = pi0_fast.Pi0FastConfig(
      llm=llm, vit=siglip.SiglipConfig(**{**vit.__dict__, "posemb": "learn"}), image_size=224,
      num_cameras=3, action_dim=32, chunk_len=32, vocab_size=pi0.PALIGEMMA_VOCAB_SIZE,
      max_action_tokens=256, eos_id=1, temperature=1.0, dtype="bfloat16", remat=False,
      value_hidden=64)
  full = _flat_shapes(layers.abstract_tree(pi0_fast.build, net)[0])
  assert {k: v for k, v in full.items() if not k.startswith("rl/")} == spec["full"]
  assert {k for k in full if k.startswith("rl/")} == {
      "rl/value_hidden/kernel", "rl/value_hidden/bias", "rl/value_out/kernel", "rl/value_out/bias"}


@pytest.mark.parametrize("positions", ["openpi", "train"])
def test_act_shapes_and_cached_decode_equals_teacher_forcing(fast_dir, positions):
  """At either model.fast_positions the cached decode is what the teacher-forced pass scores;
  at 'train' that pass is the BC loss's own (offset 0)."""
  s = _setup(fast_dir, fast_positions=positions)
  assert s["pol"].net.decode_offset == {"openpi": 1, "train": 0}[positions]
  pol, params = s["pol"], _eos_likely(s)
  out = s["act"](params, s["batch"], jax.random.PRNGKey(1), mode="train")
  assert out.actions.shape == (3, 5, 2) and out.chain.shape == (3, 1, T, 1)
  assert out.log_prob.shape == (3,) and out.log_prob_dims.shape == (3, T, 1)
  np.testing.assert_allclose(out.log_prob, np.asarray(out.log_prob_dims).sum((1, 2)), rtol=1e-6)
  tokens = np.asarray(out.chain[:, 0, :, 0]).astype(int)
  assert (tokens == pol.net.eos_id).any(1).any()  # some row ended before T tokens
  # The scoring pass gives the same per-token log-probs as the cached sampler.
  ev = s["evaluate"](params, s["batch"], out.chain)
  np.testing.assert_allclose(ev.log_prob_dims, out.log_prob_dims, atol=2e-4)
  np.testing.assert_allclose(ev.log_prob, out.log_prob, atol=1e-3)
  # Greedy: each emitted token is the argmax of the teacher-forced distribution there.
  g = s["act"](params, s["batch"], jax.random.PRNGKey(1), mode="eval")
  logp_all, toks, mask, _ = s["token_log_probs"](params, s["batch"], g.chain)
  np.testing.assert_array_equal(np.where(mask, np.argmax(logp_all, -1), 0), toks)


def test_log_prob_matches_numpy_reference(fast_dir):
  """Sum over the emitted tokens, up to and including the first eos, of log softmax(z / temp)."""
  temp = 0.7
  s = _setup(fast_dir, temperature=temp)
  pol, params, batch = s["pol"], s["params"], s["batch"]
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, pol.net.vocab_size, (3, T))
  tokens[tokens == pol.net.eos_id] = 5
  tokens[0, 4], tokens[1, 0] = pol.net.eos_id, pol.net.eos_id  # row 2 never ends
  tokens[0, 9] = pol.net.eos_id  # a second eos: not the end
  chain = jnp.asarray(tokens, jnp.float32)[:, None, :, None]
  ev = s["evaluate"](params, batch, chain)
  inputs = (batch["images"], batch["tokens"], batch["token_mask"], batch["image_mask"])
  out, _, _ = pi0_fast.postfix_pass(pol.net, params, *inputs, jnp.asarray(tokens),
                                    jnp.ones((3, T), bool),
                                    offset=pol.net.decode_offset)
  z = np.asarray(gemma.decode(params["PaliGemma"]["llm"], out), np.float64) / temp
  logp = z - z.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  per_token = np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
  lengths = [5, 1, T]
  want = [per_token[b, :n].sum() for b, n in enumerate(lengths)]
  np.testing.assert_allclose(ev.log_prob, want, rtol=1e-5, atol=1e-4)
  assert (np.asarray(ev.log_prob_dims)[0, 5:] == 0).all()
  # Tokens after the end change nothing.
  other = tokens.copy()
  other[0, 5:], other[1, 1:] = 7, 9
  ev2 = s["evaluate"](params, batch, jnp.asarray(other, jnp.float32)[:, None, :, None])
  np.testing.assert_allclose(ev2.log_prob[:2], ev.log_prob[:2], atol=1e-5)


def test_greedy_is_deterministic(fast_dir):
  s = _setup(fast_dir)
  a = s["act"](s["params"], s["batch"], jax.random.PRNGKey(1), mode="eval")
  b = s["act"](s["params"], s["batch"], jax.random.PRNGKey(2), mode="eval")
  np.testing.assert_array_equal(a.chain, b.chain)
  np.testing.assert_array_equal(a.actions, b.actions)
  c = s["act"](s["params"], s["batch"], jax.random.PRNGKey(2), mode="train")
  assert not np.array_equal(a.chain, c.chain)


def test_malformed_rows_are_zero_and_counted(fast_dir):
  s = _setup(fast_dir)
  pol, prompt = s["pol"], s["pol"].prompt
  chunks = fast_lib.smooth_chunks(np.random.default_rng(1), 1, 5, 2)
  good, mask, ok = prompt.encode_actions(chunks, T)
  assert ok.all()
  good = good[0]
  no_start = good.copy()
  no_start[0] = 5
  text_inside = good.copy()
  text_inside[1] = 5  # a text id among the FAST ids
  no_end = np.where(np.arange(T) < 2, good, prompt.fast_top)  # FAST ids to the end, no '|'
  rows = np.stack([good, no_start, text_inside, no_end, np.zeros(T, int)])
  before = dict(pol.decode_counts)
  actions, ok = jax.jit(pol.decode_actions)(jnp.asarray(rows, jnp.int32))
  np.testing.assert_array_equal(ok, [True, False, False, False, False])
  assert np.abs(np.asarray(actions)[1:]).max() == 0
  np.testing.assert_allclose(actions[0], chunks[0], atol=0.1)  # FAST's quantisation step
  assert pol.decode_counts["rows"] - before["rows"] == 5
  assert pol.decode_counts["malformed"] - before["malformed"] == 4
  # The untrained model emits malformed rows: act gives zeros and counts them.
  out = s["act"](s["params"], s["batch"], jax.random.PRNGKey(4), mode="train")
  assert np.abs(np.asarray(out.actions)).max() == 0
  assert pol.decode_counts["malformed"] - before["malformed"] == 7


def test_bc_loss_and_gradient(fast_dir):
  s = _setup(fast_dir)
  pol, params, batch = s["pol"], s["params"], s["batch"]
  acts = np.clip(s["env"].expert_chunk(pol.chunk_len), -1, 1)
  loss, grads = jax.jit(jax.value_and_grad(pol.bc_loss))(params, batch, jnp.asarray(acts),
                                                         jax.random.PRNGKey(0))
  # An untrained model's per-token loss is about log V.
  assert abs(float(loss) - np.log(pol.net.vocab_size)) < 1.5
  g = grads["PaliGemma"]["llm"]["embedder"]["input_embedding"]
  assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0
  none = np.zeros((3, pol.chunk_len), bool)
  assert float(pol.bc_loss(params, batch, jnp.asarray(acts), jax.random.PRNGKey(0), none)) == 0


@pytest.mark.parametrize("key,value,match", [
    ("fast_tokenizer_path", "", "model.fast_tokenizer_path"),
    ("max_action_tokens", 3, "model.max_action_tokens"),
    ("temperature", 0.0, "model.temperature"),
    ("lora", "expert", "model.lora"),
    ("variant", "huge", "model.variant"),
    ("vocab_size", 300, "model.vocab_size"),
    ("action_dim", 1, "model.action_dim"),
    ("fast_positions", "sideways", "model.fast_positions"),
])
def test_bad_config_values_name_the_key(fast_dir, key, value, match):
  c = _config(fast_tokenizer_path=fast_dir)
  c.model[key] = value
  env = builtin.make(c.env, 1, 0)
  with pytest.raises(ValueError, match=match):
    policy_lib.make_policy(c.model, env.spec)


def test_prompt_longer_than_max_token_len_names_the_key(fast_dir):
  c = _config(fast_tokenizer_path=fast_dir, max_token_len=4)
  env = builtin.make(c.env, 1, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  with pytest.raises(ValueError, match="model.max_token_len=4"):
    pol.prepare(env.observe())


def test_a_run_keeps_its_tokenizer_in_the_workdir(fast_dir, tmp_path):
  """warm_start.fast_tokenizer_dir: a given tokenizer is copied into the workdir (the run's
  checkpoints and export carry it) and a resumed run finds it there; with no tokenizer, no
  dataset and no warm start there is nothing to fit it on, and the error says so."""
  c = _config(fast_tokenizer_path=fast_dir)
  spec = builtin.make(c.env, 1, 0).spec
  own = warm_start.fast_tokenizer_dir(c, str(tmp_path / "run"), spec)
  assert own == str(tmp_path / "run" / fast_lib.RUN_DIR)
  ids = np.array(fast_lib.FastTokenizer.load(fast_dir).encode(np.zeros((1, 5, 2)))[0])
  np.testing.assert_array_equal(fast_lib.FastTokenizer.load(own).encode(np.zeros((1, 5, 2)))[0],
                                ids)
  c.model.fast_tokenizer_path = "/nonexistent"  # (resumed: the workdir's own is used)
  assert warm_start.fast_tokenizer_dir(c, str(tmp_path / "run"), spec) == own
  c.model.fast_tokenizer_path, c.bc.num_steps = "", 0
  with pytest.raises(ValueError, match="model.fast_tokenizer_path is empty and bc.num_steps=0"):
    warm_start.fast_tokenizer_dir(c, str(tmp_path / "other"), spec)


@pytest.fixture(scope="module")
def paligemma_sp(tmp_path_factory):
  """A SentencePiece model with PaliGemma's special ids (pad 0, bos 2, eos 3) and its layout's
  pieces, rare junk pieces at the top of its ids (where PaliGemma has its <loc> tokens, which
  openpi's FAST ids replace). PaliGemma's own model cannot be downloaded here."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  junk = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 7)) for _ in range(400)]
  corpus = ["Task: move to the red target, State: 12 200 3 128 255 0;\nAction: |",
            "Task: reach the green target, State: 1 2 3;\nAction: |"] * 50
  corpus += [" ".join(junk[i:i + 5]) for i in range(0, 400, 5)]
  prefix = str(tmp_path_factory.mktemp("sp") / "paligemma_like")
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(corpus), model_prefix=prefix, vocab_size=700, hard_vocab_limit=False,
      pad_id=0, unk_id=1, bos_id=2, eos_id=3, user_defined_symbols=["\n", "|"],
      normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
      split_digits=True, minloglevel=2)
  return f"{prefix}.model"


def test_paligemma_layout_is_openpis(paligemma_sp, tmp_path):
  """``model.tokenizer='paligemma'``: openpi's prefix text, the "Action: ... |" postfix with eos,
  FAST ids at ``V - 1 - 128 - t``, actions read back from the ids; a FAST block that would
  cover the layout's own ids is refused naming the key."""
  import sentencepiece  # pylint: disable=import-outside-toplevel
  sp = sentencepiece.SentencePieceProcessor(model_file=paligemma_sp)
  chunks = fast_lib.smooth_chunks(np.random.default_rng(0), 200, 5, 2)
  fast_lib.FastTokenizer.fit(chunks, vocab_size=64).save(str(tmp_path / "fast"))
  c = _config(fast_tokenizer_path=str(tmp_path / "fast"), tokenizer="paligemma",
              tokenizer_path=paligemma_sp, max_token_len=40, max_action_tokens=32)
  env = builtin.make(c.env, 2, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  v = sp.vocab_size()
  assert pol.net.vocab_size == v and pol.prompt.eos_id == sp.eos_id() == 3
  obs = env.observe()
  batch = pol.prepare(obs)
  for b in range(2):
    bins = " ".join(str(int(x)) for x in tokenizer_lib.discretize_state(obs.state[b]))
    text = str(obs.instruction[b]).lower().strip().replace("_", " ")
    want = sp.encode(f"Task: {text}, State: {bins};\n", add_bos=True)
    assert batch["tokens"][b][batch["token_mask"][b]].tolist() == want
  ids, mask, ok = pol.prompt.encode_actions(chunks[:4], 32)
  assert ok.all()
  fast_ids = pol.fast.encode(chunks[:4])
  for b in range(4):
    row = ids[b][mask[b]].tolist()
    n = len(sp.encode("Action: "))
    assert row[:n] == sp.encode("Action: ") and row[-2:] == [*sp.encode("|"), sp.eos_id()]
    assert row[n:-2] == [v - 1 - 128 - t for t in fast_ids[b]]
  actions, decoded = pol.prompt.decode_actions(ids[:, n:n + 32], 5, 2)  # (rows without "Action: ")
  assert not decoded.any()
  actions, decoded = pol.prompt.decode_actions(ids, 5, 2)
  assert decoded.all() and np.abs(actions - chunks[:4]).max() <= 0.5 * np.sqrt(5) / 10
  loss = jax.jit(pol.bc_loss)(pol.init(jax.random.PRNGKey(0)), batch,
                              jnp.asarray(chunks[:2], jnp.float32), jax.random.PRNGKey(0))
  assert np.isfinite(float(loss))
  fast_lib.FastTokenizer.fit(chunks, vocab_size=600).save(str(tmp_path / "wide"))
  c.model.fast_tokenizer_path = str(tmp_path / "wide")
  with pytest.raises(ValueError, match="model.fast_tokenizer_path: a FAST vocabulary of 600"):
    policy_lib.make_policy(c.model, env.spec)
