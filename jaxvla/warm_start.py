"""The warm start: behaviour cloning on demonstrations before RL.

:func:`demonstrations` finds the dataset (``config.data.path``) or records the env's
scripted expert into the run's workdir as an RLDS dataset, once; :func:`warm_start` checks
that the dataset fits the policy and trains on it for ``config.bc.num_steps`` steps,
with a progress line at a steady pace when the output is not a terminal.

A pi0-FAST run needs its FAST tokenizer before its policy exists (the vocabulary sizes the
network): :func:`fast_tokenizer_dir` fits it on the same demonstrations, in the policy's
normalised action space, and keeps it in the workdir, where the checkpoints' and the
export's readers find it (:func:`jaxvla.storage.policy_io.load`).
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import ml_collections
import numpy as np

from jaxvla import progress as progress_lib
from jaxvla.data import collect as collect_lib
from jaxvla.data import config as data_config
from jaxvla.data import loader as data_loader
from jaxvla.data import norm_stats as norm_lib
from jaxvla.envs import protocol
from jaxvla.learner import guard as guard_lib
from jaxvla.learner import learner as learner_lib
from jaxvla.models import contract
from jaxvla.models import fast_tokenizer as fast_lib
from jaxvla.parallel import distributed

log = logging.getLogger(__name__)

DEMOS_DIR = "demos"  # <workdir>/demos: the recorded demonstrations (RLDS).
DEMOS_SUMMARY = "demos_summary.json"  # <workdir>/...: what recording them gave (collect's).


def demonstrations(config, workdir: str, spec: protocol.EnvSpec
                   ) -> tuple[ml_collections.ConfigDict, dict]:
  """The dataset the warm start reads (its ``data`` sub-config) and figures about it.

  ``config.data.path`` when set. Otherwise the env's scripted expert is recorded,
  once, into ``<workdir>/demos`` as an RLDS dataset (process 0 records, the others
  wait), exactly as ``python -m jaxvla.data.collect`` would: one path from
  demonstrations to BC, through the disk, for every run.
  """
  if config.data.path:
    return config.data, {}
  out = os.path.join(workdir, DEMOS_DIR)
  summary_file = os.path.join(workdir, DEMOS_SUMMARY)
  if distributed.is_primary():
    if os.path.isdir(out):  # (recorded earlier in this run: a FAST fit, or a stopped run)
      log.info("warm start: reading the demonstrations already recorded in %s", out)
    else:
      t0 = time.perf_counter()
      summary = collect_lib.collect(config, out, config.bc.num_episodes,
                                    noise=config.bc.demo_noise, num_envs=config.num_envs,
                                    success_only=config.bc.success_only)
      log.info("warm start: recorded %d demonstrations (%d steps; %d attempted, success %.3f) "
               "in %s in %.1f s", summary["episodes"], summary["steps"], summary["attempted"],
               summary["success_rate"], out, time.perf_counter() - t0)
      with open(summary_file, "w", encoding="utf-8") as f:
        json.dump(summary, f)
  figures = {"demo_success_rate": -1.0}
  if distributed.is_primary() and os.path.exists(summary_file):
    with open(summary_file, encoding="utf-8") as f:
      figures["demo_success_rate"] = float(json.load(f)["success_rate"])
  # Every process reads the dataset once process 0 has written it (a collective).
  figures = distributed.broadcast_from_primary(figures)
  d = data_config.recorded(config.data, out, spec.camera_names)
  return d, ({} if figures["demo_success_rate"] < 0 else figures)


def fast_tokenizer_dir(config: ml_collections.ConfigDict, workdir: str,
                       spec: protocol.EnvSpec) -> str:
  """The FAST tokenizer of a pi0-FAST run: ``<workdir>/fast_tokenizer``, made once.

  ``config.model.fast_tokenizer_path`` set: that tokenizer, copied there (so the run's
  checkpoints and export carry it). Empty: fitted there on the warm start's demonstrations
  (:func:`demonstrations`), each step's next ``model.chunk_len`` actions (repeating the
  episode's last past its end, as LeRobot's chunks do) in the policy's action space (the
  ``config.data.normalize`` normalisation), at ``model.fast_scale`` and
  ``model.fast_vocab_size``, able to express every chunk within ``model.fast_fit_range``
  (RL may act beyond the demonstrations). A resumed run finds the directory and uses it as
  it is.

  Process 0 writes it; every process returns its path.
  """
  own = os.path.join(workdir, fast_lib.RUN_DIR)
  # (Multi-process: process 0's view of the directory decides, and demonstrations() is a
  # collective every process calls.)
  made = distributed.broadcast_from_primary({"made": float(os.path.isdir(own))})["made"]
  if made:
    return own
  m = config.model
  if m.fast_tokenizer_path:
    if distributed.is_primary():
      fast_lib.FastTokenizer.load(m.fast_tokenizer_path).save(own)
      log.info("FAST tokenizer: %s, copied to %s", m.fast_tokenizer_path, own)
  else:
    if config.bc.num_steps == 0 and not config.data.path:
      raise ValueError("config.model.fast_tokenizer_path is empty and bc.num_steps=0: pi0_fast "
                       "fits its FAST tokenizer on the warm start's demonstrations; give a "
                       "tokenizer directory or a dataset (config.data.path)")
    d, _ = demonstrations(config, workdir, spec)
    if distributed.is_primary():
      reader = data_loader.open_reader(d)
      normalizer = data_loader.normalizer_from_config(d, reader)
      actions = reader.table.actions
      if normalizer is not None:
        actions = normalizer.action_labels(actions)
      chunks = fast_lib.dataset_chunks(actions, reader.table.lengths, m.chunk_len)
      t0 = time.perf_counter()
      tokenizer = fast_lib.FastTokenizer.fit(chunks, scale=m.fast_scale,
                                             vocab_size=m.fast_vocab_size,
                                             cover=m.fast_fit_range)
      tokenizer.save(own)
      log.info("FAST tokenizer: fitted on %d chunks of %s in %.1f s (%d BPE ids): %s; saved in "
               "%s", len(chunks), d.path, time.perf_counter() - t0, tokenizer.bpe_vocab_size,
               fast_lib.measure(tokenizer, chunks), own)
  distributed.broadcast_from_primary({"written": 1.0})  # (the others wait for the files)
  return own


def _check_dataset_fits(reader, d: ml_collections.ConfigDict, spec: protocol.EnvSpec) -> None:
  """The dataset's cameras, state and actions must be what the policy (built for the
  env) takes; raises ValueError naming the ``config.data`` key to change."""
  got = data_loader.dataset_spec(reader, d)
  if len(got.camera_names) != len(spec.camera_names):
    raise ValueError(f"config.data.cameras: the dataset gives {len(got.camera_names)} cameras "
                     f"{list(got.camera_names)}, the env's policy takes {len(spec.camera_names)} "
                     f"{list(spec.camera_names)}")
  if got.image_shape != spec.image_shape:
    raise ValueError(f"config.data.image_size: the dataset's images are {got.image_shape}, the "
                     f"env's {spec.image_shape}; set --config.data.image_size="
                     f"{spec.image_shape[0]} to resize them")
  for what, key in (("state_dim", "state_key"), ("action_dim", "action_key")):
    if getattr(got, what) != getattr(spec, what):
      raise ValueError(f"config.data.{key}: the dataset's {what} is {getattr(got, what)}, the "
                       f"env's {getattr(spec, what)}")


def _normalizer(d: ml_collections.ConfigDict, spec: protocol.EnvSpec, reader=None
                ) -> norm_lib.Normalizer | None:
  """The run's normalisation (``data_loader.normalizer_from_config``), which must cover the
  env's critic state (``EnvSpec.critic_state_dim``): raises ValueError naming the
  statistics' source otherwise."""
  normalizer = data_loader.normalizer_from_config(d, reader)
  if normalizer is not None:
    normalizer.check_critic_state(
        spec.critic_state_dim, f"config.data.norm_stats ({d.norm_stats})" if d.norm_stats
        else f"the statistics of {d.path or getattr(reader, 'path', 'the dataset')}")
  return normalizer


