"""The learner: train state and jitted update steps."""
