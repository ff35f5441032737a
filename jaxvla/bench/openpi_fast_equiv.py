"""jaxvla's pi0-FAST against openpi's own JAX ``Pi0FAST``:
``python -m jaxvla.bench.openpi_fast_equiv --openpi_src=DIR [--out_spec=PATH]``.

This file owns that check (docs/design/policy.md, "π0-FAST", "Equal to openpi's JAX code")
and the making of ``jaxvla/models/fast_openpi_params.json``. openpi is not a package on any
registry and none of its code is in this repository: ``--openpi_src`` is a directory holding
openpi's ``openpi`` package (``src/`` of a checkout at 15a9616, or ``src/openpi`` itself),
imported from there at run time. Before the import, :func:`install_stubs` puts light in-memory
modules in ``sys.modules`` for what openpi imports that the JAX network does not use, each
only when the real one cannot be imported (the PyTorch port always):

* ``openpi.shared.array_typing`` when jaxtyping or beartype is missing: no-op
  ``typecheck``, annotations that subscript to ``object``;
* ``augmax`` (training augmentation; everything here runs with ``train=False``),
  ``safetensors`` and ``torch`` (only a ``Tensor`` type for annotations): empty modules;
* ``openpi.models_pytorch.pi0_pytorch`` (the PyTorch port, which imports transformers).

The check builds openpi's ``Pi0FAST`` at jaxvla's tiny sizes (Gemma width 64, depth 2, 4 heads,
1 KV head, head dim 16, vocabulary 600; a ViT of width 64, depth 1, patch 8 with a learned
posemb; 32 px images), by patching, in memory and only while it runs, openpi's variant tables
(``gemma_fast.get_config``, ``siglip.decode_variant``) and ``model.IMAGE_RESOLUTION`` (with
the default ``preprocess_observation`` copied from it). Random weights (std 0.3) are saved in
openpi's checkpoint layout; openpi reads them with orbax and its own
``BaseModelConfig.load``, jaxvla with :func:`jaxvla.models.openpi_import.init_params`. Three
ColorReach samples, float32 on CPU, compared:

* postfix logits, teacher forced (openpi's ``embed_inputs`` + ``llm``, as its
  ``compute_loss``) against :func:`jaxvla.models.pi0_fast.postfix_pass` at offset 0;
* ``compute_loss`` (mean over rows) against ``Pi0FastPolicy.bc_loss``;
* greedy ``sample_actions(temperature=0, max_decoding_steps=24)`` against ``act('eval')``,
  and again with eos's embedding row x 1.6 so that rows end at different lengths; the tokens
  must be equal up to and including each row's first eos (openpi decodes on after it, jaxvla
  writes 0);
* ``Pi0FastPolicy.evaluate`` on openpi's greedy tokens against ``act``'s own log-probs.

jaxvla equals openpi only at ``model.fast_positions = 'openpi'`` (the default), openpi's
``sample_actions`` positions: the token sampled at step j sits at ``prefill_len + j + 1``.
The same tokens scored at ``'train'`` (``compute_loss``'s ``prefill_len + j``) are reported
for information, not checked: there the greedy tokens differ.

Prints one JSON line with every figure; exits 1 when a figure is past its tolerance
(:data:`TOLERANCE`), a token differs, or eos x 1.6 ends no row early (:func:`failures`).
``--out_spec`` also writes openpi's full and tiny ``Pi0FAST`` trees
(``nnx.eval_shape`` of ``create``) in the layout of ``fast_openpi_params.json`` and reports
whether they equal the committed file's.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import types
import warnings
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from jaxvla import defaults
from jaxvla.envs import builtin
from jaxvla.models import fast_tokenizer as fast_lib
from jaxvla.models import gemma, openpi_import, pi0, pi0_fast
from jaxvla.models import policy as policy_lib

OPENPI_COMMIT = "15a9616a00943ada6c20a0f158e3adb39df2ccac"  # the openpi the spec file is from
SPEC_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "models", "fast_openpi_params.json")
SPEC_SOURCE = (f"openpi src/openpi/models/pi0_fast.py at Physical-Intelligence/openpi "
               f"{OPENPI_COMMIT}, nnx.eval_shape / create")
SPEC_HOW = ("python -m jaxvla.bench.openpi_fast_equiv --openpi_src=<openpi checkout>/src "
            "--out_spec=jaxvla/models/fast_openpi_params.json (docs/design/policy.md, \u03c00-FAST)")

# jaxvla's tiny variant (checked against pi0.VARIANTS["tiny"] in tiny_sizes()).
LLM = dict(width=64, depth=2, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=16)
VIT = dict(width=64, depth=1, mlp_dim=256, num_heads=4, patch_size=(8, 8))
VOCAB = 600
IMAGE = 32
BATCH = 3
STD = 0.3  # of every random weight
STEPS = 24  # max_decoding_steps = model.max_action_tokens
MAX_TOKEN_LEN = 16  # the prefix: ColorReach's instruction and state take about 10
EOS_SCALE = 1.6  # eos's embedding row x this: greedy rows then end at different steps
SEED = 0  # ColorReach's samples, the FAST tokenizer's chunks, the decoding key
# The weights' seed: with it the plain weights decode all 24 steps in every row (72 tokens
# compared) and eos x 1.6 ends the rows at 10, 19 and 13 (seeds 0, 4 and 8 end no row).
WEIGHT_SEED = 6
# Figure -> the largest accepted value (float32 on CPU; tokens must be equal).
TOLERANCE = {"logits_max_abs_diff": 1e-4, "loss_abs_diff": 1e-5,
             "log_prob_max_abs_diff": 1e-4, "eos_log_prob_max_abs_diff": 1e-4}

_OPENPI_SRC = flags.DEFINE_string(
    "openpi_src", None, f"Directory holding openpi's `openpi` package (src/ of a checkout at "
    f"{OPENPI_COMMIT[:7]}), or that package itself.")
_OUT_SPEC = flags.DEFINE_string(
    "out_spec", None, "Also write openpi's full and tiny Pi0FAST trees here, in the layout of "
    "jaxvla/models/fast_openpi_params.json.")


# -------------------------------------------------------------------- openpi --
def openpi_root(src: str) -> str:
  """The directory to put on ``sys.path`` for ``import openpi``: ``src`` when it holds an
  ``openpi`` package, its parent when ``src`` is that package.

  Raises:
    ValueError: naming ``src`` when neither holds openpi's ``models/pi0_fast.py``.
  """
  src = os.path.abspath(os.path.expanduser(src))
  if not os.path.isdir(src):
    raise ValueError(f"--openpi_src={src}: no such directory")
  for root in (src, os.path.dirname(src)):
    pkg = os.path.join(root, "openpi")
    if (os.path.isfile(os.path.join(pkg, "__init__.py"))
        and os.path.isfile(os.path.join(pkg, "models", "pi0_fast.py"))
        and (root == src or os.path.samefile(pkg, src))):
      return root
  hint = (f"; did you mean {os.path.join(src, 'src')}?"
          if os.path.isfile(os.path.join(src, "src", "openpi", "models", "pi0_fast.py")) else "")
  raise ValueError(f"--openpi_src={src} holds no openpi package (expected "
                   f"{os.path.join(src, 'openpi', 'models', 'pi0_fast.py')}: give src/ of an "
                   f"openpi checkout at {OPENPI_COMMIT[:7]}){hint}")


def _importable(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False


def _module(name: str, **attrs: Any) -> types.ModuleType:
  mod = types.ModuleType(name, "jaxvla.bench.openpi_fast_equiv: an in-memory stand-in")
  mod.__dict__.update(attrs)
  return mod


class _Annotation:
  """jaxtyping's ``Float[Array, "b s"]`` and friends: subscripting gives ``object``."""

  def __getitem__(self, _):
    return object


