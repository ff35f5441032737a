"""The policy server (jaxvla.serve) against openpi's own client, on loopback.

Checked, with ``openpi_client.websocket_client_policy.WebsocketClientPolicy``
and a tiny pi0 export (three cameras, state 8, action 7, off-centre norm stats)
served with openpi's LIBERO keys:

* the metadata names every key with its shape, and its ``example_observation``
  sent back as is gets ``actions [H, A]``;
* the actions equal the policy's own eval ``act`` on the same observation with
  ``PRNGKey(seed)``, through the normaliser, the right-wrist camera a zero image
  with its mask False (and differ from acting with it unmasked), images resized by
  openpi_client's ``resize_with_pad``;
* concurrent clients get those same per-observation answers and share batched
  calls (a call with more than one request);
* a malformed request (missing key, wrong shape, not a dict, not msgpack) gets
  an error reply naming the key, and that connection and the others go on;
* a client that disconnects mid-request leaves the server serving;
* ``python -m jaxvla.serve`` serves and stops on Ctrl-C;
* a pi0-FAST export (its FAST tokenizer beside it) answers the client with the actions of
  its greedy tokens, well-formed after a few BC steps, equal to its own eval ``act``'s;
* the wire format is openpi_client.msgpack_numpy's byte for byte; the DROID,
  ALOHA and jaxvla key maps read their clients' requests; a map that does not fit
  the policy fails at start naming both.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import websockets.sync.client
from openpi_client import image_tools, msgpack_numpy
from openpi_client import websocket_client_policy as openpi_client

from configs import default, serve as serve_configs
from jaxvla import serve
from jaxvla.bench import serve as bench_serve
from jaxvla.data import norm_stats
from jaxvla.envs import protocol
from jaxvla.models import fast_tokenizer as fast_lib
from jaxvla.models import policy as policy_lib
from jaxvla.serving import obs_map as obs_map_lib
from jaxvla.serving import runner as runner_lib
from jaxvla.serving import server as server_lib
from jaxvla.serving import wire
from jaxvla.storage import checkpoint, policy_io

# openpi_client 0.1.2 connects without a context manager, which websockets 15+ deprecates;
# the warning is the client's, not the server's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = protocol.EnvSpec(("agentview", "wrist", "right_wrist"), (16, 16, 3), 8, 7, 10)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> str:
  c = default.get_config("smoke")
  policy = policy_lib.make_policy(c.model, SPEC)
  path = checkpoint.export_policy(str(tmp_path_factory.mktemp("serve") / "export"),
                                  policy.init(jax.random.PRNGKey(3)), c.to_json_best_effort())
  policy_io.write_spec(path, SPEC)
  # Off-centre statistics: a server that skipped them would answer differently.
  norm_stats.save_normalizer(path, norm_stats.Normalizer(dict(
      state=norm_stats.NormStats(np.linspace(-0.5, 0.5, 8), np.full(8, 0.3)),
      actions=norm_stats.NormStats(np.full(7, 0.4), np.full(7, 2.0))), "zscore"))
  return path


@pytest.fixture(scope="module")
def served(export_dir):
  loaded = policy_io.load(export_dir)
  config = serve.serve_config(serve_configs.get_config("libero"), host="127.0.0.1", port=0,
                              max_batch=4, batch_wait_ms=100.0)
  server = server_lib.PolicyServer(loaded, config)
  port = server.start()
  yield loaded, server, port
  server.close()


def _request(seed: int, size: int = 224) -> dict:
  """What openpi's LIBERO client sends: uint8 images, 8-d state, a prompt."""
  rng = np.random.default_rng(seed)
  return {"observation/image": rng.integers(0, 256, (size, size, 3), np.uint8),
          "observation/wrist_image": rng.integers(0, 256, (size, size, 3), np.uint8),
          "observation/state": rng.normal(size=8),
          "prompt": "move to the red target"}


def _own_act(loaded: policy_io.LoadedPolicy, request: dict, mask_right: bool = True) -> np.ndarray:
  """The policy's eval act on ``request``, built independently of the server: ``[H, A]``.

  ``mask_right``: the right-wrist placeholder's mask False (openpi's LIBERO input).
  """
  obs = _observation(loaded.normalizer, request, mask_right)
  act = jax.jit(functools.partial(loaded.policy.act, mode="eval"))  # The policy's own.
  out = act(loaded.params, loaded.policy.prepare(obs), jax.random.PRNGKey(0))
  return loaded.normalizer.actions(np.asarray(out.actions[0]))


