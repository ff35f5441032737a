"""What a flow policy's frozen features know: ridge probes of the env's hidden state.

``python -m jaxvla.bench.feature_probe --policy=DIR [--step=0] [--targets=13,14]`` loads a
pi0 policy (an export, a run or one of its checkpoints), plays ``--envs`` episodes of its
own env for ``--chunks`` chunks with its evaluation sampler, and fits a ridge regression
from each of the policy's feature sources to the chosen dims of the env's critic state
(ManiSkill3's ``get_state()``: dims 13 and 14 are the cube's x and y in the cube tasks).
It prints the held-out R^2 of each target per source:

* ``state``: the proprioceptive state alone (what the policy reads besides pixels);
* ``expert`` / ``prefix_mean``: the pooled features (pi0's state token, the prefix's
  masked mean) with the state, what the value and steering heads read;
* ``prefix_image``: every image token's decoder output, flattened;
* ``vit``: every image token out of the ViT, flattened;
* ``pixels``: the camera's raw pixels (every third value);
* ``estimate``: where the policy has one (``model.steer_state_estimator``), the state
  estimator's whole reading of the critic state, and ``estimate_direct`` its own dims for
  the targets, mapped back by a least-squares line per dim (what the head reads, with no
  probe's capacity added).

Episodes ``e % 4 == 0`` are held out (all their chunks), the others fit; the ridge
strength is the best of a fixed grid on the held-out set, so the figures are an upper
bound of what a linear read of each source gives. Used in docs/results/maniskill.md
("From pixels").
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from jaxvla.envs import make_vec_env, normalized
from jaxvla.models import contract, pi0, siglip
from jaxvla.storage import policy_io

SOURCES = ("state", "expert", "prefix_mean", "prefix_image", "vit", "pixels")
RIDGE_GRID = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)


def collect(loaded: policy_io.LoadedPolicy, num_envs: int, chunks: int, seed: int,
            targets: list[int]) -> dict[str, np.ndarray]:
  """Each source's features ``[num_envs * chunks, D]``, the targets ``[N, len(targets)]``
  and each row's episode ``[N]``, over ``chunks`` chunks of the evaluation sampler."""
  pol, params, net = loaded.policy, loaded.params, loaded.policy.net
  if not isinstance(net, pi0.Pi0Config):
    raise ValueError(f"{loaded.path} holds a {loaded.config.model.name} policy; the probe "
                     "reads pi0 / pi0.5's features")
  if not loaded.spec.critic_state_dim:
    raise ValueError(f"the env of {loaded.path} gives no critic state to probe "
                     "(config.env.critic_state_dim = 0)")
  by_source = {s: dataclasses.replace(net, value_source=s) for s in ("expert", "prefix")}

  @jax.jit
  def features(params, batch):
    prefix = pol._prefix(params, batch)  # pylint: disable=protected-access
    state = batch["state"]
    b, n = batch["images"].shape[:2]
    vit = siglip.encode(net.vit, params["PaliGemma"]["img"], pi0._images(net, batch["images"]),  # pylint: disable=protected-access
                        dtype=net.compute_dtype)
    tokens = n * vit.shape[1]
    out = dict(expert=pi0.features(by_source["expert"], params, prefix, state),
               prefix_mean=pi0.features(by_source["prefix"], params, prefix, state),
               prefix_image=prefix.hidden[:, :tokens].reshape(b, -1), vit=vit.reshape(b, -1))
    if net.steer_state_estimator:
      out["estimate"] = pi0.estimate_state(net, params, batch["images"],
                                           contract.image_mask(batch))
    return out

  env = normalized.wrap(make_vec_env(loaded.config.env, num_envs, seed, num_workers=0,
                                     step_timeout_s=600.0), loaded.normalizer)
  rows, key = [], jax.random.PRNGKey(seed)
  try:
    obs = env.reset(seed)
    for _ in range(chunks):
      batch = pol.prepare(obs)
      row = {k: np.asarray(v, np.float64) for k, v in features(params, batch).items()}
      row["state"] = np.asarray(batch["state"], np.float64)
      row["pixels"] = obs.images.reshape(num_envs, -1)[:, ::3].astype(np.float64) / 255.0
      row["target"] = obs.critic_state[:, targets].astype(np.float64)
      row["episode"] = np.arange(num_envs)
      rows.append(row)
      key, sub = jax.random.split(key)
      obs = env.step_chunk(np.asarray(pol.act(params, batch, sub, "eval").actions)).obs
  finally:
    env.close()
  out = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
  if "estimate" in out:
    out["estimate_direct"] = out["estimate"][:, targets]
  for pooled in ("expert", "prefix_mean"):  # (the heads read them beside the state)
    out[pooled] = np.concatenate([out[pooled], out["state"]], axis=1)
  return out


