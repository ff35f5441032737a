"""RL algorithms as pure functions (advantages, losses)."""
