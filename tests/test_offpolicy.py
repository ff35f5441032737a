"""Off-policy corrections of the PPO loss and GRPO's pieces against NumPy references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvla.algorithms import grpo, ppo

CLIP_EPS, VALUE_COEF, ENTROPY_COEF = 0.2, 0.5, 0.01
# (correction, is_clip, behaviour_clip): decoupled is checked with and without
# truncation, and with the behaviour's trust region.
CASES = [("none", 0.0, 0.0), ("decoupled", 0.0, 0.0), ("decoupled", 1.3, 0.0),
         ("decoupled", 1.3, 1.5), ("truncated_is", 1.3, 0.0)]
METRICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "is_weight",
           "is_truncated_frac", "behaviour_clip_frac", "log_ratio_abs")


def make_inputs(n, seed=0):
  """Random chunk inputs: new/old/proximal log-probs, advantages, values, returns, entropy."""
  rng = np.random.default_rng(seed)
  old = rng.normal(size=n)
  prox = old + 0.4 * rng.normal(size=n)
  new = prox + 0.3 * rng.normal(size=n)
  adv, val, ret, ent = (rng.normal(size=n) for _ in range(4))
  w = rng.random(n)
  return dict(new=new, old=old, prox=prox, adv=adv, val=val, ret=ret, ent=ent,
              w=w / w.sum())


def numpy_ppo(d, correction, is_clip, behaviour_clip=0.0, is_clip_mode="truncate"):
  """Reference loss, metrics and d loss / d new_log_prob."""
  new, old, prox, adv, w = d["new"], d["old"], d["prox"], d["adv"], d["w"]
  ref = prox if correction == "decoupled" else old
  ratio = np.exp(new - ref)
  if correction == "truncated_is":
    rho = np.minimum(ratio, is_clip)
    truncated = ratio > is_clip
    pg_terms = -rho * adv * new
    grad = -w * rho * adv
  else:
    if correction == "decoupled":
      raw = np.exp(prox - old)
      rho = np.minimum(raw, is_clip) if is_clip > 0 else raw
      truncated = raw > is_clip if is_clip > 0 else np.zeros_like(raw, bool)
      if is_clip_mode == "drop":  # RLinf's behave_weight_threshold: out of the loss.
        rho = np.where(truncated, 0.0, raw)
    else:
      rho, truncated = np.ones_like(ratio), np.zeros_like(ratio, bool)
    unclipped = ratio * adv
    clipped = np.clip(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS) * adv
    pg_terms = -rho * np.minimum(unclipped, clipped)
    # The unclipped branch carries the gradient where it is the minimum; clipped: none.
    grad = -w * rho * unclipped * (unclipped <= clipped)
  held = np.zeros_like(ratio, bool)
  if behaviour_clip > 0:  # Moved past the factor in the advantage's direction: held.
    moved = new - old
    held = ((moved > np.log(behaviour_clip)) & (adv > 0)) | (
        (moved < -np.log(behaviour_clip)) & (adv < 0))
    grad = np.where(held, 0.0, grad)
  metrics = dict(
      policy_loss=np.sum(w * pg_terms), value_loss=0.5 * np.sum(w * (d["val"] - d["ret"]) ** 2),
      entropy=np.sum(w * d["ent"]), approx_kl=np.sum(w * (ratio - 1 - np.log(ratio))),
      clip_frac=np.sum(w * (np.abs(ratio - 1) > CLIP_EPS)), is_weight=np.sum(w * rho),
      is_truncated_frac=np.sum(w * truncated), behaviour_clip_frac=np.sum(w * held),
      log_ratio_abs=np.sum(w * np.abs(new - ref)))
  loss = (metrics["policy_loss"] + VALUE_COEF * metrics["value_loss"]
          - ENTROPY_COEF * metrics["entropy"])
  return loss, metrics, grad


def jax_ppo(d, correction, is_clip, behaviour_clip=0.0, weights="w", is_clip_mode="truncate"):
  """Loss, metrics and gradients w.r.t. (new_log_prob, new_value, entropy)."""
  f32 = lambda k: jnp.asarray(d[k], jnp.float32)
  w = None if weights is None else f32(weights)

  def loss_fn(new, val, ent):
    return ppo.ppo_loss(new, f32("old"), f32("adv"), val, f32("ret"), ent, clip_eps=CLIP_EPS,
                        value_coef=VALUE_COEF, entropy_coef=ENTROPY_COEF, weights=w,
                        correction=correction, proximal_log_prob=f32("prox"), is_clip=is_clip,
                        behaviour_clip=behaviour_clip, is_clip_mode=is_clip_mode)

  (loss, metrics), grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)(
      f32("new"), f32("val"), f32("ent"))
  return loss, metrics, grads


def test_dropped_weights_match_numpy():
  """rl.is_clip_mode='drop': a chunk whose behaviour -> proximal weight exceeds is_clip
  leaves the policy loss and its gradient (RLinf's behave_weight_threshold); the rest is
  the truncating correction's."""
  d = make_inputs(64)
  loss, metrics, (g_new, _, _) = jax_ppo(d, "decoupled", 1.3, 1.5, is_clip_mode="drop")
  ref_loss, ref_metrics, ref_grad = numpy_ppo(d, "decoupled", 1.3, 1.5, is_clip_mode="drop")
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
  for k in METRICS:
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(g_new, ref_grad, rtol=1e-5, atol=1e-7)
  dropped = np.exp(d["prox"] - d["old"]) > 1.3
  assert dropped.any() and not dropped.all() and np.all(np.asarray(g_new)[dropped] == 0)
  with pytest.raises(ValueError, match="config.rl.is_clip_mode"):
    jax_ppo(d, "decoupled", 1.3, is_clip_mode="clip")


@pytest.mark.parametrize("correction,is_clip,behaviour_clip", CASES)
def test_corrections_match_numpy(correction, is_clip, behaviour_clip):
  d = make_inputs(64)
  loss, metrics, (g_new, g_val, g_ent) = jax_ppo(d, correction, is_clip, behaviour_clip)
  ref_loss, ref_metrics, ref_grad = numpy_ppo(d, correction, is_clip, behaviour_clip)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
  for k in METRICS:
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(g_new, ref_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(g_val, VALUE_COEF * d["w"] * (d["val"] - d["ret"]), rtol=1e-5,
                             atol=1e-7)
  np.testing.assert_allclose(g_ent, -ENTROPY_COEF * d["w"], rtol=1e-5)
  if is_clip > 0:  # The case must exercise truncation, or it checks nothing about it.
    assert 0 < ref_metrics["is_truncated_frac"] < 1
  if behaviour_clip > 0:  # And the trust region must hold some chunks, not all.
    assert 0 < ref_metrics["behaviour_clip_frac"] < 1


@pytest.mark.parametrize("correction,is_clip,behaviour_clip", CASES)
def test_weights_none_is_the_mean(correction, is_clip, behaviour_clip):
  d = make_inputs(48, seed=1)
  d["uniform"] = np.full(48, 1 / 48)
  loss, metrics, grads = jax_ppo(d, correction, is_clip, behaviour_clip, weights=None)
  ref_loss, ref_metrics, ref_grads = jax_ppo(d, correction, is_clip, behaviour_clip,
                                             weights="uniform")
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for k in METRICS:
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-6, atol=1e-7, err_msg=k)
  for g, ref in zip(grads, ref_grads):
    np.testing.assert_allclose(g, ref, rtol=1e-6)
  if correction == "none":
    np.testing.assert_allclose(metrics["is_weight"], 1.0, rtol=1e-6)
    assert float(metrics["is_truncated_frac"]) == 0.0


@pytest.mark.parametrize("correction,is_clip,behaviour_clip", CASES)
def test_micro_batches_add_up_to_the_batch(correction, is_clip, behaviour_clip):
  d = make_inputs(40, seed=2)
  h = 17  # Uneven halves: the weights are global, not per micro-batch.
  first = {k: v[:h] for k, v in d.items()}
  second = {k: v[h:] for k, v in d.items()}
  loss, metrics, grads = jax_ppo(d, correction, is_clip, behaviour_clip)
  loss_a, metrics_a, grads_a = jax_ppo(first, correction, is_clip, behaviour_clip)
  loss_b, metrics_b, grads_b = jax_ppo(second, correction, is_clip, behaviour_clip)
  np.testing.assert_allclose(loss, loss_a + loss_b, rtol=1e-5, atol=1e-7)
  for k in METRICS:
    np.testing.assert_allclose(metrics[k], metrics_a[k] + metrics_b[k], rtol=1e-5, atol=1e-7,
                               err_msg=k)
  for g, ga, gb in zip(grads, grads_a, grads_b):
    np.testing.assert_allclose(g, np.concatenate([ga, gb]), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("correction,is_clip,behaviour_clip", CASES)
def test_zero_weight_padding_contributes_nothing(correction, is_clip, behaviour_clip):
  d = make_inputs(16, seed=3)
  pad = make_inputs(8, seed=4)
  pad["new"] = pad["old"] + 1000.0  # exp overflows to inf in float32.
  pad["prox"] = pad["old"] + 500.0
  pad["adv"] = np.full(8, 1e6)
  pad["w"] = np.zeros(8)
  padded = {k: np.concatenate([d[k], pad[k]]) for k in d}
  loss, metrics, grads = jax_ppo(padded, correction, is_clip, behaviour_clip)
  ref_loss, ref_metrics, ref_grads = jax_ppo(d, correction, is_clip, behaviour_clip)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for k in METRICS:
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-6, atol=1e-9, err_msg=k)
  for g, ref in zip(grads, ref_grads):
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g[16:], 0.0)
    np.testing.assert_allclose(g[:16], ref, rtol=1e-6)


