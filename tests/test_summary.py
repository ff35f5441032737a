"""Parameter summary vs openpi's spec (abstract only), and the benchmark's FLOP counter."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from jaxvla.models import summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = summary.DEFAULT_SPEC


@pytest.fixture(scope="module")
def spec() -> dict:
  if not os.path.exists(SPEC):
    pytest.fail(f"openpi parameter spec not found at {os.path.normpath(SPEC)}; "
                "the full-variant checks need it")
  with open(SPEC) as f:
    return json.load(f)


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def full(request):
  """``(name, policy, summary dict)`` of a full variant, built abstractly."""
  name = request.param
  pol = summary.make_policy(name, "full")
  return name, pol, summary.summarize(name, "full", spec_path=SPEC, policy=pol)


def test_full_total_matches_spec(spec, full):
  name, _, out = full
  assert out["total_params"] == spec["models"][name]["total_params"]
  assert out["num_arrays"] == spec["models"][name]["num_arrays"]
  assert out["matches_openpi_total"] is True


def test_full_split_matches_spec(spec, full):
  name, _, out = full
  split = spec["models"][name]["param_split"]
  assert set(summary.OPENPI_SPLIT_NAMES.values()) == set(split), sorted(split)
  assert summary.split_as_openpi(out["modules"]) == split
  assert sum(out["modules"].values()) == out["total_params"]
  assert out["matches_openpi_split"] is True


def test_full_paths_and_shapes_match_spec(spec, full):
  name, pol, out = full
  theirs = spec["models"][name]["params"]
  ours = {k: tuple(v.shape) for k, v in summary.flatten(pol.abstract_params()).items()
          if not k.startswith("rl/")}
  assert sorted(ours) == sorted(theirs)
  bad = {k: (ours[k], tuple(v["shape"])) for k, v in theirs.items()
         if ours[k] != tuple(v["shape"])}
  assert not bad, bad
  assert summary.spec_mismatches(pol.abstract_params(), theirs) == []
  assert out["matches_openpi_spec"] is True


def test_full_rl_params_are_separate(full):
  _, pol, out = full
  flat = summary.flatten(pol.abstract_params())
  rl = {k: v for k, v in flat.items() if k.startswith("rl/")}
  assert rl and out["rl_params"] > 0
  assert out["rl_params"] == sum(v.size for v in rl.values())
  assert out["rl_modules"] and sum(out["rl_modules"].values()) == out["rl_params"]
  assert out["total_with_rl"] == out["total_params"] + out["rl_params"]
  assert out["total_with_rl"] == sum(v.size for v in flat.values())


def test_spec_mismatch_is_reported(spec):
  """pi05's tree against pi0's spec: named paths, not a silent pass."""
  pol = summary.make_policy("pi05", "full")
  bad = summary.spec_mismatches(pol.abstract_params(), spec["models"]["pi0"]["params"])
  assert any("state_proj" in line for line in bad)
  assert any("time_mlp_in" in line for line in bad)


def test_module_of_names():
  assert summary.module_of("PaliGemma/img/head/kernel") == "multimodal_projector"
  assert summary.module_of("PaliGemma/img/Transformer/encoderblock/LayerNorm_1/bias") == "siglip"
  assert summary.module_of("PaliGemma/llm/layers/mlp_1/linear") == "action_expert"
  assert summary.module_of("PaliGemma/llm/final_norm_1/Dense_0/kernel") == "action_expert"
  assert summary.module_of("PaliGemma/llm/layers/attn/q_einsum/w") == "gemma_llm"
  assert summary.module_of("action_in_proj/kernel") == "action_projections"
  assert summary.module_of("rl/value_out/bias") == "rl"
  with pytest.raises(ValueError, match="PaliGemma/foo"):
    summary.module_of("PaliGemma/foo/x")


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_tiny_summary_runs(name):
  out = summary.summarize(name, "tiny", spec_path=SPEC)
  assert out["total_params"] > 0 and out["rl_params"] > 0
  assert out["matches_openpi_spec"] is None and "full" in out["spec_note"]
  assert all(out["modules"][m] > 0 for m in summary.MODULES)


def test_pi0_fast_summary_without_a_tokenizer(tmp_path):
  """The command works for pi0-FAST with no tokenizer: the full tree is openpi's Pi0FAST
  (a mutated spec is caught), tiny is summarised, and a given directory must exist."""
  full = summary.summarize("pi0_fast", "full")
  assert full["matches_openpi_spec"] is True and "stand-in" in full["fast_tokenizer"]
  assert full["modules"]["action_expert"] == 0 and full["total_params"] > 2.9e9
  with open(summary.FAST_SPEC) as f:
    spec = json.load(f)
  tiny = summary.summarize("pi0_fast", "tiny")
  assert tiny["matches_openpi_spec"] is None and "full" in tiny["spec_note"]
  path = next(iter(spec["full"]))
  spec["full"][path] = [1] + list(spec["full"][path])
  pol = summary.make_policy("pi0_fast", "full")
  (tmp_path / "spec.json").write_text(json.dumps(spec))
  out = summary.fast_summary_spec({}, pol.abstract_params(), str(tmp_path / "spec.json"))
  assert out["matches_openpi_spec"] is False and path in out["spec_mismatches"][0]
  with pytest.raises(ValueError, match="not a directory"):
    summary.make_policy("pi0_fast", "tiny", fast_tokenizer="/nonexistent/fast")


def test_missing_spec_is_reported_not_raised(tmp_path):
  out = summary.summarize("pi0", "tiny", spec_path=str(tmp_path / "none.json"))
  assert out["matches_openpi_spec"] is None and "not found" in out["spec_note"]


def test_flop_counter_counts_scan_iterations():
  """XLA's cost analysis counts a scan body once; the jaxpr counter multiplies by its length."""
  from jaxvla.bench import policy as bench

  def f(w, x):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

  def f_unrolled(w, x):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w, unroll=True)[0]

  w = jax.ShapeDtypeStruct((6, 32, 32), jnp.float32)
  x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
  expected = 6 * 2 * 8 * 32 * 32
  assert bench.model_flops(f, w, x) == expected
  xla_unrolled = bench.xla_flops(jax.jit(f_unrolled).lower(w, x).compile())
  assert xla_unrolled == pytest.approx(expected, rel=0.05)  # + tanh and the like


def test_memory_mode_compiles_every_learner_step():
  """``jaxvla.bench.policy --memory`` (the GPU check's memory step): each learner step's
  memory analysis, BC with its action mask and a PPO update of several minibatches."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from tests import conftest  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run(
      [sys.executable, "-m", "jaxvla.bench.policy", "--memory", "--memory_variant=tiny",
       "--memory_batch=2", "--memory_remat=on", "--memory_steps=bc,ppo",
       "--memory_minibatches=2"], capture_output=True, text=True, cwd=root, timeout=300,
      check=False, env=conftest.fast_xla_env(dict(os.environ)))
  assert r.returncode == 0, r.stderr[-3000:]
  rows = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
  assert [(row["op"], row["minibatches"]) for row in rows] == [("bc_step", 1), ("ppo_update", 2)]
  for row in rows:
    assert row["total_gib"] >= row["argument_gib"] > 0 and row["model_gflop"] > 0