def _array_typing_stub() -> types.ModuleType:
  """``openpi.shared.array_typing`` without jaxtyping or beartype: checks nothing."""

  def typecheck(t):
    return t

  @contextlib.contextmanager
  def disable_typechecking():
    yield

  def check_pytree_equality(*, expected, got, check_shapes=False, check_dtypes=False):
    # BaseModelConfig.load's check: same paths, and same shapes / dtypes when asked.
    want = jax.tree_util.tree_flatten_with_path(expected)[0]
    have = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    if set(dict(want)) != set(have):
      raise ValueError(f"PyTrees have different structure: {len(want)} vs {len(have)} leaves")
    for path, x in want:
      y = have[path]
      if (check_shapes and x.shape != y.shape) or (check_dtypes and x.dtype != y.dtype):
        raise ValueError(f"mismatch at {jax.tree_util.keystr(path)}: {x.shape} {x.dtype} vs "
                         f"{y.shape} {y.dtype}")

  ann = _Annotation()
  return _module(
      "openpi.shared.array_typing", typecheck=typecheck, disable_typechecking=disable_typechecking,
      check_pytree_equality=check_pytree_equality, Array=jax.Array, ArrayLike=jax.typing.ArrayLike,
      DTypeLike=jax.typing.DTypeLike, KeyArrayLike=jax.typing.ArrayLike, Params=object,
      **{n: ann for n in ("Float", "Int", "Bool", "UInt8", "Num", "Real", "Key", "Shaped",
                          "PyTree")})