def test_decoupled_on_proximal_data_is_plain_ppo():
  d = make_inputs(32, seed=5)
  d["old"] = d["prox"]  # Behaviour = proximal: the behaviour weight is exactly 1.
  loss, metrics, grads = jax_ppo(d, "decoupled", 1.3)
  ref_loss, ref_metrics, ref_grads = jax_ppo(d, "none", 0.0)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(metrics["is_weight"], 1.0, rtol=1e-6)
  for g, ref in zip(grads, ref_grads):
    np.testing.assert_allclose(g, ref, rtol=1e-6)


def per_term_inputs(n, m, seed):
  """``make_inputs`` with ``[n, m]`` log-probs (the chunk's terms) and ``[n]`` the rest."""
  d = make_inputs(n * m, seed)
  for k in ("new", "old", "prox"):
    d[k] = d[k].reshape(n, m)
  d.update({k: v for k, v in make_inputs(n, seed + 1).items() if k not in ("new", "old", "prox")})
  return d


@pytest.mark.parametrize("correction,is_clip,behaviour_clip", CASES)
def test_per_term_ratios_match_numpy(correction, is_clip, behaviour_clip):
  """``[N, M]`` log-probs: every term is a chunk of the NumPy reference with its chunk's
  advantage; the policy loss and KL are sums over a chunk's terms, the fractions and
  the mean weight means over them (the terms' weights ``w / M``)."""
  n, m = 24, 5
  d = per_term_inputs(n, m, seed=8)
  loss, metrics, (g_new, _, _) = jax_ppo(d, correction, is_clip, behaviour_clip)
  per_term = ("new", "old", "prox")
  flat = {k: d[k].reshape(-1) if k in per_term else np.repeat(d[k], m) for k in d}
  _, summed, grad = numpy_ppo(flat, correction, is_clip, behaviour_clip)
  _, averaged, _ = numpy_ppo(dict(flat, w=flat["w"] / m), correction, is_clip, behaviour_clip)
  for k in ("policy_loss", "approx_kl"):
    np.testing.assert_allclose(metrics[k], summed[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for k in ("clip_frac", "is_weight", "is_truncated_frac", "behaviour_clip_frac",
            "log_ratio_abs"):
    np.testing.assert_allclose(metrics[k], averaged[k], rtol=1e-5, atol=1e-6, err_msg=k)
  value_loss = 0.5 * np.sum(d["w"] * (d["val"] - d["ret"]) ** 2)  # Per chunk, as before.
  np.testing.assert_allclose(metrics["value_loss"], value_loss, rtol=1e-5)
  np.testing.assert_allclose(metrics["entropy"], np.sum(d["w"] * d["ent"]), rtol=1e-5)
  np.testing.assert_allclose(
      loss, summed["policy_loss"] + VALUE_COEF * value_loss
      - ENTROPY_COEF * np.sum(d["w"] * d["ent"]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_new, grad.reshape(n, m), rtol=1e-5, atol=1e-7)
  if behaviour_clip > 0:  # Some terms of a chunk held and others not.
    assert 0 < averaged["behaviour_clip_frac"] < 1


def numpy_term_corrected(d, is_clip, behaviour_clip):
  """Reference of ``rl.ratio='per_term_correction'``: the chunk's ratio and clip, the
  decoupled weights and behaviour clip per term. Metrics and d loss / d new ``[n, m]``."""
  new, old, prox, adv, w = d["new"], d["old"], d["prox"], d["adv"], d["w"]
  r = np.exp((new - prox).sum(-1))
  unclipped, clipped = r * adv, np.clip(r, 1 - CLIP_EPS, 1 + CLIP_EPS) * adv
  raw = np.exp(prox - old)
  wt = np.minimum(raw, is_clip) if is_clip > 0 else raw
  truncated = raw > is_clip if is_clip > 0 else np.zeros_like(raw, bool)
  held = np.zeros_like(new, bool)
  if behaviour_clip > 0:
    moved, a = new - old, adv[:, None]
    held = ((moved > np.log(behaviour_clip)) & (a > 0)) | (
        (moved < -np.log(behaviour_clip)) & (a < 0))
  grad = -w[:, None] * wt * np.where(unclipped <= clipped, unclipped, 0.0)[:, None] * ~held
  metrics = dict(
      policy_loss=np.sum(w * -wt.mean(-1) * np.minimum(unclipped, clipped)),
      approx_kl=np.sum(w * (r - 1 - np.log(r))), clip_frac=np.sum(w * (np.abs(r - 1) > CLIP_EPS)),
      is_weight=np.sum(w * wt.mean(-1)), is_truncated_frac=np.sum(w * truncated.mean(-1)),
      behaviour_clip_frac=np.sum(w * held.mean(-1)),
      log_ratio_abs=np.sum(w * np.abs(np.log(r))))
  return metrics, grad


@pytest.mark.parametrize("is_clip,behaviour_clip", [(0.0, 0.0), (1.3, 0.0), (1.3, 1.5)])
def test_per_term_correction_matches_numpy(is_clip, behaviour_clip):
  d = per_term_inputs(32, 4, seed=11)
  d["new"] = d["prox"] + 0.05 * np.random.default_rng(12).normal(size=d["prox"].shape)
  f32 = lambda k: jnp.asarray(d[k], jnp.float32)
  loss_fn = lambda new: ppo.ppo_loss(
      new, f32("old"), f32("adv"), f32("val"), f32("ret"), f32("ent"), clip_eps=CLIP_EPS,
      value_coef=VALUE_COEF, entropy_coef=ENTROPY_COEF, weights=f32("w"),
      correction="decoupled", proximal_log_prob=f32("prox"), is_clip=is_clip,
      behaviour_clip=behaviour_clip, term_ratio=False)
  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(f32("new"))
  ref, ref_grad = numpy_term_corrected(d, is_clip, behaviour_clip)
  for k, v in ref.items():
    np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(
      loss, ref["policy_loss"] + VALUE_COEF * 0.5 * np.sum(d["w"] * (d["val"] - d["ret"]) ** 2)
      - ENTROPY_COEF * np.sum(d["w"] * d["ent"]), rtol=1e-5, atol=1e-6)
  assert 0 < ref["clip_frac"] < 1  # Some chunks clipped (the chunk's ratio), some not.
  if is_clip > 0:
    assert 0 < ref["is_truncated_frac"] < 1
  if behaviour_clip > 0:
    assert 0 < ref["behaviour_clip_frac"] < 1
  with pytest.raises(ValueError, match="correction 'none'"):
    ppo.ppo_loss(f32("new"), f32("old"), f32("adv"), f32("val"), f32("ret"), f32("ent"),
                 clip_eps=CLIP_EPS, value_coef=0.0, entropy_coef=0.0, correction="none",
                 term_ratio=False)


@pytest.mark.parametrize("correction,term_ratio", [("none", True), ("decoupled", True),
                                                   ("decoupled", False)])
def test_per_term_on_fresh_data_has_the_joint_gradient(correction, term_ratio):
  """Behaviour = proximal = current params: the per-term loss's gradient with respect to
  what the terms depend on is the joint ratio's (the sum of the terms' gradients), for
  both per-term ratios (``term_ratio``: 'per_term'; without: 'per_term_correction')."""
  rng = np.random.default_rng(10)
  n, m = 16, 6
  old = jnp.asarray(rng.normal(size=(n, m)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=n), jnp.float32)
  zeros = jnp.zeros(n)
  kw = dict(clip_eps=CLIP_EPS, value_coef=0.0, entropy_coef=0.0, correction=correction,
            is_clip=2.0 if correction == "decoupled" else 0.0,
            behaviour_clip=2.0 if correction == "decoupled" else 0.0)
  per_term = lambda t: ppo.ppo_loss(t, old, adv, zeros, zeros, zeros,
                                    proximal_log_prob=old, term_ratio=term_ratio, **kw)[0]
  joint = lambda t: ppo.ppo_loss(t.sum(-1), old.sum(-1), adv, zeros, zeros, zeros,
                                 proximal_log_prob=old.sum(-1), **kw)[0]
  # (The values differ: each of a chunk's M terms adds its ratio, 1 here, times A.)
  np.testing.assert_allclose(jax.grad(per_term)(old), jax.grad(joint)(old), rtol=1e-6)
  if not term_ratio:  # And at a later step of the update (ratios off 1, some clipped).
    moved = old + 0.1 * jnp.asarray(rng.normal(size=(n, m)), jnp.float32)
    np.testing.assert_allclose(jax.grad(per_term)(moved), jax.grad(joint)(moved), rtol=1e-6)
  with pytest.raises(ValueError, match=r"behaviour \(4,\) and current \(4, 2\)"):
    ppo.ppo_loss(jnp.zeros((4, 2)), jnp.zeros(4), jnp.zeros(4), jnp.zeros(4), jnp.zeros(4),
                 jnp.zeros(4), **kw, proximal_log_prob=jnp.zeros((4, 2)))


def test_bad_arguments_are_named():
  x = jnp.zeros(4)
  loss = functools.partial(ppo.ppo_loss, x, x, x, x, x, x, clip_eps=0.2, value_coef=0.5,
                           entropy_coef=0.0)
  with pytest.raises(ValueError, match="'bogus'"):
    loss(correction="bogus")
  with pytest.raises(ValueError, match="proximal_log_prob"):
    loss(correction="decoupled")
  with pytest.raises(ValueError, match="is_clip"):
    loss(correction="truncated_is", is_clip=0.0)
  with pytest.raises(ValueError, match=r"rl.behaviour_clip must be 0 \(off\) or > 1, got 0.5"):
    loss(correction="decoupled", proximal_log_prob=x, behaviour_clip=0.5)
  with pytest.raises(ValueError, match="'bogus'.*chunks"):
    grpo.chunk_weights(np.ones((2, 3), bool), "bogus")
  with pytest.raises(ValueError, match="config.rl.ratio must be one of"):
    ppo.check_ratio("tokens")


def test_loss_kwargs_read_the_rl_config():
  from configs import default
  cfg = default.get_config().rl
  cfg.correction, cfg.is_clip, cfg.behaviour_clip = "truncated_is", 2.0, 3.0
  kwargs = ppo.loss_kwargs(cfg)
  assert (kwargs["correction"], kwargs["is_clip"], kwargs["behaviour_clip"]) == (
      "truncated_is", 2.0, 3.0)


def numpy_group_advantages(returns, groups, valid, scale, eps):
  adv = np.zeros_like(returns)
  for g in np.unique(groups):
    members = (groups == g) & valid
    if members.sum() < 2:
      continue
    r = returns[members]
    adv[members] = (r - r.mean()) / (r.std() + eps) if scale else r - r.mean()
  return adv


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_numpy(scale):
  rng = np.random.default_rng(6)
  num_groups, size = 6, 4
  groups = np.repeat(np.arange(num_groups), size)
  returns = rng.normal(size=groups.size).astype(np.float32)
  valid = rng.random(groups.size) < 0.8
  valid[groups == 1] = [True, False, False, False]  # Single valid member: advantage 0.
  valid[groups == 2] = False  # No valid member.
  valid[groups == 3] = True
  returns[~valid] = np.nan  # Padding may hold anything.
  fn = jax.jit(grpo.group_advantages, static_argnums=2, static_argnames="scale")
  adv = fn(returns, groups.astype(np.int32), num_groups, scale=scale, valid=valid)
  ref = numpy_group_advantages(returns, groups, valid, scale, 1e-6)
  np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(adv)[~valid] == 0.0)
  assert np.all(np.asarray(adv)[groups == 1] == 0.0)


def test_group_advantages_all_valid_and_shuffled_groups():
  rng = np.random.default_rng(7)
  groups = rng.permutation(np.repeat(np.arange(5), 3))
  returns = rng.normal(size=15)
  adv = grpo.group_advantages(returns, groups, 5)
  ref = numpy_group_advantages(returns, groups, np.ones(15, bool), True, 1e-6)
  np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-6)
  same = grpo.group_advantages(np.ones(4), np.zeros(4, np.int32), 1)
  np.testing.assert_array_equal(same, 0.0)  # Equal returns: no signal, no NaN.


def test_chunk_weights_normalizers():
  k = 4
  mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
  lengths = mask.sum(1).astype(np.float64)  # [4, 2, 0, 1]; 3 non-empty episodes.
  per_episode = {
      "chunks": np.full(4, 1 / 7),
      "trajectory": np.array([1 / 4, 1 / 2, 0.0, 1.0]) / 3,
      "constant": np.full(4, 1 / (k * 3)),
  }
  for name, row in per_episode.items():
    w = np.asarray(grpo.chunk_weights(mask, name))
    assert w.dtype == np.float32
    np.testing.assert_allclose(w, mask * row[:, None], rtol=1e-6, err_msg=name)
    expected_sum = lengths[lengths > 0].mean() / k if name == "constant" else 1.0
    np.testing.assert_allclose(w.sum(), expected_sum, rtol=1e-6, err_msg=name)
  for name in grpo.NORMALIZERS:  # Nothing valid: zero weights, not NaN.
    np.testing.assert_array_equal(grpo.chunk_weights(np.zeros((2, 3), bool), name), 0.0)