def _observation(normalizer: norm_stats.Normalizer, request: dict,
                 mask_right: bool = True) -> protocol.Observation:
  """What the policy sees of a LIBERO request (one row), built without the server."""
  h, w, _ = SPEC.image_shape
  cams = [image_tools.resize_with_pad(request[k], h, w)
          for k in ("observation/image", "observation/wrist_image")]
  return protocol.Observation(
      images=np.stack(cams + [np.zeros_like(cams[0])])[None],
      state=normalizer.state(np.asarray(request["observation/state"], np.float32)[None]),
      instruction=np.array([request["prompt"]], object),
      image_mask=np.array([[True, True, not mask_right]]))


def test_metadata_example_round_trip_and_the_policys_own_actions(served):
  loaded, _, port = served
  client = openpi_client.WebsocketClientPolicy("127.0.0.1", port)
  meta = client.get_server_metadata()
  assert meta["observation"]["observation/image"]["shape"] == [16, 16, 3]
  assert meta["observation"]["observation/state"]["shape"] == [8]
  assert meta["observation"]["prompt"]["dtype"] == "str"
  assert meta["masked_cameras"] == ["right_wrist"]
  assert meta["actions"]["shape"] == [5, 7]
  out = client.infer(meta["example_observation"])
  assert out["actions"].shape == (5, 7) and out["actions"].dtype == np.float32
  assert {"infer_ms", "queue_ms"} <= set(out["server_timing"])
  assert out["policy_timing"]["batch_size"] >= 1

  request = _request(0)
  want = _own_act(loaded, request)
  got = client.infer(request)["actions"]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # (the mask reaches the policy: the placeholder camera seen as real acts differently)
  assert not np.allclose(got, _own_act(loaded, request, mask_right=False), atol=1e-4)
  np.testing.assert_array_equal(client.infer(request)["actions"], got)  # fixed noise
  # openpi's convention: an image sent channels first means the same.
  chw = dict(request, **{"observation/image": request["observation/image"].transpose(2, 0, 1)})
  np.testing.assert_array_equal(client.infer(chw)["actions"], got)
  assert client.infer(_request(1))["actions"].tolist() != got.tolist()


def test_concurrent_clients_share_batched_calls_and_get_their_own_answers(served):
  loaded, server, port = served
  n = 6
  want = [_own_act(loaded, _request(10 + i)) for i in range(n)]
  clients = [openpi_client.WebsocketClientPolicy("127.0.0.1", port) for _ in range(n)]
  barrier, got, errors = threading.Barrier(n), {}, []
  calls_before = server.batcher.stats()["calls"]

  def run(i):
    try:
      for r in range(3):
        barrier.wait(timeout=30)  # All clients send each round at once.
        got[i, r] = clients[i].infer(_request(10 + i))["actions"]
    except Exception as e:  # (re-raised below, in the test's thread)
      errors.append(e)
      barrier.abort()

  threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not errors, errors
  for (i, _), actions in got.items():
    np.testing.assert_allclose(actions, want[i], rtol=1e-5, atol=1e-5)
  stats = server.batcher.stats()
  assert stats["max_batch_size"] > 1
  assert stats["calls"] - calls_before < 3 * n  # (some calls answered several clients)


def test_malformed_requests_get_an_error_and_the_server_goes_on(served):
  _, _, port = served
  client = openpi_client.WebsocketClientPolicy("127.0.0.1", port)
  good = _request(2)
  missing = {k: v for k, v in good.items() if k != "observation/wrist_image"}
  with pytest.raises(RuntimeError, match=r"'observation/wrist_image' \(expected uint8"):
    client.infer(missing)
  with pytest.raises(RuntimeError, match=r"'observation/state' has shape \[7\]; expected float \[8\]"):
    client.infer(dict(good, **{"observation/state": np.zeros(7)}))
  with pytest.raises(RuntimeError, match=r"'observation/image' has shape \[16, 16\]"):
    client.infer(dict(good, **{"observation/image": np.zeros((16, 16), np.uint8)}))
  with pytest.raises(RuntimeError, match="must be a dict"):
    client.infer([1, 2, 3])
  with pytest.raises(RuntimeError, match=r"unknown key\(s\) \['observation/imgae'\]"):
    client.infer(dict(good, **{"observation/imgae": good["observation/image"]}))
  with pytest.raises(RuntimeError, match="not msgpack"):
    client._ws.send(b"\xc1 not msgpack")  # (0xc1 is never valid msgpack)
    client.infer(good)  # (reads the reply to the bad frame first)
  assert client.infer(good)["actions"].shape == (5, 7)  # The same connection goes on.
  other = openpi_client.WebsocketClientPolicy("127.0.0.1", port)
  assert other.infer(good)["actions"].shape == (5, 7)


