"""Rollout: the trajectory type, synchronous collection and evaluation."""
