"""The rollout stage: acting on env batches and turning chunks into queue items.

* :mod:`jaxvla.rollout.rollout`: :class:`Rollout`, lockstep or first-ready stepping.
* :mod:`jaxvla.rollout.segments` / :mod:`jaxvla.rollout.groups`: PPO segments
  and GRPO episode groups, cut into :class:`jaxvla.types.Item` s.
* :mod:`jaxvla.rollout.pacer`: bounded staleness by pacing segment starts.

The rollout's training success is tracked by :mod:`jaxvla.evaluation.success`, which
also plays the fixed-seed evaluation episodes.
"""
