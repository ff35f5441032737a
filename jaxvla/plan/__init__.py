"""The planner (``python -m jaxvla.plan``): a discrete-event model of the pipeline, the stage
costs it runs on, its check against measured runs, and placements for N accelerators
(docs/results/scaling.md)."""
