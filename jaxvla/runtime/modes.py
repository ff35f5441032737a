"""The pipeline's modes and asynchrony levels: the table that the pipeline, the config
checks and the planner all read (and the owner of the ``pipeline.mode`` check).

``config.pipeline.mode``:

* ``sync_colocated``: one set of devices; collect a full batch with the current
  params (every env lockstep, ``rollout_len`` chunks), train on it, repeat.
* ``sync_disaggregated``: the same lockstep, but the rollout acts with its own
  copy of the params on the rollout devices, refreshed by a (waited-for) weight
  broadcast after every update.
* ``async`` with three independent switches:

  - L1 ``train_async``: the rollout runs in its own thread, feeding the
    trajectory queue while the learner trains; params reach it through the
    asynchronous weight broadcast.
  - L2 ``rollout_async``: first-ready env batching over the env pool
    (``recv(b_max, t_max)``) instead of lockstep.
  - L3 ``streamer``: the learner computes the gradient of each micro-batch
    (``micro_batch_segments`` env segments) as soon as it is dequeued and applies
    one optimizer update per minibatch from the summed gradients.

  With every switch off, ``async`` is the synchronous baseline again (with the
  broadcast path), so each switch's gain is one run each.
"""

from __future__ import annotations

import dataclasses

import ml_collections

MODES = ("sync_colocated", "sync_disaggregated", "async")


@dataclasses.dataclass(frozen=True)
class Levels:
  """Which asynchrony levels are on (all off: a synchronous baseline)."""
  train_async: bool
  rollout_async: bool
  streamer: bool
  separate_params: bool  # The rollout acts with broadcast copies (not the learner's arrays).

  @classmethod
  def from_config(cls, pipeline: ml_collections.ConfigDict) -> "Levels":
    """The levels of ``config.pipeline``.

    Raises:
      ValueError: naming ``config.pipeline.mode`` if it is not one of :data:`MODES`.
    """
    if pipeline.mode not in MODES:
      raise ValueError(f"config.pipeline.mode must be one of {MODES}, got {pipeline.mode!r}")
    on = pipeline.mode == "async"
    return cls(train_async=on and pipeline.train_async,
               rollout_async=on and pipeline.rollout_async,
               streamer=on and pipeline.streamer,
               separate_params=pipeline.mode != "sync_colocated")

  def name(self, mode: str) -> str:
    if mode != "async":
      return mode
    parts = [n for n, on in (("L1", self.train_async), ("L2", self.rollout_async),
                             ("L3", self.streamer)) if on]
    return "async[" + "+".join(parts or ["none"]) + "]"
