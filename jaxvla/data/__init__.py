"""Demonstration data for supervised warm starts."""
