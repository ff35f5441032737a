"""The asynchronous pipeline: trajectory queue, weight broadcast, rollout, modes, stage clock."""