def install_stubs() -> list[str]:
  """Puts stand-ins for openpi's unused imports in ``sys.modules``; returns their names."""
  stubs: dict[str, types.ModuleType] = {}
  if not (_importable("jaxtyping") and _importable("beartype")):
    stubs["openpi.shared.array_typing"] = _array_typing_stub()
  for name in ("augmax", "safetensors"):
    if not _importable(name):
      stubs[name] = _module(name)
  if not _importable("torch"):  # annotations only (model.py's ArrayT, image_tools' import)
    tensor = type("Tensor", (), {})
    stubs["torch"] = _module("torch", Tensor=tensor, nn=_module("torch.nn"))
    stubs["torch.nn"] = stubs["torch"].nn
    stubs["torch.nn.functional"] = stubs["torch.nn"].functional = _module("torch.nn.functional")
  # The PyTorch port: openpi's model.py imports it for load_pytorch only.
  stubs["openpi.models_pytorch.pi0_pytorch"] = _module("openpi.models_pytorch.pi0_pytorch")
  sys.modules.update(stubs)
  return sorted(stubs)


def import_openpi(src: str) -> tuple[types.SimpleNamespace, list[str]]:
  """openpi's ``model``, ``pi0_fast``, ``gemma_fast``, ``siglip`` and ``nnx_utils`` modules,
  imported from ``src`` (:func:`openpi_root`), and the stubs installed."""
  root = openpi_root(src)
  sys.path.insert(0, root)
  stubs = install_stubs()
  names = dict(model="openpi.models.model", pi0_fast="openpi.models.pi0_fast",
               gemma_fast="openpi.models.gemma_fast", siglip="openpi.models.siglip",
               nnx_utils="openpi.shared.nnx_utils")
  mods = {k: importlib.import_module(v) for k, v in names.items()}
  where = os.path.dirname(os.path.dirname(os.path.abspath(mods["pi0_fast"].__file__)))
  if not os.path.samefile(where, os.path.join(root, "openpi")):
    raise ValueError(f"--openpi_src={src}: `import openpi` found {where} instead (an "
                     f"installed openpi?)")
  return types.SimpleNamespace(**mods), stubs


@contextlib.contextmanager
def tiny_openpi(op: types.SimpleNamespace) -> Iterator[None]:
  """openpi's variant tables and image resolution at the tiny sizes, restored on exit."""
  get_config, decode_variant = op.gemma_fast.get_config, op.siglip.decode_variant
  resolution = op.model.IMAGE_RESOLUTION
  kwdefaults = dict(op.model.preprocess_observation.__kwdefaults__)

  def tiny_get_config(variant):
    cfg = get_config(variant)
    cfg.update(**LLM, vocab_size=VOCAB)
    return cfg

  op.gemma_fast.get_config = tiny_get_config
  op.siglip.decode_variant = lambda variant: {**decode_variant(variant), **VIT}
  op.model.IMAGE_RESOLUTION = (IMAGE, IMAGE)
  # preprocess_observation's default was copied from IMAGE_RESOLUTION when it was defined.
  op.model.preprocess_observation.__kwdefaults__["image_resolution"] = (IMAGE, IMAGE)
  try:
    yield
  finally:
    op.gemma_fast.get_config, op.siglip.decode_variant = get_config, decode_variant
    op.model.IMAGE_RESOLUTION = resolution
    op.model.preprocess_observation.__kwdefaults__.update(kwdefaults)


