"""Checkpoints, exports and the workdir: what a run writes and how a policy is read back."""