def ridge_r2(x: np.ndarray, y: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, float]:
  """Held-out R^2 per target ``[T]`` of the best ridge on the grid, and its strength."""
  mu, sd = x[~test].mean(0), x[~test].std(0) + 1e-6
  xs = (x - mu) / sd
  fit, ym = xs[~test], y[~test].mean(0)
  best = None
  for lam in RIDGE_GRID:
    if fit.shape[1] > fit.shape[0]:  # (the dual form: fewer rows than features)
      w = fit.T @ np.linalg.solve(fit @ fit.T + lam * np.eye(len(fit)), y[~test] - ym)
    else:
      w = np.linalg.solve(fit.T @ fit + lam * np.eye(fit.shape[1]), fit.T @ (y[~test] - ym))
    pred = xs[test] @ w + ym
    r2 = 1 - ((pred - y[test]) ** 2).sum(0) / ((y[test] - y[test].mean(0)) ** 2).sum(0)
    if best is None or r2.mean() > best[0].mean():
      best = (r2, lam)
  return best


def line_r2(x: np.ndarray, y: np.ndarray, test: np.ndarray) -> np.ndarray:
  """Held-out R^2 per target ``[T]`` of one least-squares line per dim, ``y[:, t]`` from
  ``x[:, t]`` alone: how well an estimate in its own (standardised) units tells a dim."""
  r2 = []
  for t in range(y.shape[1]):
    slope, icept = np.polyfit(x[~test, t], y[~test, t], 1)
    pred = slope * x[test, t] + icept
    r2.append(1 - ((pred - y[test, t]) ** 2).sum() / ((y[test, t] - y[test, t].mean()) ** 2).sum())
  return np.asarray(r2)


def main(argv: list[str]) -> None:
  del argv
  loaded = policy_io.load(**POLICY.load_kwargs())
  targets = [int(t) for t in TARGETS.value]
  data = collect(loaded, ENVS.value, CHUNKS.value, SEED.value, targets)
  test = data["episode"] % 4 == 0
  print(json.dumps(dict(policy=loaded.path, samples=int(len(test)), held_out=int(test.sum()),
                        targets=targets, target_std=data["target"].std(0).round(4).tolist())))
  for source in SOURCES + ("estimate",):
    if source not in data:
      continue
    r2, lam = ridge_r2(data[source], data["target"], test)
    print(json.dumps(dict(source=source, dim=int(data[source].shape[1]),
                          r2=[round(float(v), 3) for v in r2], ridge=lam)))
  if "estimate_direct" in data:
    print(json.dumps(dict(source="estimate_direct", dim=len(targets),
                          r2=[round(float(v), 3) for v in line_r2(
                              data["estimate_direct"], data["target"], test)])))


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  POLICY = policy_io.define_flags()
  TARGETS = flags.DEFINE_list("targets", ["13", "14"], "Critic-state dims to predict "
                              "(ManiSkill3 cube tasks: 13, 14 = the cube's x, y).")
  ENVS = flags.DEFINE_integer("envs", 48, "Episodes (one env each).")
  CHUNKS = flags.DEFINE_integer("chunks", 8, "Chunks per episode.")
  SEED = flags.DEFINE_integer("seed", 1234, "Episodes' seed (disjoint from the demos').")
  app.run(main)