def param_shapes(op: types.SimpleNamespace, config) -> dict[str, list[int]]:
  """``{"PaliGemma/...": shape}`` of openpi's model (``nnx.eval_shape`` of ``create``)."""
  model = nnx.eval_shape(config.create, jax.random.key(0))
  flat = openpi_import.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return {k: list(v.shape) for k, v in sorted(flat.items())}


def tiny_sizes() -> dict[str, Any]:
  """The spec file's ``tiny_sizes``; the sizes are jaxvla's tiny variant's."""
  llm, _, vit = pi0.VARIANTS["tiny"]
  assert (llm.width, llm.depth, llm.mlp_dim, llm.num_heads, llm.num_kv_heads, llm.head_dim) == (
      LLM["width"], LLM["depth"], LLM["mlp_dim"], LLM["num_heads"], LLM["num_kv_heads"],
      LLM["head_dim"]), llm
  assert (vit.width, vit.depth, vit.mlp_dim, vit.num_heads, (vit.patch_size,) * 2) == (
      VIT["width"], VIT["depth"], VIT["mlp_dim"], VIT["num_heads"], VIT["patch_size"]), vit
  return {"image": IMAGE, "llm": "/".join(str(LLM[k]) for k in (
      "width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")),
          "vit": f"{VIT['width']}/{VIT['depth']}/{VIT['mlp_dim']}/{VIT['num_heads']}/patch "
                 f"{VIT['patch_size'][0]}, learned posemb", "vocab": VOCAB}


def write_spec(op: types.SimpleNamespace, path: str) -> dict[str, bool]:
  """Writes the spec file's content to ``path``; returns which parts equal the committed file's."""
  full = param_shapes(op, op.pi0_fast.Pi0FASTConfig())  # openpi's own sizes, unpatched
  with tiny_openpi(op):
    tiny = param_shapes(op, op.pi0_fast.Pi0FASTConfig(dtype="float32"))
  spec = {"full": full, "how": SPEC_HOW, "source": SPEC_SOURCE, "tiny": tiny,
          "tiny_sizes": tiny_sizes()}
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps(spec, indent=1, sort_keys=True))  # the committed file's format
  with open(SPEC_FILE, encoding="utf-8") as f:
    committed = json.load(f)
  return {f"spec_{k}_equal": spec[k] == committed.get(k)
          for k in ("full", "tiny", "tiny_sizes", "source")}


# --------------------------------------------------------------------- check --
def _policy(fast_dir: str, positions: str, env) -> pi0_fast.Pi0FastPolicy:
  """The tiny pi0-FAST policy at openpi's sizes above, decoding at ``positions``."""
  c = defaults.get_config()
  c.model.update(name="pi0_fast", variant="tiny", posemb="learn", vocab_size=VOCAB,
                 image_size=IMAGE, max_action_tokens=STEPS, max_token_len=MAX_TOKEN_LEN,
                 fast_tokenizer_path=fast_dir, fast_positions=positions, dtype="float32",
                 temperature=1.0)
  return policy_lib.make_policy(c.model, env.spec)


def _save(path: str, flat: dict[str, np.ndarray]) -> None:
  """openpi's checkpoint layout: an orbax PyTree ``{'params': <pure dict>}``."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  tree = {"params": openpi_import.unflatten({k: jnp.asarray(v) for k, v in flat.items()})}
  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(path, args=ocp.args.PyTreeSave(tree))


def _restore(path: str) -> dict:
  """The pure dict of an openpi ``params`` checkpoint, as openpi's ``restore_params`` gives it
  (which cannot run here: at 15a9616 it indexes orbax's metadata as a dict, and orbax 0.12
  returns a ``StepMetadata``)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  with ocp.PyTreeCheckpointer() as ckptr, warnings.catch_warnings():
    # Without restore arguments orbax warns that it reads the shardings from the file: one
    # CPU device wrote them, one reads them.
    warnings.simplefilter("ignore", UserWarning)
    tree = ckptr.restore(path)["params"]
  return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def _until_eos(tokens: np.ndarray, eos: int) -> np.ndarray:
  """Each row's length up to and including its first eos (all of it if none)."""
  hit = tokens == eos
  return np.where(hit.any(1), hit.argmax(1) + 1, tokens.shape[1])


