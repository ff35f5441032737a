"""GRPO's group-normalised advantages and per-chunk loss weights (pure).

GRPO replaces the learned value baseline by the other attempts at the same
task: the env layer resets envs in groups (global env ``i`` is in group
``i // G``, ``G = env.group_size``), and every env's ``k``-th episode starts
from an initial state fixed by ``(seed, group, k)``. So the ``k``-th episodes
of the ``G`` envs of a group form one GRPO group, and an episode's advantage
is its return compared with its group's (:func:`group_advantages`; the
episode id of ``EpisodeStats(group, episode)`` in a run with ``num_episodes``
per env is e.g. ``group * num_episodes + episode``). Returns are episode
returns; every chunk of an episode gets the episode's advantage.

The policy loss is :func:`jaxvla.algorithms.ppo.ppo_loss` with
``value_coef=0`` and ``weights`` from :func:`chunk_weights`, flattened over the
``[E, K]`` (episodes, padded chunks) layout; padding chunks get weight 0.
"""

import jax
import jax.numpy as jnp

NORMALIZERS = ("chunks", "trajectory", "constant")


def group_advantages(returns: jax.Array, group_ids: jax.Array, num_groups: int, *,
                     scale: bool = True, eps: float = 1e-6,
                     valid: jax.Array | None = None) -> jax.Array:
  """GRPO advantage ``(R - mean_g) / (std_g + eps)`` of each episode.

  Statistics are over the valid members of each group, with the population
  std (ddof 0). A group with a single valid member has nothing to compare
  with: its advantage is 0.

  Args:
    returns: ``[N]`` episode returns.
    group_ids: ``int32 [N]`` group of each episode, in ``[0, num_groups)``.
    num_groups: number of groups (static).
    scale: divide by the group's std; False gives Dr. GRPO's ``R - mean_g``.
    eps: added to the std.
    valid: ``bool [N]`` episodes to use, or None for all; invalid ones are
      left out of the statistics and get advantage 0.

  Returns:
    ``float32 [N]`` advantages.
  """
  returns = jnp.asarray(returns, jnp.float32)
  group_ids = jnp.asarray(group_ids, jnp.int32)
  valid = (jnp.ones(returns.shape, bool) if valid is None else jnp.asarray(valid, bool))
  returns = jnp.where(valid, returns, 0.0)  # Padding may hold anything (even NaN).
  segment_sum = lambda x: jax.ops.segment_sum(x, group_ids, num_segments=num_groups)
  count = segment_sum(valid.astype(jnp.float32))
  mean = segment_sum(returns) / jnp.maximum(count, 1.0)
  centred = jnp.where(valid, returns - mean[group_ids], 0.0)
  adv = centred
  if scale:
    std = jnp.sqrt(segment_sum(jnp.square(centred)) / jnp.maximum(count, 1.0))
    adv = centred / (std[group_ids] + eps)
  return jnp.where(valid & (count[group_ids] > 1), adv, 0.0)


def chunk_weights(mask: jax.Array, normalizer: str) -> jax.Array:
  """Per-chunk loss weights of ``E`` episodes padded to ``K`` chunks.

  * "chunks": every valid chunk alike, ``1 / total valid chunks``.
  * "trajectory": each episode's mean over its chunks (``1 / |tau_e|``), then
    the mean over the episodes that have at least one chunk.
  * "constant": ``1 / (K * E_nonempty)``, a constant normaliser in place of
    ``1 / |tau_e|`` (Dr. GRPO): long episodes are not down-weighted per chunk.

  The valid weights sum to 1 for "chunks" and "trajectory" (0 if nothing is
  valid); for "constant" they sum to ``mean(|tau_e|) / K <= 1`` (mean over
  non-empty episodes).

  Args:
    mask: ``bool [E, K]`` the chunk exists (False: padding).
    normalizer: one of ``NORMALIZERS``.

  Returns:
    ``float32 [E, K]`` weights, 0 on padding.

  Raises:
    ValueError: naming an unknown ``normalizer`` and listing the choices.
  """
  if normalizer not in NORMALIZERS:
    raise ValueError(f"unknown chunk normalizer {normalizer!r}; choose one of {NORMALIZERS}")
  m = jnp.asarray(mask, bool).astype(jnp.float32)
  lengths = m.sum(axis=1)  # [E]
  nonempty = jnp.maximum(jnp.sum(lengths > 0), 1).astype(jnp.float32)
  if normalizer == "chunks":
    return m / jnp.maximum(m.sum(), 1.0)
  if normalizer == "trajectory":
    return m / (jnp.maximum(lengths, 1.0)[:, None] * nonempty)
  return m / (m.shape[1] * nonempty)


# Normalizers whose weights a micro-batch can compute alone (given the update's episode count).
STREAMABLE_NORMALIZERS = ("trajectory", "constant")


def check_normalizer(normalizer: str, streamed: bool) -> None:
  """Raises ``ValueError`` naming ``config.grpo.loss_normalizer`` if it cannot be used.

  Args:
    normalizer: the configured name.
    streamed: the streamed learner will use it (micro-batches weighted alone).
  """
  if normalizer not in NORMALIZERS:
    raise ValueError(f"config.grpo.loss_normalizer={normalizer!r} must be one of {NORMALIZERS}")
  if streamed and normalizer not in STREAMABLE_NORMALIZERS:
    raise ValueError(f"config.grpo.loss_normalizer={normalizer!r} cannot be streamed (its "
                     "weights need the whole update's chunk count); use one of "
                     f"{STREAMABLE_NORMALIZERS} with pipeline.streamer")


def streamed_weights(mask: jax.Array, normalizer: str, num_episodes_total: jax.Array
                     ) -> jax.Array:
  """Global per-chunk weights ``[e, K]`` of a micro-batch's episodes ``mask [e, K]``.

  * "trajectory": ``mask / (|tau_e| * E_total)``;
  * "constant": ``mask / (K * E_total)``,

  so that the weights of all the micro-batches of an update of ``E_total``
  episodes are :func:`chunk_weights` of the whole (every episode has a chunk).

  Raises:
    ValueError: naming ``config.grpo.loss_normalizer`` when it is not streamable
      ("chunks" needs the update's total chunk count, known only at its end).
  """
  check_normalizer(normalizer, streamed=True)
  m = jnp.asarray(mask, bool).astype(jnp.float32)
  if normalizer == "trajectory":
    per_episode = jnp.maximum(m.sum(axis=1, keepdims=True), 1.0)
  else:
    per_episode = jnp.float32(m.shape[1])
  return m / (per_episode * num_episodes_total)
