"""Device meshes and multi-host runs: logical-axis sharding and jax.distributed."""
