"""Per-camera image masks (openpi's ``image_masks``): a masked camera cannot change anything.

For pi0, pi0.5 and the action-token VLA: different random content in a masked camera
gives identical actions, log-probs and values (masks differing between the rows of one
batch), unmasking it changes them, and 2 cameras act as 3 cameras with the third masked
(openpi's LIBERO setup: agentview + wrist, the right-wrist placeholder masked).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvla.envs import protocol
from jaxvla.models import contract, policy as policy_lib

SIZE = 32
CAMERAS = ("agentview", "wrist", "right_wrist")
# Row 0 masks the right wrist, row 1 the wrist, row 2 none, row 3 both wrists.
MASK = np.array([[1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 0, 0]], bool)
FAMILIES = ["pi0", "pi05", "action_token_vla"]


def _spec(num_cameras: int) -> protocol.EnvSpec:
  return protocol.EnvSpec(camera_names=CAMERAS[:num_cameras], image_shape=(SIZE, SIZE, 3),
                          state_dim=3, action_dim=2, max_episode_steps=10)


def _policy(config, name: str, num_cameras: int):
  config.model.name = name
  return policy_lib.make_policy(config.model, _spec(num_cameras))


def _params(pol):
  """Fresh params, perturbed: pi0.5's adaRMS gates start at zero, which would cut the action
  expert off from the prefix (and so from every camera)."""
  params = pol.init(jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x + 0.02 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), params)


def _obs(seed: int, mask: np.ndarray, num_cameras: int = 3) -> protocol.Observation:
  rng = np.random.default_rng(seed)
  b = mask.shape[0]
  return protocol.Observation(
      images=rng.integers(0, 256, (b, num_cameras, SIZE, SIZE, 3), dtype=np.uint8),
      state=rng.uniform(-1, 1, (b, 3)).astype(np.float32),
      instruction=np.array(["move to the blue target"] * b, dtype=object), image_mask=mask)


def _with_content(obs: protocol.Observation, seed: int, where: np.ndarray) -> protocol.Observation:
  """``obs`` with new random images in the cameras ``where`` ``bool [B, N]``."""
  noise = np.random.default_rng(seed).integers(0, 256, obs.images.shape, dtype=np.uint8)
  images = np.where(where[:, :, None, None, None], noise, obs.images)
  return protocol.Observation(images, obs.state, obs.instruction, obs.image_mask)


def _run(pol, params, obs: protocol.Observation) -> dict[str, np.ndarray]:
  """Sampled actions / log-probs / values, and the first batch's chain evaluated on ``obs``."""
  batch = pol.prepare(obs)
  out = jax.jit(pol.act, static_argnames="mode")(params, batch, jax.random.PRNGKey(7),
                                                 mode="train")
  ev = jax.jit(pol.evaluate)(params, batch, out.chain)
  return dict(actions=out.actions, log_prob=out.log_prob, value=out.value,
              eval_log_prob=ev.log_prob, eval_value=ev.value)


@pytest.mark.parametrize("name", FAMILIES)
def test_masked_camera_content_cannot_change_the_policy(smoke_config, name):
  pol = _policy(smoke_config, name, 3)
  params = _params(pol)
  obs = _obs(0, MASK)
  base = _run(pol, params, obs)
  same = _run(pol, params, _with_content(obs, 1, ~MASK))
  for key in base:
    np.testing.assert_array_equal(np.asarray(base[key]), np.asarray(same[key]), err_msg=key)
  # The same content change in visible cameras does change the outputs...
  unmasked = protocol.Observation(obs.images, obs.state, obs.instruction, np.ones_like(MASK))
  a = _run(pol, params, unmasked)
  b = _run(pol, params, _with_content(unmasked, 1, ~MASK))
  changed = ~np.isclose(np.asarray(a["value"]), np.asarray(b["value"]), rtol=0, atol=1e-7)
  assert changed[MASK.all(1) == 0].all(), (a["value"], b["value"])  # rows that had a mask
  # (A flow's sampled chain has the log-prob of its noise draws whatever the mean, up to
  # rounding, so its change shows in the actions; an action token's in its log-prob.)
  assert any(not np.array_equal(np.asarray(a[k]), np.asarray(b[k]))
             for k in ("actions", "log_prob")), (a["actions"], b["actions"])
  # ... and unmasking a camera changes what the policy sees.
  assert not np.allclose(np.asarray(base["value"]), np.asarray(a["value"]))


@pytest.mark.parametrize("name", FAMILIES)
def test_two_cameras_equal_three_with_the_third_masked(smoke_config, name):
  """openpi's LIBERO setup: a policy fed a masked placeholder acts as with two cameras."""
  pol3 = _policy(smoke_config, name, 3)
  pol2 = _policy(smoke_config, name, 2)
  params = _params(pol3)
  obs3 = _obs(2, np.array([[1, 1, 0]] * 3, bool))
  obs2 = protocol.Observation(obs3.images[:, :2], obs3.state, obs3.instruction)
  three, two = _run(pol3, params, obs3), _run(pol2, params, obs2)
  for key in three:
    np.testing.assert_allclose(np.asarray(three[key]), np.asarray(two[key]), rtol=1e-5,
                               atol=1e-5, err_msg=key)


def test_a_batch_without_image_mask_is_an_error(smoke_config):
  pol = _policy(smoke_config, "pi0", 3)
  batch = pol.prepare(_obs(0, MASK))
  assert batch["image_mask"].shape == (4, 3) and batch["image_mask"].dtype == bool
  del batch["image_mask"]
  with pytest.raises(KeyError, match="image_mask"):
    contract.image_mask(batch)
  with pytest.raises(KeyError, match="image_mask"):
    pol.value(pol.init(jax.random.PRNGKey(0)), batch)