def check(op: types.SimpleNamespace, workdir: str) -> dict[str, Any]:
  """The comparison (module docstring); returns its figures."""
  env = builtin.make(defaults.get_config().env, BATCH, SEED)
  # A FAST tokenizer that encodes ColorReach's expert chunks (as tests/test_pi0_fast.py's).
  rng = np.random.default_rng(SEED)
  expert = np.clip(env.expert_chunk(5), -1, 1)
  chunks = np.concatenate([fast_lib.smooth_chunks(rng, 300, 5, 2), expert, expert, expert])
  fast_dir = os.path.join(workdir, "fast")
  fast_lib.FastTokenizer.fit(chunks, vocab_size=256).save(fast_dir)
  pol = _policy(fast_dir, "openpi", env)
  assert pol.net.vocab_size == VOCAB and pol.net.image_size == IMAGE
  batch = pol.prepare(env.observe())
  acts = np.clip(env.expert_chunk(pol.chunk_len), -1, 1)
  post, post_mask, ok = pol.prompt.encode_actions(acts, STEPS)
  assert ok.all(), "the fitted FAST tokenizer left an expert chunk out"

  with tiny_openpi(op):
    config = op.pi0_fast.Pi0FASTConfig(dtype="float32", action_dim=pol.net.action_dim,
                                       action_horizon=pol.chunk_len,
                                       max_token_len=MAX_TOKEN_LEN + STEPS)
    shapes = openpi_import.flatten(nnx.to_pure_dict(nnx.state(
        nnx.eval_shape(config.create, jax.random.key(0)), nnx.Param)))
    wrng = np.random.default_rng(WEIGHT_SEED)
    weights = {k: (STD * wrng.standard_normal(shapes[k].shape)).astype(np.float32)
               for k in sorted(shapes)}
    eos_weights = dict(weights)
    emb_key = "PaliGemma/llm/embedder/input_embedding"
    eos_weights[emb_key] = weights[emb_key].copy()
    eos_weights[emb_key][pol.net.eos_id] *= EOS_SCALE
    ckpts = {}
    for name, flat in (("base", weights), ("eos", eos_weights)):
      ckpts[name] = os.path.join(workdir, name, "params")
      _save(ckpts[name], flat)
    models = {k: config.load(_restore(v)) for k, v in ckpts.items()}
    out = _compare(op, pol, models, ckpts, batch, acts, post, post_mask)
    out["train_positions"] = _train_positions(
        op, pol, _policy(fast_dir, "train", env), models["base"], ckpts["base"], batch)
  return out


def _observation(op: types.SimpleNamespace, batch: dict, tokens: np.ndarray, mask: np.ndarray,
                 ar: np.ndarray, loss: np.ndarray):
  """openpi's ``Observation`` of jaxvla's batch: one camera, its uint8 pixels to [-1, 1]."""
  images = np.asarray(batch["images"])
  assert images.shape[1] == 1 and np.asarray(batch["image_mask"]).all()
  return op.model.Observation(
      images={"top": jnp.asarray(images[:, 0], jnp.float32) / 127.5 - 1.0},
      image_masks={"top": jnp.ones(images.shape[0], bool)},
      state=jnp.asarray(batch["state"], jnp.float32), tokenized_prompt=jnp.asarray(tokens),
      tokenized_prompt_mask=jnp.asarray(mask), token_ar_mask=jnp.asarray(ar),
      token_loss_mask=jnp.asarray(loss))


