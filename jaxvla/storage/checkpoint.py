"""orbax checkpoints of the full train state, and parameter-only policy exports.

A checkpoint holds two items: ``state`` (the learner's :class:`TrainState`:
params, optimizer state, step, PRNG key) and ``meta`` (JSON: env steps,
iteration, warm-start figures). An export holds ``params`` alone plus the config
as JSON, and loads without the optimizer.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import shutil
import sys

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used; the message names the step and the cause."""


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _no_space(e: BaseException) -> bool:
  """Whether ``e`` or an exception it was raised from is a full disk (ENOSPC).

  tensorstore reports it as ``ValueError: RESOURCE_EXHAUSTED: ... No space left on
  device [os_error_code='28']``; Python file writes as ``OSError(ENOSPC)``.
  """
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


class _OrbaxTracebacks(logging.Filter):
  """Drops the tracebacks orbax's save threads log (one per thread, with the same
  cause): the failure reaches :class:`Checkpointer` as an exception, which names the
  step and the cause in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if not record.exc_info:
      return True
    if "orbax" in record.pathname:
      return False
    # The same failure once more, when the event loop collects orbax's unawaited write
    # tasks: asyncio's "Task exception was never retrieved", whose traceback is orbax's.
    tb = record.exc_info[2]
    while tb is not None:
      if "orbax" in tb.tb_frame.f_code.co_filename:
        return False
      tb = tb.tb_next
    return True


_ORBAX_TRACEBACKS = _OrbaxTracebacks()


def _quiet_closed_loop_writes() -> None:
  """After a failed save, tensorstore's other writes of that step still finish and
  call back into orbax's event loop, which the failure already closed; each callback
  reports ``RuntimeError: Event loop is closed`` through ``sys.unraisablehook`` (one
  traceback per array), from a background thread while the run goes on. Exactly those
  are dropped (the error of ``call_soon_threadsafe`` itself, with no caller above it);
  the failure itself is reported once, by :class:`Checkpointer`."""
  previous = sys.unraisablehook
  if getattr(previous, "_jaxvla_quiet", False):
    return

  def hook(unraisable):
    tb = unraisable.exc_traceback
    if (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
        and tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"):
      return
    previous(unraisable)

  hook._jaxvla_quiet = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


def _quiet_orbax_failures() -> None:
  """A failed orbax write is reported once, as a :class:`CheckpointError`: its
  threads' logged tracebacks and late callbacks are dropped (idempotent)."""
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_ORBAX_TRACEBACKS)  # (adding it again is a no-op)
  _quiet_closed_loop_writes()


def _write_cause(e: BaseException, directory: str) -> str:
  """A failed write's cause in one line; for a full disk, the space left."""
  if _no_space(e):
    free = shutil.disk_usage(directory).free
    return f"no space left on device ({free / 2**20:.1f} MiB free)"
  return _first_line(e)


def _remove_partial_writes(directory: str) -> None:
  """Removes the temporary directories a failed orbax write leaves in ``directory``
  (process 0 alone: the directory is shared in a multi-host run)."""
  if jax.process_index() == 0:
    for tmp in glob.glob(os.path.join(directory, "*.orbax-checkpoint-tmp*")):
      shutil.rmtree(tmp, ignore_errors=True)


