"""orbax checkpoints of the full train state, and parameter-only policy exports.

A checkpoint holds two items: ``state`` (the learner's :class:`TrainState`:
params, optimizer state, step, PRNG key) and ``meta`` (JSON: env steps,
iteration, warm-start figures). An export holds ``params`` alone plus the config
as JSON, and loads without the optimizer.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Periodic, asynchronous saves of the train state under ``directory``."""

  def __init__(self, directory: str, max_to_keep: int):
    self.manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "meta"))

  def save(self, step: int, state, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore(self, step: int, abstract_state):
    """Restores ``(state, meta)`` at ``step`` onto ``abstract_state``'s structure/shardings."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


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
