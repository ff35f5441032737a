"""Benchmarks that print their figures (env pool, ...)."""
