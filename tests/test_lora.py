"""LoRA (``config.model.lora``): openpi's tree, frozen weights, merge, and checkpoint import.

Tiny variants everywhere except the abstract full-size tree checks (``eval_shape`` only).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxvla import config_checks
from jaxvla.envs import builtin
from jaxvla.learner import learner as learner_lib, update as update_lib
from jaxvla.models import lora, openpi_import as oi, policy as policy_lib, summary
from jaxvla.parallel import sharding
from tests import trajectories


def _policy(config, lora_choice: str, name: str = "pi0", n: int = 4):
  config.model.name = name
  config.model.lora = lora_choice
  # Small ranks: the tiny experts are 64 wide.
  config.model.lora_rank_llm, config.model.lora_rank_expert = 4, 8
  env = builtin.make(config.env, n, 0)
  return env, policy_lib.make_policy(config.model, env.spec)


def _randomise_adapters(params: dict, seed: int) -> dict:
  """Every adapter leaf non-zero (``lora_b`` starts at zero), so the adapters matter.

  pi0.5's adaRMS modulation (``Dense_0``) starts at zero too, which gates every action-
  expert layer shut (the actions would not see the prefix); it is randomised as well.
  """
  rng = np.random.default_rng(seed)
  flat = oi.flatten(jax.device_get(params))
  noisy = lambda p: lora.is_adapter(p) or "llm" in p and "Dense_0/kernel" in p
  return oi.unflatten({p: (0.2 * rng.standard_normal(x.shape)).astype(np.float32)
                       if noisy(p) else np.asarray(x) for p, x in flat.items()})


def _without_adapters(params: dict) -> dict:
  return oi.unflatten({p: x for p, x in oi.flatten(params).items() if not lora.is_adapter(p)})


def _write_openpi(directory, params: dict) -> str:
  """``params`` minus ``rl/`` in openpi's layout: ``<dir>/params`` = ``{'params': tree}``."""
  tree = {k: v for k, v in jax.device_get(params).items() if k != "rl"}
  path = os.path.join(str(directory), "params")
  with ocp.PyTreeCheckpointer() as ckptr:
    ckptr.save(path, {"params": tree})
  return path


# ------------------------------------------------------------------- tree --
@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_full_tree_is_openpis_lora_tree(name):
  """Full size, abstractly: the LoRA tree is openpi's plus its LoRA paths (gemma_2b_lora
  rank 16, gemma_300m_lora rank 32), and every parameter has logical axes."""
  with open(summary.DEFAULT_SPEC, encoding="utf-8") as f:
    spec = json.load(f)
  config = summary.model_config(name, "full")
  config.lora = "both"
  pol = summary.make_policy(name, "full", config=config)
  got = {p: tuple(x.shape) for p, x in oi.flatten(pol.abstract_params()).items()
         if not p.startswith("rl/")}
  want = {p: tuple(x["shape"]) for p, x in spec["models"][name]["params"].items()}
  want.update({p: tuple(x["shape"])
               for p, x in spec["lora_extra_params_for_pi0_lora_variants"]["params"].items()})
  assert got == want
  axes = oi.flatten(pol.logical_axes())
  abstract = oi.flatten(pol.abstract_params())
  assert set(axes) == set(abstract)
  for p, a in axes.items():
    assert len(a) == len(abstract[p].shape), p


def test_adapters_shard_on_a_mesh():
  """The adapters' logical axes resolve on a mesh (the rank axis unsharded)."""
  config = summary.model_config("pi0", "tiny")
  config.lora = "both"
  pol = summary.make_policy("pi0", "tiny", config=config)
  mesh = sharding.single_device_mesh()
  sh = oi.flatten(sharding.param_shardings(pol.logical_axes(), pol.abstract_params(), mesh,
                                           sharding.DEFAULT_RULES))
  spec = sharding.logical_to_spec(("layers", "heads", "embed", None), sharding.DEFAULT_RULES)
  assert sh["PaliGemma/llm/layers/attn/q_einsum/lora_a"].spec == spec


def test_einsum_equations_are_openpis():
  # openpi's Einsum._make_lora_eqns on the same equations (upper case there).
  assert lora.lora_eqns("btd,ndh->btnh") == ("btd,ndL->btnL", "btnL,nLh->btnh")
  assert lora.lora_eqns("btnh,nhd->btd") == ("btnh,nhL->btL", "btL,nLd->btd")
  # attn_vec's lora_b head axis is summed on its own in the forward pass.
  assert lora.delta_eqn("btnh,nhd->btd") == "nhL,ALd->nhd"
  assert lora.delta_eqn("bsd,ckdh->cbskh") == "ckdL,ckLh->ckdh"