def _greedy(op: types.SimpleNamespace, model, batch: dict) -> np.ndarray:
  """openpi's greedy tokens ``int [B, STEPS]`` of the prefix (jitted as openpi's policy does)."""
  mask = np.asarray(batch["token_mask"], bool)
  obs = _observation(op, batch, np.asarray(batch["tokens"], np.int32), mask,
                     np.zeros(mask.shape, np.int32), np.zeros(mask.shape, bool))
  sample = op.nnx_utils.module_jit(model.sample_actions,
                                   static_argnames=("max_decoding_steps", "temperature"))
  return np.asarray(sample(jax.random.key(0), obs, max_decoding_steps=STEPS,
                           temperature=0.0)).astype(np.int32)


def _compare(op: types.SimpleNamespace, pol: pi0_fast.Pi0FastPolicy, models: dict,
             ckpts: dict, batch: dict, acts: np.ndarray, post: np.ndarray,
             post_mask: np.ndarray) -> dict[str, Any]:
  """Logits, loss, greedy tokens and log-probs of openpi's ``models`` against ``pol`` loaded
  from the same checkpoints ``ckpts`` ('base'; 'eos': eos's embedding row scaled)."""
  key = jax.random.PRNGKey(SEED)
  params = openpi_import.init_params(pol, key, ckpts["base"])
  model = models["base"]
  inputs = (batch["images"], batch["tokens"], batch["token_mask"], batch["image_mask"])

  # openpi's layout of the same sample: [prefix, postfix] left-aligned, then padding.
  b, total = len(post), MAX_TOKEN_LEN + STEPS
  tokens, mask = np.zeros((b, total), np.int32), np.zeros((b, total), bool)
  ar, loss = np.zeros((b, total), np.int32), np.zeros((b, total), bool)
  plen = np.asarray(batch["token_mask"]).sum(1)
  for r in range(b):
    pre = np.asarray(batch["tokens"])[r, :plen[r]]
    pst = post[r][post_mask[r]]
    n = len(pre) + len(pst)
    tokens[r, :n], mask[r, :n] = np.concatenate([pre, pst]), True
    ar[r, len(pre):n], loss[r, len(pre):n] = 1, True
  obs = op.model.preprocess_observation(None, _observation(op, batch, tokens, mask, ar, loss),
                                        train=False, image_keys=["top"])

  # Teacher-forced logits, as openpi's compute_loss computes them.
  emb, in_mask, ar_mask = model.embed_inputs(obs)
  attn = op.pi0_fast.make_attn_mask(in_mask, ar_mask)
  pre_logits, _, _ = model.PaliGemma.llm(embedded_prefix=emb[:, :-1], mask=attn[:, :-1, :-1],
                                         return_prelogits=True)
  theirs, _ = model.PaliGemma.llm(pre_logits=pre_logits)
  theirs = np.asarray(theirs)
  num_img = emb.shape[1] - total
  out, _, _ = jax.jit(pi0_fast.postfix_pass, static_argnums=0, static_argnames="offset")(
      pol.net, params, *inputs, jnp.asarray(post), jnp.asarray(post_mask), offset=0)
  ours = np.asarray(gemma.decode(params["PaliGemma"]["llm"], out))
  diffs, biggest = [], 0.0
  for r in range(b):
    n = int(post_mask[r].sum())
    at = num_img + plen[r] - 1 + np.arange(n)  # openpi's outputs predicting postfix tokens
    diffs.append(np.abs(theirs[r, at] - ours[r, :n]).max())
    biggest = max(biggest, float(np.abs(theirs[r, at]).max()))

  loss_theirs = float(jnp.mean(model.compute_loss(key, obs, jnp.asarray(acts), train=False)))
  loss_ours = float(jax.jit(pol.bc_loss)(params, batch, jnp.asarray(acts), key))

  figures = {"openpi_commit_documented": OPENPI_COMMIT, "fast_positions": "openpi",
             "max_abs_logit": biggest, "logits_max_abs_diff": float(max(diffs)),
             "loss_openpi": loss_theirs, "loss_jaxvla": loss_ours,
             "loss_abs_diff": abs(loss_theirs - loss_ours)}
  act = jax.jit(pol.act, static_argnames="mode")
  evaluate = jax.jit(pol.evaluate)
  for name in ("base", "eos"):
    p = params if name == "base" else openpi_import.init_params(pol, key, ckpts[name])
    theirs_tok = _greedy(op, models[name], batch)
    g = act(p, batch, key, mode="eval")
    ours_tok = np.asarray(g.chain[:, 0, :, 0]).astype(np.int32)
    lengths = _until_eos(theirs_tok, pol.net.eos_id)
    cut = np.arange(STEPS)[None] < lengths[:, None]
    equal = bool((np.where(cut, theirs_tok, 0) == ours_tok).all())
    ev = evaluate(p, batch, jnp.asarray(np.where(cut, theirs_tok, 0),
                                        jnp.float32)[:, None, :, None])
    lp = float(np.abs(np.asarray(ev.log_prob_dims) - np.asarray(g.log_prob_dims)).max())
    prefix = "" if name == "base" else "eos_"
    figures.update({f"{prefix}tokens_equal": equal, f"{prefix}row_lengths": lengths.tolist(),
                    f"{prefix}tokens_compared": int(cut.sum()),
                    f"{prefix}log_prob_max_abs_diff": lp})
  return figures