def _path_str(path) -> str:
  """A tree path as ``params/PaliGemma/llm/...`` (dict keys, attributes, indices alike)."""
  out = []
  for k in path:
    out.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
  return "/".join(out)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  """``path -> shape`` of every leaf (orbax metadata or arrays / ShapeDtypeStructs)."""
  return {_path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _first_difference(stored: dict, wanted: dict, prefix: str, ours: str) -> str | None:
  for path, shape in wanted.items():
    if path not in stored:
      return f"{prefix}{path} (shape {shape}) is not in the checkpoint"
    if stored[path] != shape:
      return f"{prefix}{path} is stored with shape {stored[path]}, {ours} has {shape}"
  extra = sorted(set(stored) - set(wanted))
  if extra:
    return f"the checkpoint has {prefix}{extra[0]}, which {ours} does not"
  return None


def params_mismatch(stored_tree, abstract_params) -> str | None:
  """The first difference between a checkpoint's stored params (orbax metadata) and
  the params the config builds, as one line; None if they fit."""
  return _first_difference(_shapes(stored_tree), _shapes(abstract_params), "params/",
                           "the config's model")


def state_mismatch(stored_state, abstract_state) -> str | None:
  """The first difference outside the params between a checkpoint's stored train state
  and the one this run builds: the optimizer state, whose tree follows the RL
  optimizer's settings and what it trains. One line; None if they fit."""
  return _first_difference(_shapes(stored_state), _shapes(abstract_state), "",
                           "this run's train state")


class Checkpointer:
  """Periodic, asynchronous saves of the train state under ``directory``.

  A save runs in the background; its failure surfaces at the next :meth:`save` or at
  :meth:`close` as one :class:`CheckpointError` naming the step (for a full disk:
  the free space and the intact steps), with the partial step directory removed.
  """

  def __init__(self, directory: str, max_to_keep: int, keep_steps: tuple[int, ...] = ()):
    """``max_to_keep`` (>= 1, :func:`jaxvla.config_checks.validate`'s rule): the newest steps
    kept on disk; ``keep_steps`` are kept beside them whatever their age (the run's warm
    start, step 0: ``checkpoint.keep_warm_start``)."""
    self.directory = os.path.abspath(directory)
    policies = [ocp.checkpoint_managers.LatestN(n=max_to_keep)]
    if keep_steps:
      policies.append(ocp.checkpoint_managers.CustomSteps(steps=list(keep_steps)))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            create=True, preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(
                policies)),
        # Handlers named up front, so a fresh manager can read a step's metadata.
        item_handlers=dict(state=ocp.StandardCheckpointHandler(),
                           meta=ocp.JsonCheckpointHandler()))
    self._pending: int | None = None  # the step whose background save may still fail
    self._failed = False
    _quiet_orbax_failures()

  def save(self, step: int, state, meta: dict) -> None:
    """Starts writing ``step``; raises the previous save's failure, if any.

    Raises:
      CheckpointError: this or the previous save failed (a full disk, say).
    """
    self._wait()
    with self._failure(step):
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    self._pending = step

  def _wait(self) -> None:
    if self._pending is not None:
      with self._failure(self._pending):
        self.manager.wait_until_finished()
      self._pending = None

  @contextlib.contextmanager
  def _failure(self, step: int):
    """Turns a failed write of ``step`` into one CheckpointError, removing the
    partial step directory orbax leaves behind."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      self._failed = True
      _remove_partial_writes(self.directory)
      intact = [s for s in ocp.utils.checkpoint_steps(self.directory) if s != step]
      kept = (f"the earlier checkpoints ({', '.join(map(str, sorted(intact)))}) are intact"
              if intact else "no earlier checkpoint exists")
      raise CheckpointError(f"checkpoint {step} could not be written to {self.directory}: "
                            f"{_write_cause(e, self.directory)}; {kept}") from None

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore_latest(self, abstract_state, hint: str = "", at_most: int | None = None):
    """``(step, state, meta)`` of the newest intact checkpoint (at step ``at_most`` or
    before, if given: a replay resumes where its recorded run did).

    A damaged step (unreadable metadata, a truncated or missing array file) is
    skipped with a warning for the one before it. Params that do not fit the
    config's model (another ``model.name`` or ``model.variant``), or an optimizer
    state of another structure (other RL optimizer settings), are an error, not
    damage: the message names the step, the first differing path and ``hint`` (e.g.
    the config keys that changed since the checkpoint was written).

    Raises:
      CheckpointError: a mismatch, or no intact step at all (each step's cause named).
    """
    directory = self.manager.directory
    causes = []

    def damaged(step: int, cause: str) -> None:
      causes.append((step, cause))
      log.warning("checkpoint %d in %s is damaged: %s; trying an earlier one", step, directory,
                  cause)

    for step in sorted(self.manager.all_steps(), reverse=True):
      if at_most is not None and step > at_most:
        continue
      metadata_file = os.path.join(str(directory), str(step), "state", "_METADATA")
      if not os.path.exists(metadata_file):
        damaged(step, f"{metadata_file} is missing")
        continue
      try:
        stored_state = self.manager.item_metadata(step)["state"].tree
      except Exception as e:  # pylint: disable=broad-except
        damaged(step, f"unreadable ({_first_line(e)})")
        continue
      mismatch = params_mismatch(stored_state["params"], abstract_state.params)
      if mismatch:
        raise CheckpointError(f"checkpoint {step} in {directory} does not fit this run's "
                              f"model: {mismatch}{hint}")
      mismatch = state_mismatch(stored_state, abstract_state)
      if mismatch:  # (orbax alone would report damage: "tree structures do not match")
        raise CheckpointError(
            f"checkpoint {step} in {directory} does not fit this run's optimizer: {mismatch} "
            "(its state follows the RL optimizer's settings, e.g. rl.value_learning_rate "
            f"and rl.critic_warmup_steps, and the parts it trains){hint}")
      try:
        state, meta = self.restore(step, abstract_state)
      except Exception as e:  # pylint: disable=broad-except
        damaged(step, f"unreadable ({_first_line(e)})")
        continue
      if causes:
        log.warning("resuming from checkpoint %d: the newer %s damaged", step,
                    ", ".join(str(s) for s, _ in causes) + (" is" if len(causes) == 1 else " are"))
      return step, state, meta
    raise CheckpointError(f"no intact checkpoint in {directory}: " + "; ".join(
        f"step {step}: {cause}" for step, cause in causes))

  def restore(self, step: int, abstract_state):
    """Restores ``(state, meta)`` at ``step`` onto ``abstract_state``'s structure/shardings."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    """Waits for the last save and closes the manager.

    Raises:
      CheckpointError: the last save failed (not raised again once reported).
    """
    try:
      if not self._failed:
        self._wait()
    finally:
      try:
        self.manager.close()
      except Exception:  # pylint: disable=broad-except
        if not self._failed:
          raise


def saved_steps(directory: str) -> list[int]:
  """The finished checkpoint steps in ``directory``, ascending (without opening a manager)."""
  if not os.path.isdir(directory):
    return []
  return sorted(ocp.utils.checkpoint_steps(os.path.abspath(directory)))


def has_checkpoint(directory: str) -> bool:
  """Whether ``directory`` holds a finished checkpoint step (without opening a manager)."""
  return bool(saved_steps(directory))


def export_policy(directory: str, params, config_json: str, write_config: bool = True) -> str:
  """Writes the policy parameters alone (for inference) and the run config.

  Multi-process: every process calls it (orbax writes each array once);
  ``write_config`` on one process only.
  """
  directory = os.path.abspath(directory)
  _quiet_orbax_failures()
  try:
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(os.path.join(directory, "params"), params, force=True)
  except Exception as e:  # pylint: disable=broad-except
    _remove_partial_writes(directory)
    raise CheckpointError(f"the policy export to {directory} could not be written: "
                          f"{_write_cause(e, directory)}") from None
  if write_config:
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
      f.write(config_json)
  return directory


def load_policy_params(directory: str, abstract_params=None):
  """Loads exported parameters; with ``abstract_params`` they take its shapes/shardings.

  Without ``abstract_params`` every array lands whole on the first local device,
  whatever mesh or number of processes wrote the export (an export from a
  multi-host run loads on a laptop).

  Returns:
    ``(params, config_dict)``.
  """
  directory = os.path.abspath(directory)
  path = os.path.join(directory, "params")
  with ocp.StandardCheckpointer() as ckptr:
    if abstract_params is None:
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      abstract_params = jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
          ckptr.metadata(path).item_metadata.tree)
    params = ckptr.restore(path, abstract_params)
  with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  return params, config


def load_checkpoint_params(directory: str, step: int | None = None):
  """The policy parameters alone of a run's checkpoint, and its ``meta``.

  Only ``params`` is read (``partial_restore``): the optimizer state, twice the
  parameters' size, stays on disk. Every array lands whole on the first local device.

  Args:
    directory: a run's ``checkpoints/`` directory.
    step: the step to read (default: the newest).

  Returns:
    ``(step, params, meta)``.

  Raises:
    CheckpointError: ``directory`` holds no checkpoint, or no such ``step``.
  """
  directory = os.path.abspath(directory)
  steps = sorted(ocp.utils.checkpoint_steps(directory)) if os.path.isdir(directory) else []
  if not steps:
    raise CheckpointError(f"{directory} holds no checkpoint")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise CheckpointError(f"{directory} has no checkpoint {step} (it has {steps})")
  path = os.path.join(directory, str(step), "state")
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  with ocp.PyTreeCheckpointer() as ckptr:
    stored = ckptr.metadata(path).item_metadata.tree["params"]
    abstract = {"params": jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), stored)}
    restored = ckptr.restore(path, args=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True))
  with open(os.path.join(directory, str(step), "meta", "metadata"), encoding="utf-8") as f:
    meta = json.load(f)
  return step, restored["params"], meta


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of a concrete pytree."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
