"""The policy server's settings, in code: ``python -m jaxvla.serve [--serve=FILE[:MAP]]``.

``python -m jaxvla.serve`` reads this file by default (``--serve.port=...`` and the like
override a field); ``configs/serve.py`` is the same config for composing your own.

``MAP`` (default ``jaxvla``) picks the observation key map, i.e. what a client
sends: openpi's ``libero``, ``droid`` or ``aloha`` example clients, or ``jaxvla``
(the policy's own camera names). ``--obs_map=NAME`` on the command line picks
one too. Each map says which request key feeds which of the policy's cameras and
state entries; docs/guides/serving.md lists the keys of every map and what they mean.

The maps follow openpi's policy input transforms (``LiberoInputs``,
``DroidInputs``, ``AlohaInputs``): a camera the client does not send is a zero
image whose mask is False, and nested request dicts are read as ``/``-joined
keys (openpi flattens them the same way), so ``{"images": {"cam_high": x}}`` is
the key ``images/cam_high``.
"""

import ml_collections

OBS_MAPS = ("jaxvla", "libero", "droid", "aloha")


def obs_map(name: str) -> ml_collections.ConfigDict:
  """The key map ``name`` (one of :data:`OBS_MAPS`)."""
  if name not in OBS_MAPS:
    raise ValueError(f"unknown obs_map {name!r}; choose one of {list(OBS_MAPS)}")
  m = ml_collections.ConfigDict()
  m.name = name  # Which map this is (sent in the metadata).
  # Request keys of the policy's cameras, in the policy's camera order. Cameras past this
  # list are zero images with their mask False (openpi's padding of a missing camera).
  m.images = ()
  m.images_from_spec = False  # True: the request keys are the policy's camera names.
  m.optional_images = ()  # Keys of `images` a request may leave out (zero image, mask False).
  m.ignored = ()  # Keys accepted and not used (a camera the policy has no slot for).
  m.state = ("state",)  # Request keys concatenated, in order, into the policy's state.
  # Size of each `state` key; 0 for the one key that takes the rest of the policy's state_dim.
  m.state_sizes = (0,)
  m.prompt = "prompt"  # Request key of the instruction (str or UTF-8 bytes).
  m.image_layout = "hwc"  # Layout of example_observation's images: 'hwc' or 'chw' (ALOHA's).
  m.nested = False  # example_observation nests 'a/b' keys as {'a': {'b': ...}} (ALOHA's).
  if name == "jaxvla":
    m.images_from_spec = True
  elif name == "libero":  # openpi's examples/libero/main.py and LiberoInputs.
    m.images = ("observation/image", "observation/wrist_image")
    m.state = ("observation/state",)  # eef position, axis-angle, gripper qpos (8 in LIBERO).
  elif name == "droid":  # openpi's examples/droid/main.py and DroidInputs.
    m.images = ("observation/exterior_image_1_left", "observation/wrist_image_left")
    m.state = ("observation/joint_position", "observation/gripper_position")
    m.state_sizes = (0, 1)  # joints (7 on the Franka) + the gripper's one value
  elif name == "aloha":  # openpi's examples/aloha_real and AlohaInputs.
    m.images = ("images/cam_high", "images/cam_left_wrist", "images/cam_right_wrist")
    m.optional_images = ("images/cam_left_wrist", "images/cam_right_wrist")
    m.ignored = ("images/cam_low",)  # AlohaInputs accepts it and feeds it to no camera.
    m.state = ("state",)  # two arms' 6 joints + gripper (14)
    m.image_layout = "chw"
    m.nested = True
  return m


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The server's settings with key map ``arg`` (default ``jaxvla``)."""
  c = ml_collections.ConfigDict()
  c.host = "0.0.0.0"  # Interface to listen on (openpi's server listens on all of them).
  c.port = 8000  # TCP port (openpi's default; 0 picks a free one, printed at start).
  c.obs_map = obs_map(arg or "jaxvla")  # What a request holds (see obs_map above).
  c.max_batch = 8  # Most requests answered by one batched policy call.
  c.batch_wait_ms = 5.0  # How long the first request of a batch waits for more to join.
  # Sampler of the served actions: 'eval' (the policy's eval_sampler, 'ode' by default),
  # 'train' (its train_sampler) or a sampler name.
  c.sampler = "eval"
  # Initial noise of the sampler: 'fixed' (every request draws it from `seed` alone, so an
  # observation's actions do not depend on what else is in its batch or on request order)
  # or 'per_request' (a new key per request, from `seed` and a request counter, as openpi's
  # server splits its key on each call).
  c.noise = "fixed"
  c.seed = 0  # Seed of the sampler's noise keys.
  c.default_prompt = ""  # Instruction for requests without one ('': a prompt is required).
  c.warmup = True  # Compile every padded batch size before listening (no slow first calls).
  c.max_message_mb = 64.0  # Largest request accepted, in MiB (4 cameras at 224 px: 0.6).
  return c
