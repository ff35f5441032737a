"""Demonstration data for supervised warm starts: datasets on disk (RLDS, LeRobot), the
grain pipeline that feeds BC, normalisation statistics, and the collector (docs/guides/data.md)."""
