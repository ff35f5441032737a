"""Runs that cannot go wrong silently: the divergence guard, the workdir lock,
``resume`` without a checkpoint, pacing after a resume, the default workdir."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from jaxvla import metrics as metrics_lib
from jaxvla import train
from jaxvla.envs import builtin
from jaxvla.learner import guard as guard_lib
from jaxvla.learner import learner as learner_lib
from jaxvla.learner import update as update_lib
from jaxvla.models import policy as policy_lib
from jaxvla.rollout import pacer as pacer_lib
from jaxvla.storage import checkpoint as checkpoint_lib, workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------ divergence guard --
def test_non_finite_bc_step_is_not_applied(smoke_config):
  env = builtin.make(smoke_config.env, 2, 0)
  pol = policy_lib.make_policy(smoke_config.model, env.spec)
  lrn = learner_lib.Learner(pol, smoke_config)
  params = pol.init(jax.random.PRNGKey(0))
  host = lambda t: jax.tree.map(np.array, jax.device_get(t))
  before = host(params)
  state = learner_lib.init_state(params, lrn.bc_tx, jax.random.PRNGKey(1))
  batch = pol.prepare(env.observe())
  bad = np.full((2, pol.chunk_len, 2), np.nan, np.float32)
  state, metrics = lrn.bc_step(state, batch, bad)
  assert float(metrics["nonfinite"]) != 0
  assert "loss" in guard_lib.describe_nonfinite(float(metrics["nonfinite"]))
  jax.tree.map(np.testing.assert_array_equal, host(state.params), before)  # Not applied.
  assert int(state.step) == 1
  good = np.zeros((2, pol.chunk_len, 2), np.float32)
  state, metrics = lrn.bc_step(state, batch, good)
  assert float(metrics["nonfinite"]) == 0 and np.isfinite(float(metrics["loss"]))
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b),
                                         host(state.params), before))
  assert any(changed)


def test_non_finite_streamed_step_is_not_applied(smoke_config):
  """The streamed learner's optimizer step (``Learner.apply``) is guarded as the others:
  a non-finite accumulated gradient leaves the params and moments as they were."""
  from jaxvla.algorithms import ppo  # pylint: disable=import-outside-toplevel
  env = builtin.make(smoke_config.env, 2, 0)
  pol = policy_lib.make_policy(smoke_config.model, env.spec)
  lrn = learner_lib.Learner(pol, smoke_config)
  host = lambda t: jax.tree.map(np.array, jax.device_get(t))
  state = lrn.shard_state(learner_lib.init_state(pol.init(jax.random.PRNGKey(0)), lrn.ppo_tx,
                                                 jax.random.PRNGKey(1)))
  before = host(state)
  grads = jax.tree.map(jnp.ones_like, lrn.rl_trainable.select(state.params))
  leaf = jax.tree.leaves(grads)[0]
  grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan) if g is leaf else g, grads)
  metrics = dict(loss=jnp.float32(1.0), **{k: jnp.float32(1.0) for k in ppo.STEP_SCALE_READS})
  state, out = lrn.apply(state, (grads, metrics))
  assert int(out["nonfinite"]) == 2 and int(state.step) == 1
  jax.tree.map(np.testing.assert_array_equal, host((state.params, state.opt_state)),
               (before.params, before.opt_state))
  ones = jax.tree.map(jnp.ones_like, grads)
  state, out = lrn.apply(state, (ones, metrics))
  assert int(out["nonfinite"]) == 0
  assert any(jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b),
                                          host(state.params), before.params)))


def _guarded_update(x: np.ndarray, lr: float):
  """``update.epochs_update`` of one epoch, 4 minibatches of 2 rows, SGD at ``lr`` on
  the loss ``w * mean(x)`` of each minibatch (a stand-in objective: rows ``x``)."""
  import optax  # pylint: disable=import-outside-toplevel
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  n = len(x)
  rows = dict(x=jnp.asarray(x), log_prob=jnp.zeros(n), version=jnp.zeros(n, jnp.int32))
  def loss(p, mb, w):
    value = jnp.sum(w * mb["x"]) * p["w"]
    return value, dict(loss=value)
  objective = SimpleNamespace(rows=lambda data: rows, weights=lambda mb: jnp.full(2, 0.5),
                              loss=loss, batch_metrics=lambda data, rows: {})
  cfg = default.get_config("smoke").rl
  cfg.update(num_epochs=1, num_minibatches=4, correction="none", value_targets="rollout",
             target_kl=0.0, step_scale="none")
  tx = optax.sgd(lr)
  params = dict(w=jnp.float32(1.0))
  rng = jax.random.PRNGKey(3)
  new, _, metrics = update_lib.epochs_update(objective, tx, cfg, params, tx.init(params), None,
                                             rng)
  order = np.asarray(jax.random.permutation(jax.random.split(rng, 1)[0], n)).reshape(4, 2)
  return float(new["w"]), metrics, order


def test_a_non_finite_step_is_not_applied_nor_any_after_it_in_the_update():
  """The guard of each optimizer step: the minibatch steps before the first non-finite
  one stand, it and the later ones do not; the ``nonfinite`` bits say which part failed.
  Params that overflow with a finite loss and gradient are reported as bit 4."""
  x = np.arange(1.0, 9.0, dtype=np.float32)
  x[5] = np.nan
  w, metrics, order = _guarded_update(x, lr=0.1)
  bad = int(np.flatnonzero((order == 5).any(axis=1))[0])
  expected = 1.0 - 0.1 * sum(x[mb].mean() for mb in order[:bad])
  np.testing.assert_allclose(w, expected, rtol=1e-6)
  assert int(metrics["nonfinite"]) == 1 | 2
  assert guard_lib.describe_nonfinite(float(metrics["nonfinite"])) == "loss, gradient norm"
  np.testing.assert_allclose(metrics["skipped"], (4 - bad) / 4)
  w, metrics, _ = _guarded_update(np.arange(1.0, 9.0, dtype=np.float32), lr=0.1)
  assert int(metrics["nonfinite"]) == 0 and float(metrics["skipped"]) == 0
  np.testing.assert_allclose(w, 1.0 - 0.1 * 4 * 4.5, rtol=1e-6)  # Every step applied.
  # The first step overflows (bit 4: nothing to take back), the next one's loss on
  # those params is not finite (bit 1); the gradient, mean(x), always is.
  w, metrics, _ = _guarded_update(np.arange(1.0, 9.0, dtype=np.float32), lr=3e38)
  assert not np.isfinite(w) and int(metrics["nonfinite"]) == 1 | 4


def test_divergence_guard_stops_after_max_bad_in_a_row(caplog):
  guard = guard_lib.DivergenceGuard(3, "RL update")
  with caplog.at_level(logging.WARNING):
    guard.check(1.0, 1)
    guard.check(0.0, 2)  # A finite update resets the count.
    guard.check(2.0, 3)
    guard.check(3.0, 4)
  assert guard.total == 3 and guard.in_a_row == 2
  assert ("RL update 3: non-finite gradient norm; not applied from that step on (1 in a row; "
          "the run stops at 3)") in caplog.text
  with pytest.raises(FloatingPointError, match=r"RL update 5: non-finite loss; 3 in a row"):
    guard.check(1.0, 5)
  # Params that went non-finite cannot be taken back: the run stops at the first.
  with pytest.raises(FloatingPointError,
                     match=r"RL update 1: non-finite loss, updated parameters; the params are "
                           r"not finite, the run stops"):
    guard_lib.DivergenceGuard(3, "RL update").check(5.0, 1)
  c = default.get_config("smoke")
  c.rl.max_bad_updates = 0
  with pytest.raises(ValueError, match="config.rl.max_bad_updates"):
    from jaxvla import config_checks  # pylint: disable=import-outside-toplevel
    config_checks.validate(c)


@pytest.mark.run_first
def test_diverging_run_stops_and_keeps_finite_checkpoints(tmp_path, smoke_config):
  """Finding: lr=1e3 used to log NaN and write NaN checkpoints over the good ones."""
  c = smoke_config
  # Diverges within update 1 whatever the warm start: its first minibatch step moves the
  # params by ~lr, and the next minibatch's forward pass overflows. (The finding's 1e3
  # diverged from the earlier warm start only; LayerNorm keeps some huge params finite.)
  c.rl.learning_rate = 1e37
  c.checkpoint.every_iters = 1
  c.rl.max_bad_updates = 1  # (the count in a row: test_divergence_guard_stops_after_...)
  c.pipeline.update(mode="async", train_async=True, rollout_async=False)
  workdir = str(tmp_path / "run")
  with pytest.raises(FloatingPointError, match=r"RL update 1: non-finite .*; 1 in a row, the run stops"):
    train.train_and_evaluate(c, workdir)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), 5)
  env = builtin.make(c.env, 2, 0)
  pol = policy_lib.make_policy(c.model, env.spec)
  lrn = learner_lib.Learner(pol, c)
  abstract = checkpoint_lib.abstract_like(
      learner_lib.init_state(pol.init(jax.random.PRNGKey(0)), lrn.ppo_tx, jax.random.PRNGKey(0)))
  steps = ckpt.manager.all_steps()
  assert steps, "no checkpoint"
  for step in steps:
    state, _ = ckpt.restore(step, abstract)
    assert bool(update_lib.all_finite(state.params)), step
  ckpt.close()
  records = metrics_lib.records(workdir, "train")
  assert records[-1]["nonfinite"] != 0 and not np.isfinite(records[-1]["loss"])


# ---------------------------------------------------------------- workdir --
def test_workdir_lock_is_exclusive_and_names_the_holder(tmp_path):
  with workdir_lib.WorkdirLock(str(tmp_path)):
    with pytest.raises(workdir_lib.WorkdirInUse, match=rf"in use by pid {os.getpid()} on "):
      workdir_lib.WorkdirLock(str(tmp_path)).acquire()
    # A second run on it is refused before it writes anything.
    with pytest.raises(workdir_lib.WorkdirInUse, match="choose another --workdir"):
      train.train_and_evaluate(default.get_config("smoke"), str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == [".lock"]
  with workdir_lib.WorkdirLock(str(tmp_path)):  # Released: free again.
    pass


def test_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
  with open(tmp_path / ".lock", "w") as f:  # Left by a killed run (its flock died with it).
    json.dump(dict(host="node7", pid=999999, started="2026-01-01 00:00:00"), f)
  with caplog.at_level(logging.WARNING), workdir_lib.WorkdirLock(str(tmp_path)):
    pass
  assert "taking over the lock of pid 999999 on node7" in caplog.text


def test_resume_without_a_checkpoint_is_an_error(tmp_path, smoke_config):
  smoke_config.resume = True
  with pytest.raises(FileNotFoundError, match=r"resume=True but .*typo.* holds no checkpoint"):
    train.train_and_evaluate(smoke_config, str(tmp_path / "typo"))


def test_one_line_errors_from_the_command_line(tmp_path):
  """A refused resume (or checkpoint, or workdir) is one line on stderr, exit status 1."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  out = subprocess.run(
      [sys.executable, "-m", "jaxvla.main", "--config=configs/default.py:smoke",
       f"--workdir={tmp_path / 'typo'}", "--config.resume=True"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("error: --config.resume=True but ") and "holds no checkpoint" in last


_FULL_DISK = r"""
import json, os, sys
import jax.numpy as jnp, numpy as np
from jaxvla.storage import checkpoint as checkpoint_lib
d = os.path.join(sys.argv[1], "checkpoints")
ckpt = checkpoint_lib.Checkpointer(d, 5)
# ~1.2 MB a step in 20 arrays (random, so not compressed away) on a 3 MB filesystem.
rng = np.random.default_rng(0)
state = {f"w{i}": jnp.asarray(rng.normal(size=15_000).astype(np.float32)) for i in range(20)}
error = None
try:
  for step in range(10):
    ckpt.save(step, state, dict(step=step))
  ckpt.close()
except checkpoint_lib.CheckpointError as e:
  error = str(e)
ckpt.close()  # (a reported failure is not raised again)
again = checkpoint_lib.Checkpointer(d, 5)
restored, meta = again.restore(again.latest_step(), checkpoint_lib.abstract_like(state))
ok = all(np.array_equal(np.asarray(restored[k]), np.asarray(state[k])) for k in state)
try:
  checkpoint_lib.export_policy(os.path.join(sys.argv[1], "export"), state, "{}")
  export_error = None
except checkpoint_lib.CheckpointError as e:
  export_error = str(e)
print(json.dumps(dict(error=error, listing=sorted(os.listdir(d)), meta=meta, ok=ok,
                      export_error=export_error,
                      export_listing=sorted(os.listdir(os.path.join(sys.argv[1], "export"))))))
"""


def test_full_disk_is_one_line_and_leaves_no_partial_step(tmp_path):
  """Finding: a full disk's `No space left on device` was line 140 of 1,725 lines of
  stderr, and orbax's temporary step directory stayed behind."""
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  mnt = tmp_path / "disk"
  mnt.mkdir()
  script = tmp_path / "full_disk.py"
  script.write_text(_FULL_DISK)
  # A size-limited filesystem of its own: a tmpfs in a private mount namespace.
  if shutil.which("unshare") is None or subprocess.run(
      ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
      capture_output=True).returncode != 0:
    pytest.skip("a full disk is made with a private tmpfs mount, which needs `unshare -rm` "
                "(user namespaces); not available here")
  shell = (f"mount -t tmpfs -o size=3m tmpfs {mnt} && "
           f"{sys.executable} {script} {mnt}")
  out = subprocess.run(["unshare", "-rm", "sh", "-c", shell], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["error"].startswith("checkpoint 2 could not be written to "), got
  assert "no space left on device (" in got["error"]
  assert got["error"].endswith("the earlier checkpoints (0, 1) are intact"), got
  assert got["listing"] == ["0", "1"]  # No temporary step directory left behind.
  assert got["meta"] == dict(step=1) and got["ok"]
  assert got["export_error"].startswith("the policy export to "), got
  assert "no space left on device" in got["export_error"] and got["export_listing"] == []
  # orbax's save threads log their tracebacks; only the one line remains.
  assert "Traceback" not in out.stderr and "RESOURCE_EXHAUSTED" not in out.stderr, \
      out.stderr[-3000:]


def test_unretrieved_orbax_task_error_is_not_logged_again(caplog):
  """Finding (CI): after the export's one-line error, asyncio logged "Task exception was
  never retrieved" with orbax's traceback for each of the export's 20 write tasks."""
  checkpoint_lib._quiet_orbax_failures()  # pylint: disable=protected-access
  # A failing write that runs in a file of orbax's, as its serialization tasks do.
  code = compile("def write():\n  raise ValueError('RESOURCE_EXHAUSTED: disk full')\n",
                 "/site-packages/orbax/checkpoint/_src/serialization/serialization.py", "exec")
  orbax_module = {}
  exec(code, orbax_module)  # pylint: disable=exec-used
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    for write in (orbax_module["write"], lambda: 1 / 0):
      try:
        write()
      except Exception as e:  # pylint: disable=broad-except
        logging.getLogger("asyncio").error("Task exception was never retrieved",
                                           exc_info=(type(e), e, e.__traceback__))
  # Only the one that is not orbax's.
  assert [(r.getMessage(), r.exc_info[0]) for r in caplog.records] == [
      ("Task exception was never retrieved", ZeroDivisionError)]


def test_default_workdir_is_timestamped():
  import datetime  # pylint: disable=import-outside-toplevel
  assert workdir_lib.default_workdir(datetime.datetime(2026, 11, 23, 9, 5, 7)) == os.path.join(
      "workdirs", "20261123-090507")


# ----------------------------------------------------------------- pacing --
def test_pacer_after_resume_bounds_like_an_uninterrupted_run():
  """Finding: after a resume at version 5 pacing allowed 6 + k updates' segments."""
  fresh = pacer_lib.Pacer(segments_per_update=4, max_staleness=1)
  resumed = pacer_lib.Pacer(segments_per_update=4, max_staleness=1, version=5)
  # Segments of updates 0..4 were consumed; with k=1 it may start those of 5 and 6.
  assert resumed.acquire(100, 5, block=False) == (8, 5)
  assert resumed.started == fresh.limit(5) == 28


# ------------------------------------------------------- run-time environment --
def test_a_direct_start_gets_the_launch_environment():
  """Finding: `python -m jaxvla.main` without launch/env.sh lacked the simulators'
  environment (ManiSkill3: vk::createInstanceUnique ErrorIncompatibleDriver)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from jaxvla import simulator_env  # pylint: disable=import-outside-toplevel
  bare = {k: v for k, v in os.environ.items()
          if k in ("PATH", "HOME", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")}
  wanted = simulator_env.changes(bare)
  assert wanted["OMP_NUM_THREADS"] == "1" and wanted["MUJOCO_GL"] in ("egl", "osmesa")
  assert "MS_SKIP_ASSET_DOWNLOAD_PROMPT" in wanted
  code = ("import json, os; from jaxvla import simulator_env; simulator_env.ensure(); "
          "print(json.dumps(dict(os.environ)))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=bare, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  seen = json.loads(out.stdout.strip().splitlines()[-1])
  for key, value in wanted.items():
    assert seen.get(key) == value, key
  # Under launch/ (or once applied) nothing is left to change.
  assert simulator_env.changes(seen) == {}