def warm_start(config: ml_collections.ConfigDict, learner: learner_lib.Learner,
               policy: contract.Policy, spec: protocol.EnvSpec, workdir: str, params, rng
               ) -> tuple[object, norm_lib.Normalizer | None, dict]:
  """Behaviour cloning on a demonstration dataset on disk (:func:`demonstrations`);
  returns the params, the normalisation (``config.data.normalize``, statistics from
  ``config.data.norm_stats`` or the dataset) and figures. Multi-process: each process
  reads its shard of the steps and feeds its share of every batch."""
  if config.bc.num_steps == 0:
    return params, _normalizer(config.data, spec), {}
  d, figures = demonstrations(config, workdir, spec)
  hosts = jax.process_count()
  ds, reader = data_loader.from_config(d, chunk_len=config.model.chunk_len,
                                         batch_size=config.bc.batch_size // hosts,
                                         seed=config.seed + 3)
  _check_dataset_fits(reader, d, spec)
  normalizer = _normalizer(d, spec, reader)
  batches = data_loader.bc_batches(iter(ds), policy.prepare, normalizer)
  state = learner.shard_state(learner_lib.init_state(params, learner.bc_tx, rng))
  guard = guard_lib.DivergenceGuard(config.rl.max_bad_updates, "BC step")
  losses, pending = [], []
  phase = progress_lib.PhaseLog("warm start (BC)", config.bc.num_steps,
                               config.log.progress_every_s)
  for i in range(config.bc.num_steps):
    batch, actions, mask = next(batches)
    state, metrics = learner.bc_step(state, batch, actions, mask)
    pending.append(metrics)
    # Checked a few steps late, so the host does not wait for every step.
    if len(pending) == 8 or i + 1 == config.bc.num_steps:
      for step, m in enumerate(jax.device_get(pending), start=i + 2 - len(pending)):
        guard.check(float(m["nonfinite"]), step)  # (steps numbered from 1, like updates)
        losses.append(float(m["loss"]))
      pending = []
      phase.tick(i + 1, loss=losses[-1])
  batches.close()
  losses = np.asarray(losses)
  table = reader.table
  return state.params, normalizer, dict(
      bc_loss_first=float(losses[0]), bc_loss_last=float(losses[-5:].mean()),
      demo_episodes=float(table.num_episodes), demo_env_steps=float(table.num_steps), **figures)
