"""Advantage-weighted regression of a flow policy on its own chunks: the weights' maths.

AWR (Peng et al. 2019, "Advantage-Weighted Regression") improves a policy by supervised
regression on the actions it took, each weighted by how much better than expected it
turned out: ``w = exp(A / beta)``, capped at ``max_weight``. CRR's binary filter (Wang et
al. 2020, "Critic Regularized Regression") keeps the better-than-expected actions alone:
``w = 1[A > 0]``. For a flow-matching policy the regression is its own BC loss
(``Policy.bc_loss``) on the executed chunk, so no log-probability of the sampler enters:
the update is a weighted SFT step, on the policy's own rollouts, that trains every layer
the warm start trained (the vision tower included).

The objective that uses these weights is :class:`jaxvla.learner.objectives.AWRObjective`;
``config.awr`` holds the settings (:data:`WEIGHTINGS`, ``beta``, ``max_weight``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WEIGHTINGS = ("exp", "binary")  # config.awr.weighting


def check(weighting: str, beta: float, max_weight: float) -> None:
  """Raises ValueError naming the ``config.awr`` key of a bad setting."""
  if weighting not in WEIGHTINGS:
    raise ValueError(f"config.awr.weighting must be one of {WEIGHTINGS}, got {weighting!r}")
  if not beta > 0:
    raise ValueError(f"config.awr.beta must be > 0, got {beta}")
  if not max_weight >= 1:
    raise ValueError(f"config.awr.max_weight must be >= 1, got {max_weight}")


def weights(advantages: jax.Array, *, weighting: str, beta: float,
            max_weight: float) -> jax.Array:
  """Each chunk's regression weight ``[N]`` from its advantage ``[N]`` (no gradient).

  'exp': ``min(exp(A / beta), max_weight)`` (AWR); 'binary': ``1[A > 0]`` (CRR).
  """
  a = jax.lax.stop_gradient(advantages)
  if weighting == "binary":
    return (a > 0).astype(jnp.float32)
  # exp(min(.)) rather than min(exp(.)): no overflow for a large advantage.
  return jnp.exp(jnp.minimum(a / beta, jnp.log(max_weight))).astype(jnp.float32)