def test_freeze_filter_is_openpis():
  paths = ["PaliGemma/img/embedding/kernel", "PaliGemma/llm/embedder/input_embedding",
           "PaliGemma/llm/layers/attn/q_einsum/w", "PaliGemma/llm/layers/attn/q_einsum_1/w",
           "PaliGemma/llm/layers/mlp_1/linear", "action_in_proj/kernel", "rl/value_out/kernel"]
  llm_a = "PaliGemma/llm/layers/attn/q_einsum/lora_a"
  exp_a = "PaliGemma/llm/layers/mlp_1/linear_lora_a"
  assert lora.trainable_predicate(paths) is None
  for adapters, frozen in (
      ([llm_a], {"PaliGemma/llm/embedder/input_embedding",
                 "PaliGemma/llm/layers/attn/q_einsum/w"}),
      ([exp_a], {"PaliGemma/llm/layers/attn/q_einsum_1/w", "PaliGemma/llm/layers/mlp_1/linear"}),
      ([llm_a, exp_a], {p for p in paths if "/llm/" in p})):
    trainable = lora.trainable_predicate(paths + adapters)
    assert {p for p in paths + adapters if not trainable(p)} == frozen, adapters


# ---------------------------------------------------------------- forward --
@pytest.mark.parametrize("name,choice", [("pi0", "both"), ("pi05", "llm")])
def test_starts_as_base_and_merge_equals_adapted(smoke_config, name, choice):
  """``lora_b = 0`` at init: the adapted model is the base model. With non-zero adapters,
  the merged plain tree (``merge_lora``) computes what the adapted tree computes."""
  env, pol = _policy(smoke_config, choice, name)
  smoke_config.model.lora = "none"
  plain = policy_lib.make_policy(smoke_config.model, env.spec)
  params = pol.init(jax.random.PRNGKey(0))
  batch = pol.prepare(env.observe())
  chain = pol.act(params, batch, jax.random.PRNGKey(1), "train").chain

  def outputs(policy, p):
    ev = policy.evaluate(p, batch, chain)
    return (np.asarray(policy.act(p, batch, jax.random.PRNGKey(2), "eval").actions),
            np.asarray(ev.log_prob), np.asarray(ev.value))

  for a, b in zip(outputs(pol, params), outputs(plain, _without_adapters(params))):
    np.testing.assert_array_equal(a, b)
  adapted = _randomise_adapters(params, 1)
  merged = lora.merge_lora(adapted)
  assert set(oi.flatten(merged)) == set(oi.flatten(plain.abstract_params()))
  out_adapted, out_base = outputs(pol, adapted), outputs(plain, _without_adapters(adapted))
  assert not np.allclose(out_adapted[0], out_base[0], atol=1e-3)  # the adapters matter
  for a, b in zip(out_adapted, outputs(plain, merged)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


# --------------------------------------------------------------- learner --
def test_update_trains_only_adapters_and_heads(smoke_config):
  """A PPO update changes the adapters and the unfrozen rest, no frozen weight, and the
  optimizer state holds moments for the trained parameters only."""
  smoke_config.rl.num_minibatches = 1
  env, pol = _policy(smoke_config, "both")
  params = jax.device_get(pol.init(jax.random.PRNGKey(0)))
  lrn = learner_lib.Learner(pol, smoke_config)
  trained = set(oi.flatten(lrn.trainable.select(params)))
  flat = oi.flatten(params)
  assert {p for p in flat if lora.is_adapter(p)} <= trained
  assert "PaliGemma/llm/layers/mlp/linear" not in trained
  assert "PaliGemma/llm/layers/attn/q_einsum_1/w" not in trained
  assert {"rl/value_out/kernel", "action_out_proj/kernel"} <= trained

  state = learner_lib.init_state(params, lrn.ppo_tx, jax.random.PRNGKey(0))
  n_trained, n_total = lrn.trainable.count(params)
  moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
  assert len(moments) == 2 * len(trained)  # Adam's mu and nu, trained leaves only
  assert sum(x.size for x in moments) == 2 * n_trained < n_total
  smoke_config.model.lora = "none"
  full_lrn = learner_lib.Learner(policy_lib.make_policy(smoke_config.model, env.spec),
                                 smoke_config)
  full_params = _without_adapters(params)
  full_state = jax.eval_shape(lambda p: full_lrn.ppo_tx.init(p), full_params)
  assert sum(x.size for x in jax.tree.leaves(full_state)
             if x.ndim > 0) == 2 * full_lrn.trainable.count(full_params)[1]

  traj = trajectories.sampled(pol, env, params)
  new, metrics = lrn.update(state, traj)
  assert metrics["nonfinite"] == 0
  after = oi.flatten(jax.device_get(new.params))
  changed = {p for p in flat if not np.array_equal(flat[p], after[p])}
  assert changed <= trained and changed
  assert any(p.endswith("lora_b") for p in changed)
  assert all(np.array_equal(flat[p], after[p]) for p in flat if p not in trained)

  # The streamed learner: gradients of the trained parameters only (its program's output
  # tree, traced and not compiled: the update above already ran the same loss).
  grads, _ = jax.eval_shape(
      lambda p, t: update_lib.micro_grads(lrn.objective, smoke_config.rl, p, t, t.num_rows,
                                          0, lrn.rl_trainable), new.params, traj)
  assert set(oi.flatten(grads)) == trained


# ------------------------------------------------------------ checkpoints --
def test_openpi_lora_checkpoint_imports(smoke_config, tmp_path):
  """A checkpoint in openpi's LoRA layout loads with its adapters; the RL heads start fresh."""
  env, pol = _policy(smoke_config, "both")
  written = _randomise_adapters(pol.init(jax.random.PRNGKey(5)), 2)
  path = _write_openpi(tmp_path, written)
  loaded = oi.flatten(jax.device_get(oi.init_params(pol, jax.random.PRNGKey(0), path)))
  want = oi.flatten(written)
  assert set(loaded) == set(want)
  for p in want:
    if not p.startswith("rl/"):
      np.testing.assert_array_equal(loaded[p], want[p], err_msg=p)
  # The same checkpoint into a model without adapters is refused, naming the key.
  smoke_config.model.lora = "none"
  plain = policy_lib.make_policy(smoke_config.model, env.spec)
  with pytest.raises(ValueError, match="lora_a'.*set config.model.lora"):
    oi.init_params(plain, jax.random.PRNGKey(0), path)


def test_plain_checkpoint_into_lora_model(smoke_config, tmp_path):
  """A released (plain) checkpoint into a LoRA model: the adapters are initialised
  (``lora_b = 0``), so the model starts as the checkpoint's."""
  env, pol = _policy(smoke_config, "expert")
  smoke_config.model.lora = "none"
  plain = policy_lib.make_policy(smoke_config.model, env.spec)
  written = jax.device_get(plain.init(jax.random.PRNGKey(5)))
  path = _write_openpi(tmp_path, written)
  loaded = oi.flatten(jax.device_get(oi.init_params(pol, jax.random.PRNGKey(0), path)))
  want = oi.flatten(written)
  adapters = sorted(p for p in loaded if lora.is_adapter(p))
  assert adapters and all("_1" in p for p in adapters)  # the action expert's only
  assert set(loaded) - set(adapters) == set(want)
  for p in adapters:
    assert np.any(loaded[p] != 0) == p.endswith("lora_a"), p
  for p in want:
    if not p.startswith("rl/"):
      np.testing.assert_array_equal(loaded[p], want[p], err_msg=p)


# ----------------------------------------------------------------- config --
@pytest.mark.parametrize("key,value,match", [
    ("lora", "all", "config.model.lora: must be one of"),
    ("lora_rank_llm", 0, "config.model.lora_rank_llm: must be an int >= 1"),
    ("lora_rank_expert", -3, "config.model.lora_rank_expert: must be an int >= 1"),
])
def test_bad_lora_config_names_the_key(smoke_config, key, value, match):
  smoke_config.model[key] = value
  with pytest.raises(ValueError, match=match):
    config_checks.validate(smoke_config)


def test_lora_needs_a_flow_policy(smoke_config):
  smoke_config.model.name = "action_token_vla"
  smoke_config.model.lora = "both"
  with pytest.raises(ValueError, match="config.model.lora: adapters are on the pi0"):
    config_checks.validate(smoke_config)


# ------------------------------------------------------------------ bench --
class _FakeStep:
  """``peak(B)`` of a step: flat until a kink, then linear (full fine-tuning's shape)."""

  def __init__(self, floor: float, kink: int, slope: float):
    self.floor, self.kink, self.slope, self.compiled = floor, kink, slope, []

  def measure(self, b: int) -> dict:
    self.compiled.append(b)
    return dict(peak_gib=self.floor + self.slope * max(b - self.kink, 0))


@pytest.mark.parametrize("floor,kink,slope", [(21.4, 0, 0.64), (75.4, 40, 0.6), (10.0, 3, 7.0)])
def test_bench_memory_finds_the_largest_fitting_batch(floor, kink, slope):
  from jaxvla.bench import memory  # pylint: disable=import-outside-toplevel
  grid = [1, 16, 64, 256]
  for budget in (24.0, 40.0, 80.0):
    step = _FakeStep(floor, kink, slope)
    got = memory.largest_fitting(step, budget, grid)
    fits = [b for b in range(1, 300) if step.measure(b)["peak_gib"] <= budget]
    assert got == (max(fits) if fits else 0), budget