def test_a_client_that_disconnects_mid_request_does_not_stop_the_server(served):
  _, server, port = served
  for _ in range(3):
    with websockets.sync.client.connect(f"ws://127.0.0.1:{port}", compression=None,
                                        max_size=None) as ws:
      ws.recv()  # metadata
      ws.send(msgpack_numpy.packb(_request(3)))
    # (closed before the reply)
  client = openpi_client.WebsocketClientPolicy("127.0.0.1", port)
  assert client.infer(_request(3))["actions"].shape == (5, 7)
  server.batcher.check()


def test_the_load_test_counts_every_request(served):
  _, _, port = served
  row = bench_serve.measure("127.0.0.1", port, clients=2, requests=3, image_size=64)
  assert row["requests"] == 6 and row["requests_per_s"] > 0
  assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C; a scheduler's stop
def test_the_command_serves_and_stops_on_a_signal(export_dir, tmp_path, signum):
  cmd = [sys.executable, "-m", "jaxvla.serve", f"--policy={export_dir}", "--port=0",
         "--host=127.0.0.1", "--obs_map=jaxvla", "--serve.warmup=False"]
  # Its log goes to a file, shown if the test fails (a pipe that nobody reads would block
  # the server once 64 KiB of log waited in it).
  log_path = tmp_path / "serve.log"
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
  log_tail = lambda: log_path.read_text()[-3000:]
  try:
    line = proc.stdout.readline()
    assert "on port" in line, (line, log_tail())
    port = int(line.split("on port ")[1].split()[0])
    client = openpi_client.WebsocketClientPolicy("127.0.0.1", port)
    meta = client.get_server_metadata()
    assert sorted(meta["observation"]) == ["agentview", "prompt", "right_wrist", "state",
                                           "wrist"]
    assert client.infer(meta["example_observation"])["actions"].shape == (5, 7)
    proc.send_signal(signum)
    try:
      returncode = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      proc.kill()
      pytest.fail(f"no exit within 120 s of {signum.name}; its log:\n{log_tail()}")
    assert returncode == 0, log_tail()
    assert "stopped" in proc.stdout.read()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def test_a_pi0_fast_export_answers_openpis_client(tmp_path):
  """pi0-FAST served from its export: the server loads the export's own FAST tokenizer, and
  the client's actions are the policy's own greedy decode, through the normaliser. 20 BC
  steps on one chunk make its greedy tokens a well-formed FAST sequence."""
  chunks = fast_lib.smooth_chunks(np.random.default_rng(0), 300, 5, 7)
  fast_lib.FastTokenizer.fit(chunks, vocab_size=512).save(str(tmp_path / "fast"))
  c = default.get_config("fast")
  c.model.update(fast_tokenizer_path=str(tmp_path / "fast"), max_action_tokens=48,
                 max_token_len=24)  # (8 state bins in the prompt)
  policy = policy_lib.make_policy(c.model, SPEC)
  normalizer = norm_stats.Normalizer(dict(
      state=norm_stats.NormStats(np.zeros(8), np.ones(8)),
      actions=norm_stats.NormStats(np.full(7, 0.4), np.full(7, 2.0))), "zscore")
  rows = [_observation(normalizer, _request(seed)) for seed in range(4)]
  obs = protocol.Observation(**{f: np.concatenate([getattr(r, f) for r in rows])
                                for f in ("images", "state", "instruction", "image_mask")})
  batch, target = policy.prepare(obs), jnp.asarray(np.repeat(chunks[:1], 4, 0), jnp.float32)
  tx = optax.adam(1e-3)

  @jax.jit
  def step(params, opt):
    grads = jax.grad(lambda p: policy.bc_loss(p, batch, target, jax.random.PRNGKey(0)))(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  params = policy.init(jax.random.PRNGKey(3))
  opt = tx.init(params)
  for _ in range(20):
    params, opt = step(params, opt)
  stored = c.copy_and_resolve_references()
  stored.model.fast_tokenizer_path = ""  # (as a run writes it: the export's own is found)
  path = checkpoint.export_policy(str(tmp_path / "export"), params, stored.to_json_best_effort())
  policy_io.write_spec(path, SPEC)
  norm_stats.save_normalizer(path, normalizer)
  fast_lib.save_beside(path, policy)
  loaded = policy_io.load(path)
  config = serve.serve_config(serve_configs.get_config("libero"), host="127.0.0.1", port=0,
                              max_batch=2, batch_wait_ms=10.0)
  server = server_lib.PolicyServer(loaded, config)
  port = server.start()
  try:
    client = openpi_client.WebsocketClientPolicy("127.0.0.1", port)
    request = _request(0)
    before = loaded.policy.host_counts()["fast_decoded_rows"]
    got = client.infer(request)["actions"]
    assert got.shape == (5, 7)
    assert loaded.policy.host_counts()["fast_decoded_rows"] > before  # (decoded, counted)
    # Well-formed: a malformed row's zero chunk would read as the action mean, 0.4.
    assert np.abs(got - 0.4).max() > 0.1
    np.testing.assert_allclose(got, _own_act(loaded, request), rtol=1e-5, atol=1e-5)
  finally:
    server.close()


# ------------------------------------------------------------- without a server --
def _map(name: str, spec: protocol.EnvSpec = SPEC) -> obs_map_lib.ObsMap:
  return obs_map_lib.ObsMap(serve_configs.obs_map(name), spec, default_prompt="")


def test_the_droid_aloha_and_jaxvla_maps_read_their_clients_requests():
  rng = np.random.default_rng(0)
  img = lambda *shape: rng.integers(0, 256, shape, np.uint8)
  # DROID: joints + a scalar gripper make the state; bytes prompts are decoded.
  droid = _map("droid").parse({
      "observation/exterior_image_1_left": img(224, 224, 3),
      "observation/wrist_image_left": img(224, 224, 3),
      "observation/joint_position": np.arange(7.0), "observation/gripper_position": 0.5,
      "prompt": b"pick"})
  np.testing.assert_array_equal(droid.state, [[0, 1, 2, 3, 4, 5, 6, 0.5]])
  assert droid.instruction.tolist() == ["pick"]
  assert droid.image_mask.tolist() == [[True, True, False]]
  # ALOHA: a nested images dict, channels first; a left-out wrist camera is masked and
  # cam_low is accepted and unused (openpi's AlohaInputs).
  high = img(3, 224, 224)
  aloha = _map("aloha").parse({"images": {"cam_high": high, "cam_low": img(3, 224, 224),
                                          "cam_right_wrist": img(3, 224, 224)},
                               "state": np.ones(8), "prompt": "fold"})
  assert aloha.image_mask.tolist() == [[True, False, True]]
  np.testing.assert_array_equal(aloha.images[0, 0], image_tools.resize_with_pad(
      high.transpose(1, 2, 0), 16, 16))
  assert not aloha.images[0, 1].any()
  example = _map("aloha").example()
  assert example["images"]["cam_high"].shape == (3, 16, 16)  # as ALOHA clients send it
  # jaxvla: the policy's own camera names, every camera fed.
  native = _map("jaxvla").parse(_map("jaxvla").example())
  assert native.image_mask.tolist() == [[True, True, True]]
  with pytest.raises(obs_map_lib.ObservationError, match=r"'state' has shape \[3\]"):
    _map("jaxvla").parse(dict(_map("jaxvla").example(), state=np.zeros(3)))


def test_a_map_that_does_not_fit_the_policy_fails_at_start():
  one_camera = protocol.EnvSpec(("rgb",), (16, 16, 3), 2, 2, 10)
  with pytest.raises(ValueError, match=r"names 2 cameras .* the policy has 1: \['rgb'\]"):
    _map("libero", one_camera)
  with pytest.raises(ValueError, match="do not make the policy's state of 1"):
    _map("droid", protocol.EnvSpec(("a", "b"), (16, 16, 3), 1, 2, 10))
  with pytest.raises(ValueError, match="unknown obs_map 'libro'"):
    serve_configs.obs_map("libro")


def test_resize_and_wire_format_are_openpis():
  image = np.random.default_rng(1).integers(0, 256, (48, 80, 3), np.uint8)
  np.testing.assert_array_equal(obs_map_lib.resize_with_pad(image, 16, 16),
                                image_tools.resize_with_pad(image, 16, 16))
  message = {"actions": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int64(3),
             "t": {"infer_ms": 1.5}, "s": "x"}
  assert wire.packb(message) == msgpack_numpy.packb(message)
  back = wire.unpackb(msgpack_numpy.packb(message))
  np.testing.assert_array_equal(back["actions"], message["actions"])
  bad = {b"__ndarray__": True, b"data": b"\0" * 5, b"dtype": "<f4", b"shape": [2]}
  with pytest.raises(wire.WireError, match="cannot hold 5 bytes"):
    wire.unpackb(msgpack_numpy.packb(bad))
  with pytest.raises(wire.WireError, match="not accepted"):
    wire.unpackb(msgpack_numpy.packb({**bad, b"dtype": "|O", b"data": b"\0" * 16}))


def test_padded_batch_sizes_are_powers_of_two_up_to_max_batch():
  assert runner_lib.batch_sizes(1) == (1,)
  assert runner_lib.batch_sizes(8) == (1, 2, 4, 8)
  assert runner_lib.batch_sizes(6) == (1, 2, 4, 6)