def _train_positions(op: types.SimpleNamespace, pol: pi0_fast.Pi0FastPolicy,
                     train_pol: pi0_fast.Pi0FastPolicy, model, ckpt: str,
                     batch: dict) -> dict[str, Any]:
  """For information: jaxvla at ``fast_positions='train'`` on the same weights. Its greedy
  tokens, and the chain log-probs of openpi's greedy tokens against ``pol``'s (at openpi's
  positions)."""
  key = jax.random.PRNGKey(SEED)
  params = openpi_import.init_params(train_pol, key, ckpt)
  theirs = _greedy(op, model, batch)
  cut = np.arange(STEPS)[None] < _until_eos(theirs, pol.net.eos_id)[:, None]
  theirs = np.where(cut, theirs, 0)
  g = jax.jit(train_pol.act, static_argnames="mode")(params, batch, key, mode="eval")
  ours = np.asarray(g.chain[:, 0, :, 0]).astype(np.int32)
  chain = jnp.asarray(theirs, jnp.float32)[:, None, :, None]
  at_train = jax.jit(train_pol.evaluate)(params, batch, chain).log_prob
  at_openpi = jax.jit(pol.evaluate)(params, batch, chain).log_prob
  return {"tokens_equal": bool((ours == theirs).all()),
          "log_prob_max_abs_diff": float(np.abs(np.asarray(at_train - at_openpi)).max())}


def failures(figures: dict[str, Any]) -> list[str]:
  """The figures past their tolerance, and the token comparisons that are not equal."""
  bad = [f"{k}={figures[k]:.3g} > {tol}" for k, tol in TOLERANCE.items() if not figures[k] <= tol]
  bad += [k for k in ("tokens_equal", "eos_tokens_equal") if not figures[k]]
  ends = figures["eos_row_lengths"]
  if len(set(ends)) < 2 or min(ends) >= STEPS:  # else the eos case checks nothing new
    bad.append(f"eos_row_lengths={ends} (eos x {EOS_SCALE} should end rows at different steps)")
  return bad


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _OPENPI_SRC.value:
    raise app.UsageError("--openpi_src is required: the directory holding openpi's `openpi` "
                         "package (src/ of an openpi checkout)")
  jax.config.update("jax_platforms", "cpu")  # float32 on CPU, as the documented figures
  logging.set_verbosity(logging.WARNING)  # orbax logs every save: keep the output one line
  try:
    op, stubs = import_openpi(_OPENPI_SRC.value)
  except ValueError as e:
    sys.exit(f"error: {e}")
  with tempfile.TemporaryDirectory() as workdir:
    figures = {"stubs": stubs, **check(op, workdir)}
  if _OUT_SPEC.value:
    figures.update(write_spec(op, _OUT_SPEC.value), out_spec=_OUT_SPEC.value)
  bad = failures(figures)
  figures["ok"] = not bad
  print(json.dumps(figures))
  if bad:
    sys.exit(f"error: not equal to openpi: {', '.join(bad)}")


if __name__ == "__main__":
  app.run(main)
