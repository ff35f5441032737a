"""orbax checkpoints of the full train state, and parameter-only policy exports.

A checkpoint holds two items: ``state`` (the learner's :class:`TrainState`:
params, optimizer state, step, PRNG key) and ``meta`` (JSON: env steps,
iteration, warm-start figures). An export holds ``params`` alone plus the config
as JSON, and loads without the optimizer.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used; the message names the step and the cause."""


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _path_str(path) -> str:
  """A tree path as ``params/PaliGemma/llm/...`` (dict keys, attributes, indices alike)."""
  out = []
  for k in path:
    out.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
  return "/".join(out)


def params_mismatch(stored_tree, abstract_params) -> str | None:
  """The first difference between a checkpoint's stored params (orbax metadata) and
  the params the config builds, as one line; None if they fit."""
  stored = {_path_str(p): tuple(m.shape) for p, m in
            jax.tree_util.tree_flatten_with_path(stored_tree)[0]}
  wanted = {_path_str(p): tuple(x.shape) for p, x in
            jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
  for path, shape in wanted.items():
    if path not in stored:
      return f"params/{path} (shape {shape}) is not in the checkpoint"
    if stored[path] != shape:
      return f"params/{path} is stored with shape {stored[path]}, the config's model has {shape}"
  extra = sorted(set(stored) - set(wanted))
  if extra:
    return f"the checkpoint has params/{extra[0]}, which the config's model does not"
  return None


class Checkpointer:
  """Periodic, asynchronous saves of the train state under ``directory``."""

  def __init__(self, directory: str, max_to_keep: int):
    self.manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        # Handlers named up front, so a fresh manager can read a step's metadata.
        item_handlers=dict(state=ocp.StandardCheckpointHandler(),
                           meta=ocp.JsonCheckpointHandler()))

  def save(self, step: int, state, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore_latest(self, abstract_state, hint: str = ""):
    """``(step, state, meta)`` of the newest intact checkpoint.

    A damaged step (unreadable metadata, a truncated or missing array file) is
    skipped with a warning for the one before it. Params that do not fit the
    config's model (another ``model.name`` or ``model.variant``) are an error,
    not damage: the message names the step, the first differing path and ``hint``
    (e.g. the config keys that changed since the checkpoint was written).

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
      metadata_file = os.path.join(str(directory), str(step), "state", "_METADATA")
      if not os.path.exists(metadata_file):
        damaged(step, f"{metadata_file} is missing")
        continue
      try:
        stored_params = self.manager.item_metadata(step)["state"].tree["params"]
      except Exception as e:  # pylint: disable=broad-except
        damaged(step, f"unreadable ({_first_line(e)})")
        continue
      mismatch = params_mismatch(stored_params, abstract_state.params)
      if mismatch:
        raise CheckpointError(f"checkpoint {step} in {directory} does not fit this run's "
                              f"model: {mismatch}{hint}")
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
    self.manager.wait_until_finished()
    self.manager.close()


def has_checkpoint(directory: str) -> bool:
  """Whether ``directory`` holds a finished checkpoint step (without opening a manager)."""
  if not os.path.isdir(directory):
    return False
  return bool(ocp.utils.checkpoint_steps(os.path.abspath(directory)))


def export_policy(directory: str, params, config_json: str, write_config: bool = True) -> str:
  """Writes the policy parameters alone (for inference) and the run config.

  Multi-process: every process calls it (orbax writes each array once);
  ``write_config`` on one process only.
  """
  directory = os.path.abspath(directory)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(directory, "params"), params, force=True)
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


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of a concrete pytree."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
