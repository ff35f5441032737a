"""Weak scaling over processes: the config of ``python -m jaxvla.bench.scaling``.

``configs/default.py:bench`` (ColorReach with a slept, long-tailed step latency in
env worker processes, the tiny pi0, no warm start), made latency-bound so that a
second process on the same 2-core machine adds env throughput instead of
competing for the cores:

* Every process steps its own pool of ``num_envs`` (32) envs in ``env_workers``
  (8) worker processes, as every host of a multi-host run does: 2 processes have
  twice the envs and env workers of 1, and each process's work is the same.
* The env is the limit: a step sleeps 32 ms at the median, 8 times the 'bench'
  variant's 4 ms. One process's pool then makes about 150 env steps/s, an update's
  640 steps every 4 s or so, while its rollout and learner need well under half of
  that time even when two processes share the cores.
* The learner is data-parallel (``mesh.data=-1``, ``mesh.fsdp=1``): the tiny
  pi0's 0.34 M parameters are replicated on every process's device and their
  gradients all-reduced once per optimizer step. FSDP, the default mesh, gathers
  every layer's parameters over the processes in the forward and backward passes;
  over CPU collectives (gloo) that made a 2-process update about 6 times as long
  as a 1-process one and the learner the limit (measured on the 2-core machine
  while other jobs ran, at 16 ms: 293 env steps/s with FSDP and 448 data-parallel
  for two processes, against 238 for one).

Everything else is ``configs/default.py:bench``.
"""

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg:
    raise ValueError(f"configs/scaling.py takes no variant, got {arg!r}")
  c = default.get_config("bench")
  c.env.latency_ms = 32.0  # Median slept latency per env step: the env pool is the limit.
  c.mesh.data = -1  # Data parallelism over every process's device (params replicated).
  c.mesh.fsdp = 1
  return c
