"""The default map from logical axis names to mesh axes: a constant, without jax.

``jaxvla.defaults`` (and so every config and ``jaxvla.main``'s flag parsing) reads it
before any backend loads; :mod:`jaxvla.parallel.sharding` owns what the rules mean.
Keeping jax out of this module keeps it out of ``jaxvla.main``'s imports, which each env
worker process re-imports when it starts.
"""

from __future__ import annotations

from typing import Any

# Logical axis -> mesh axes: the default of config.mesh.rules (model code names logical
# axes only). Batch and embedding dims FSDP-sharded, heads and MLP tensor-parallel.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", None),
    ("head_dim", None),
    ("layers", None),
    ("action", None),
    ("patch", None),
    ("channels", None),
)
