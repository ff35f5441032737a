"""Policy compute benchmark: ``python -m jaxvla.bench.policy``.

This module owns the latency / FLOPs / memory measurements of the policies and
their learner steps. For every model and variant it measures

* ``act``: the jitted ``policy.act(params, batch, rng, --act_mode)`` at each
  ``--batch_sizes`` and ``--denoise_steps`` (AOT-compiled first, so compile time
  is excluded and reported apart; one warm-up call; median of ``--repeats`` calls,
  each ended by ``jax.block_until_ready`` on the whole output pytree);
* ``bc_step``: one ``Learner.bc_step`` at ``--learner_batch``;
* ``ppo_minibatch``: one ``Learner.update`` on a ``[1, --learner_batch]``
  trajectory with one epoch and one minibatch, i.e. exactly one PPO minibatch
  step (``evaluate`` over ``--learner_denoise_steps`` steps, backward, Adam).
  ``--learner_ops`` picks which of the two run.

FLOPs per call, two ways:

* ``model_flops``: matmul and convolution FLOPs (``2 * MACs``) counted on the
  jaxpr, with every ``lax.scan`` body multiplied by its length (Gemma / SigLIP
  layers and the denoise loop are scans). This is the figure MFU uses; for a
  rematerialised learner step it is counted on the same step without remat
  (``executed_gflop`` includes the recomputation).
* ``xla_flops``: XLA's ``compiled.cost_analysis()["flops"]``. XLA counts a
  while-loop body ONCE, whatever its trip count, so for these scanned models it
  is far below the real count; it is printed only as a cross-check.

MFU = model_flops / median time / the device's dense peak for the compute dtype
(``jax.devices()[0].device_kind``: H100 / H200 989 TFLOP/s bf16, ...); null on
devices without a known peak (CPUs).

``--memory`` instead AOT-compiles the learner step of a full model
(``jax.jit(...).lower(ShapeDtypeStructs).compile()``: nothing is allocated) at
``--memory_batch`` with remat on and / or off, and prints
``compiled.memory_analysis()`` (argument, output, alias, temp, generated code) and
the implied peak in GiB. On a CPU this is XLA:CPU's buffer assignment: an
estimate of what the GPU compiler would assign, not a GPU measurement.

Prints a table and, last, one JSON line with every row.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags

from jaxvla import defaults, types
from jaxvla.envs import protocol
from jaxvla.learner import learner as learner_lib
from jaxvla.learner import trainable as trainable_lib
from jaxvla.models import summary as summary_lib

_MODELS = flags.DEFINE_list("models", ["pi0", "pi05"], "Policies (config.model.name).")
_VARIANTS = flags.DEFINE_list("variants", ["tiny", "small"], "Sizes: tiny, small, full.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "16", "64"], "act batch sizes.")
_DENOISE_STEPS = flags.DEFINE_list("denoise_steps", ["4", "10"], "act denoise steps K.")
_DTYPE = flags.DEFINE_enum("dtype", "", ["", "float32", "bfloat16"],
                           "Compute dtype ('': float32 for tiny/small, bfloat16 for full).")
_LEARNER_BATCH = flags.DEFINE_integer("learner_batch", 16,
                                      "Chunks per bc_step / PPO minibatch (0: skip learner).")
LEARNER_OPS = ("bc_step", "ppo_minibatch")
_LEARNER_OPS = flags.DEFINE_multi_enum("learner_ops", list(LEARNER_OPS), LEARNER_OPS,
                                       "Learner steps to time at --learner_batch.")
_LEARNER_DENOISE_STEPS = flags.DEFINE_integer("learner_denoise_steps", 4,
                                              "Denoise steps K of the PPO minibatch step.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per row (median reported).")
_CHUNK_LEN = flags.DEFINE_integer("chunk_len", 0, "Actions per chunk (0: 5 tiny/small, 10 full).")
_REMAT = flags.DEFINE_enum("remat", "auto", ["auto", "on", "off"],
                           "Learner layer remat (auto: on for full, off otherwise).")
_ACT_MODE = flags.DEFINE_string("act_mode", "train", "act mode ('train': the RL sampler).")
_SEED = flags.DEFINE_integer("seed", 0, "Parameter / input seed.")
_MEMORY = flags.DEFINE_bool("memory", False,
                            "AOT-compile the learner step of --memory_model and print its "
                            "memory analysis instead of timing.")
_MEMORY_MODEL = flags.DEFINE_string("memory_model", "pi0", "--memory: the policy.")
_MEMORY_VARIANT = flags.DEFINE_string("memory_variant", "full", "--memory: the variant.")
_MEMORY_BATCH = flags.DEFINE_integer("memory_batch", 8, "--memory: micro-batch (chunks).")
_MEMORY_REMAT = flags.DEFINE_list("memory_remat", ["on", "off"], "--memory: remat settings.")
_MEMORY_STEPS = flags.DEFINE_list(
    "memory_steps", ["bc", "ppo"],
    "--memory: learner steps (bc, ppo, streamed: the streamed learner's heaviest program, a "
    "micro-batch's gradient under the update's proximal snapshot, with what stays resident "
    "beside it).")
_MEMORY_ROLLOUT_DTYPE = flags.DEFINE_string(
    "memory_rollout_dtype", "bfloat16", "--memory_steps=streamed: config.pipeline."
    "rollout_dtype (the rollout copy's and the proximal snapshot's dtype; '' float32).")
_MEMORY_MINIBATCHES = flags.DEFINE_integer(
    "memory_minibatches", 1, "--memory: PPO minibatches of --memory_batch chunks in one "
    "update (> 1: the whole epochs update of a pipeline's batch, op 'ppo_update').")

GIB = 2**30
# Dense (no sparsity) peak TFLOP/s by device_kind substring, most specific first; float32
# matmuls are rated at the TF32 tensor-core peak (XLA's default precision on these GPUs).
PEAK_TFLOPS = (
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 378.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float32": 418.0}),
    ("H100", {"bfloat16": 989.4, "float32": 494.7}),
    ("H200", {"bfloat16": 989.4, "float32": 494.7}),
    ("GH200", {"bfloat16": 989.4, "float32": 494.7}),
    ("A100", {"bfloat16": 312.0, "float32": 156.0}),
)
XLA_CPU_MEMORY_NOTE = ("XLA:CPU memory_analysis: the CPU compiler's buffer assignment, an "
                       "estimate of the GPU's (different fusion, scheduling and bf16 handling); "
                       "confirm with --memory on the GPU")


# ------------------------------------------------------------------- FLOPs --
def _sub_jaxprs(value: Any):
  """The jaxprs inside an equation parameter (ClosedJaxpr, Jaxpr, or sequences of them)."""
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax.extend.core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def jaxpr_flops(jaxpr) -> float:
  """Matmul + convolution FLOPs (``2 * MACs``) of a (closed) jaxpr, scans times their length.

  ``cond``: the most expensive branch. ``while`` (unknown trip count): its body once.
  Elementwise ops, reductions and softmax are not counted (the MFU convention).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    name, params = eqn.primitive.name, eqn.params
    if name == "dot_general":
      (_, rc), (_, rb) = params["dimension_numbers"]
      lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
      rhs_free = math.prod(d for i, d in enumerate(rhs.shape) if i not in rc and i not in rb)
      total += 2.0 * math.prod(lhs.shape) * rhs_free
    elif name == "conv_general_dilated":
      out, rhs = eqn.outvars[0].aval, eqn.invars[1].aval
      rhs_spec = params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
      per_output = rhs.shape[rhs_spec[1]] * math.prod(rhs.shape[i] for i in rhs_spec[2:])
      total += 2.0 * math.prod(out.shape) * per_output
    elif name == "scan":
      total += params["length"] * jaxpr_flops(params["jaxpr"])
    elif name == "cond":
      total += max(jaxpr_flops(b) for b in params["branches"])
    else:
      for value in params.values():
        for sub in _sub_jaxprs(value):
          total += jaxpr_flops(sub)
  return total


def model_flops(fn: Callable, *args) -> float:
  """:func:`jaxpr_flops` of ``fn(*args)`` (``args`` may be ShapeDtypeStructs)."""
  return jaxpr_flops(jax.make_jaxpr(fn)(*args))


def xla_flops(compiled: jax.stages.Compiled) -> float | None:
  """``compiled.cost_analysis()["flops"]`` (while-loop bodies counted once), or None.

  None where the backend has no cost analysis or reports no ``flops``. Nothing is
  caught: ``Compiled.cost_analysis`` itself returns None on a backend without one
  (it turns XLA's UNIMPLEMENTED status and NotImplementedError into None), so an
  exception here is a real failure.
  """
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float(cost["flops"]) if cost and "flops" in cost else None


def peak_tflops(device_kind: str, dtype: str) -> float | None:
  """The dense peak TFLOP/s of ``device_kind`` for ``dtype`` matmuls, or None if unknown."""
  for key, peaks in PEAK_TFLOPS:
    if key.lower() in device_kind.lower():
      return peaks.get(dtype)
  return None


# ------------------------------------------------------------------ inputs --
def bench_config(model: str, variant: str, *, dtype: str, chunk_len: int, denoise_steps: int,
                 remat: bool) -> ml_collections.ConfigDict:
  """The ``model`` sub-config (:func:`summary.model_config`) with the benchmark's knobs."""
  c = summary_lib.model_config(model, variant, dtype=dtype or None)
  c.chunk_len = chunk_len or (10 if variant == "full" else c.chunk_len)
  c.num_denoise_steps = denoise_steps
  c.remat = remat
  return c


def make_batch(policy, spec: protocol.EnvSpec, batch_size: int, seed: int) -> dict:
  """``policy.prepare`` of a random observation of ``batch_size`` envs (numpy arrays)."""
  rng = np.random.default_rng(seed)
  h, w, c = spec.image_shape
  obs = protocol.Observation(
      images=rng.integers(0, 256, (batch_size, len(spec.camera_names), h, w, c), np.uint8),
      state=rng.uniform(-1, 1, (batch_size, spec.state_dim)).astype(np.float32),
      instruction=np.array(["move to the red target"] * batch_size, dtype=object))
  return policy.prepare(obs)


def make_trajectory(batch: dict, chain, seed: int) -> types.Trajectory:
  """A ``[1, B]`` trajectory of ``batch`` with (zero) chains shaped like ``chain [B, ...]``."""
  b = chain.shape[0]
  rng = np.random.default_rng(seed)
  zeros = np.zeros((1, b), np.float32)
  return types.Trajectory(
      batch=jax.tree.map(lambda x: x[None], batch), chain=np.zeros((1, *chain.shape), chain.dtype),
      log_prob=zeros, log_prob_dims=np.zeros((1, b) + chain.shape[2:], np.float32), value=zeros,
      reward=rng.standard_normal((1, b)).astype(np.float32),
      done=np.zeros((1, b), bool), terminated=np.zeros((1, b), bool), final_value=zeros,
      steps=np.ones((1, b), np.int32),
      bootstrap_value=np.zeros((b,), np.float32), policy_version=np.zeros((1, b), np.int32))


def make_learner(policy, num_minibatches: int = 1,
                 rollout_dtype: str = "") -> learner_lib.Learner:
  """``Learner`` with the default config's ``bc`` / ``rl``, PPO at 1 epoch x
  ``num_minibatches`` (``rollout_dtype``: ``config.pipeline.rollout_dtype``)."""
  c = defaults.get_config()
  c.rl.num_epochs, c.rl.num_minibatches = 1, num_minibatches
  c.pipeline.rollout_dtype = rollout_dtype
  return learner_lib.Learner(policy, c)


def _gib(tree) -> float:
  """GiB of the arrays or ShapeDtypeStructs in ``tree``."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree)) / GIB


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


# ----------------------------------------------------------------- timing --
def time_compiled(compiled, args: tuple, repeats: int, *,
                  carry_first: bool = False) -> tuple[list[float], Any]:
  """Seconds of ``repeats`` calls after one warm-up, each blocked on its whole output.

  ``carry_first``: the first argument is donated and the call returns its
  replacement first (``(state, aux) = step(state, ...)``), which is fed back.

  Returns:
    The times and the last call's output.
  """
  args = list(args)
  out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    if carry_first:
      args[0] = out[0]
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return times, out


def _row(base: dict, op: str, batch: int, k: int | None, times: list[float], compile_s: float,
         flops: float, xla: float | None, peak: float | None,
         executed_flops: float | None = None) -> dict:
  med = statistics.median(times)
  achieved = flops / med / 1e12
  executed_flops = flops if executed_flops is None else executed_flops
  return dict(base, op=op, batch=batch, denoise_steps=k, median_ms=round(med * 1e3, 3),
              min_ms=round(min(times) * 1e3, 3), compile_s=round(compile_s, 2),
              model_gflop=round(flops / 1e9, 4), executed_gflop=round(executed_flops / 1e9, 4),
              xla_gflop=None if xla is None else round(xla / 1e9, 4),
              achieved_tflops=round(achieved, 5),
              mfu=None if peak is None else round(achieved / peak, 5),
              samples_per_s=round(batch / med, 2), repeats=len(times),
              device_peak_gib=device_peak_gib())


def device_peak_gib() -> float | None:
  """The device allocator's peak bytes in use so far (GiB), or None where not reported.

  ``jax.local_devices()[0].memory_stats()["peak_bytes_in_use"]`` on GPUs / TPUs: a
  running maximum over the process, so a row's figure is the peak up to and including
  that row (the learner rows come last and dominate).
  """
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else round(peak / GIB, 3)


def _compile(jitted, *args):
  t0 = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def _dtype(variant: str) -> str:
  return _DTYPE.value or ("bfloat16" if variant == "full" else "float32")


def measure(model: str, variant: str, device_kind: str) -> list[dict]:
  """Every act row, then the learner rows, of one (model, variant)."""
  dtype = _dtype(variant)
  remat = {"on": True, "off": False}.get(_REMAT.value, variant == "full")
  peak = peak_tflops(device_kind, dtype)
  spec = summary_lib.env_spec(variant)
  rows: list[dict] = []
  params = n_params = None
  for k in map(int, _DENOISE_STEPS.value):
    cfg = bench_config(model, variant, dtype=dtype, chunk_len=_CHUNK_LEN.value,
                       denoise_steps=k, remat=remat)
    policy = summary_lib.make_policy(model, variant, config=cfg)
    if params is None:
      params = policy.init(jax.random.PRNGKey(_SEED.value))
      n_params = summary_lib.count(params)["total_with_rl"]
    base = dict(model=model, variant=variant, dtype=dtype, chunk_len=cfg.chunk_len,
                params=n_params, remat=None)
    act = jax.jit(lambda p, b, r, policy=policy: policy.act(p, b, r, _ACT_MODE.value))
    flow = getattr(policy, "num_steps", None) is not None  # action tokens: no denoise steps
    for bs in map(int, _BATCH_SIZES.value):
      batch = jax.device_put(make_batch(policy, spec, bs, _SEED.value))
      rng = jax.random.PRNGKey(_SEED.value + 1)
      compiled, compile_s = _compile(act, params, batch, rng)
      times, _ = time_compiled(compiled, (params, batch, rng), _REPEATS.value)
      rows.append(_row(base, "act", bs, k if flow else None, times, compile_s,
                       model_flops(act, params, batch, rng), xla_flops(compiled), peak))
      print_row(rows[-1])
      del batch, compiled
    if not flow:
      break
  if _LEARNER_BATCH.value > 0:
    rows += measure_learner(model, variant, dtype, remat, params, n_params, peak, spec)
  return rows


def learner_flops(model: str, variant: str, dtype: str, k: int, op: str, remat: bool,
                  *args, num_minibatches: int = 1) -> tuple[float, float]:
  """(model FLOPs, executed FLOPs) of learner step ``op`` on abstract ``args``
  (``ppo_update``: ``num_minibatches`` PPO minibatches).

  Model FLOPs exclude remat's recomputation (the MFU convention): they are
  counted on the same step built without remat. Executed FLOPs include it.
  """
  def count_for(remat_: bool) -> float:
    cfg = bench_config(model, variant, dtype=dtype, chunk_len=_CHUNK_LEN.value,
                       denoise_steps=k, remat=remat_)
    lrn = make_learner(summary_lib.make_policy(model, variant, config=cfg), num_minibatches)
    step = lrn.bc_step_jit if op == "bc_step" else lrn.update_jit
    return model_flops(step, *args)
  executed = count_for(remat)
  return (count_for(False) if remat else executed), executed


def measure_learner(model: str, variant: str, dtype: str, remat: bool, params, n_params: int,
                    peak: float | None, spec: protocol.EnvSpec) -> list[dict]:
  """``bc_step``, then one PPO minibatch (those of ``--learner_ops``), at ``--learner_batch``
  (consumes ``params``)."""
  k, bs = _LEARNER_DENOISE_STEPS.value, _LEARNER_BATCH.value
  cfg = bench_config(model, variant, dtype=dtype, chunk_len=_CHUNK_LEN.value, denoise_steps=k,
                     remat=remat)
  policy = summary_lib.make_policy(model, variant, config=cfg)
  lrn = make_learner(policy)
  base = dict(model=model, variant=variant, dtype=dtype, chunk_len=cfg.chunk_len,
              params=n_params, remat=remat)
  batch = make_batch(policy, spec, bs, _SEED.value)
  actions = np.random.default_rng(_SEED.value).uniform(
      -1, 1, (bs, policy.chunk_len, spec.action_dim)).astype(np.float32)
  rng = jax.random.PRNGKey(_SEED.value + 2)
  chain = jax.eval_shape(lambda p, b, r: policy.act(p, b, r, _ACT_MODE.value), params, batch,
                         rng).chain
  traj = jax.device_put(make_trajectory(batch, chain, _SEED.value))
  mask = np.ones(actions.shape[:2], bool)  # Every action of every chunk is real.
  batch, actions, mask = jax.device_put((batch, actions, mask))
  state = learner_lib.init_state(params, lrn.bc_tx, rng)  # donated by the steps below
  del params
  rows = []
  steps = (("bc_step", lrn.bc_step_jit, (batch, actions, mask)),
           ("ppo_minibatch", lrn.update_jit, (traj,)))
  for op, step, data in (s for s in steps if s[0] in _LEARNER_OPS.value):
    flops, executed = learner_flops(model, variant, dtype, k, op, remat, _abstract(state),
                                    *_abstract(data))
    compiled, compile_s = _compile(step, state, *data)
    times, out = time_compiled(compiled, (state, *data), _REPEATS.value, carry_first=True)
    state = out[0]  # bc and PPO optimizers are both clip + Adam: the state carries over.
    flow = getattr(policy, "num_steps", None) is not None
    rows.append(_row(base, op, bs, k if op == "ppo_minibatch" and flow else None, times, compile_s,
                     flops, xla_flops(compiled), peak, executed))
    print_row(rows[-1])
  return rows


# ----------------------------------------------------------------- memory --
def memory_rows() -> list[dict]:
  """AOT-compiled learner steps of ``--memory_model`` (abstract inputs) and their memory."""
  model, variant, bs = _MEMORY_MODEL.value, _MEMORY_VARIANT.value, _MEMORY_BATCH.value
  dtype = _dtype(variant)
  spec = summary_lib.env_spec(variant)
  rows = []
  for remat_flag in _MEMORY_REMAT.value:
    if remat_flag not in ("on", "off"):
      raise ValueError(f"--memory_remat: {remat_flag!r} is not 'on' or 'off'")
    remat = remat_flag == "on"
    cfg = bench_config(model, variant, dtype=dtype, chunk_len=_CHUNK_LEN.value,
                       denoise_steps=_LEARNER_DENOISE_STEPS.value, remat=remat)
    policy = summary_lib.make_policy(model, variant, config=cfg)
    nm = _MEMORY_MINIBATCHES.value
    if nm < 1:
      raise ValueError(f"--memory_minibatches: must be >= 1, got {nm}")
    lrn = make_learner(policy, nm, _MEMORY_ROLLOUT_DTYPE.value)
    params = policy.abstract_params()
    n_params = summary_lib.count(params)["total_with_rl"]
    state = jax.eval_shape(
        lambda p: learner_lib.init_state(p, lrn.bc_tx, jax.random.PRNGKey(0)), params)
    batch_np = make_batch(policy, spec, bs, _SEED.value)
    batch = _abstract(batch_np)
    chain_of = lambda b: jax.eval_shape(lambda p, b_, r: policy.act(p, b_, r, _ACT_MODE.value),
                                        params, b, jax.ShapeDtypeStruct((2,), jnp.uint32)).chain
    for step_name in _MEMORY_STEPS.value:
      resident = None  # GiB that stay on the device beside the program, by what holds them
      if step_name == "bc":
        step, op = lrn.bc_step_jit, "bc_step"
        args = (state, batch,
                jax.ShapeDtypeStruct((bs, policy.chunk_len, spec.action_dim), jnp.float32),
                jax.ShapeDtypeStruct((bs, policy.chunk_len), bool))  # (the real-action mask)
      elif step_name == "ppo":
        step, op = lrn.update_jit, "ppo_minibatch" if nm == 1 else "ppo_update"
        batch_all = jax.tree.map(lambda x: np.concatenate([x] * nm), batch_np)
        args = (state, _abstract(make_trajectory(batch_all, chain_of(_abstract(batch_all)),
                                                 _SEED.value)))
      elif step_name == "streamed":
        # L3 with several minibatches: a later minibatch's micro-batch of ``bs`` chunks is
        # evaluated under the snapshot the update started from. Beside the program stay
        # the Adam moments and the rollout's copy of the params (the gradient
        # accumulator too when a minibatch takes several micro-batches).
        op = "streamed_micro_batch"
        step = lrn._micro_grads_proximal_jit  # pylint: disable=protected-access
        scalar = lambda dt: jax.ShapeDtypeStruct((), dt)
        args = (params, _abstract(make_trajectory(batch_np, chain_of(batch), _SEED.value)),
                scalar(jnp.float32), scalar(jnp.int32),
                jax.eval_shape(lrn._snapshot_jit, params))  # pylint: disable=protected-access
        rollout_copy = jax.eval_shape(
            lambda p: trainable_lib.cast_floating(p, _MEMORY_ROLLOUT_DTYPE.value or None), params)
        resident = dict(adam=_gib(state.opt_state), rollout_copy=_gib(rollout_copy))
      else:
        raise ValueError(f"--memory_steps: {step_name!r} is not 'bc', 'ppo' or 'streamed'")
      print(f"# compiling {model}/{variant} {op} batch={bs} remat={remat_flag} ...", flush=True)
      compiled, compile_s = _compile(step, *args)
      m = compiled.memory_analysis()
      if m is None:
        raise RuntimeError(f"backend {jax.devices()[0].platform!r} gives no memory_analysis() "
                           f"for {op}")
      sizes = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
                   alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
                   generated_code=m.generated_code_size_in_bytes)
      peak = (sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
              + sizes["generated_code"])
      static = 4 * n_params * 4  # float32 params + Adam mu, nu + grads
      extra = {}
      if resident is None:
        flops, executed = learner_flops(model, variant, dtype, _LEARNER_DENOISE_STEPS.value,
                                        op, remat, *args, num_minibatches=nm)
      else:  # (the streamed program's FLOPs are the PPO rows' plus the proximal pass)
        flops = executed = math.nan
        extra = dict(**{f"resident_{k}_gib": round(v, 3) for k, v in resident.items()},
                     live_gib=round(peak / GIB + sum(resident.values()), 3),
                     rollout_dtype=_MEMORY_ROLLOUT_DTYPE.value or "float32")
      rows.append(dict(
          model=model, variant=variant, op=op, batch=bs, chunk_len=policy.chunk_len,
          minibatches=nm if op != "bc_step" else 1,
          denoise_steps=_LEARNER_DENOISE_STEPS.value if op != "bc_step" else None,
          remat=remat, dtype=dtype, params=n_params, compile_s=round(compile_s, 1),
          **{f"{k}_gib": round(v / GIB, 3) for k, v in sizes.items()},
          total_gib=round(peak / GIB, 3),
          params_adam_grads_gib=round(static / GIB, 3),
          model_gflop=None if math.isnan(flops) else round(flops / 1e9, 1),
          executed_gflop=None if math.isnan(executed) else round(executed / 1e9, 1),
          backend=jax.devices()[0].platform, device=jax.devices()[0].device_kind, **extra))
      print_memory_row(rows[-1])
  return rows


# ------------------------------------------------------------------ output --
def _model_width() -> int:
  return max([6, *map(len, _MODELS.value)]) + 1


def print_header(device_kind: str) -> None:
  print(f"# {device_kind} ({jax.devices()[0].platform}, {platform.machine()}, "
        f"{os.cpu_count()} cores), jax {jax.__version__}; median of {_REPEATS.value} calls, "
        "compile excluded; GFLOP = model FLOPs (jaxpr, scans x length); XLA GFLOP = "
        "cost_analysis (loop bodies once)")
  print(f"{'model':<{_model_width()}}{'variant':<8}{'dtype':<9}{'op':<14}{'batch':>6}{'K':>4}"
        f"{'H':>4}{'median ms':>11}{'min ms':>10}{'compile s':>10}{'GFLOP':>11}{'XLA GFLOP':>11}"
        f"{'TFLOP/s':>9}{'MFU':>8}{'samples/s':>11}{'peak GiB':>10}")


def print_row(r: dict) -> None:
  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  print(f"{r['model']:<{_model_width()}}{r['variant']:<8}{r['dtype']:<9}{r['op']:<14}"
        f"{r['batch']:>6}{fmt(r['denoise_steps'], 'd'):>4}{r['chunk_len']:>4}"
        f"{r['median_ms']:>11.2f}"
        f"{r['min_ms']:>10.2f}{r['compile_s']:>10.1f}{r['model_gflop']:>11.2f}"
        f"{fmt(r['xla_gflop'], '.2f'):>11}{r['achieved_tflops']:>9.3f}{fmt(r['mfu'], '.1%'):>8}"
        f"{r['samples_per_s']:>11.1f}{fmt(r['device_peak_gib'], '.2f'):>10}", flush=True)


def print_memory_row(r: dict) -> None:
  mbs = f" x{r['minibatches']} minibatches" if r.get("minibatches", 1) > 1 else ""
  print(f"{r['model']}/{r['variant']} {r['op']} batch={r['batch']}{mbs} H={r['chunk_len']} "
        f"remat={'on' if r['remat'] else 'off'} {r['dtype']}: argument {r['argument_gib']:.2f} "
        f"+ output {r['output_gib']:.2f} - alias {r['alias_gib']:.2f} + temp "
        f"{r['temp_gib']:.2f} + code {r['generated_code_gib']:.3f} = {r['total_gib']:.2f} GiB "
        f"(params+Adam+grads f32 alone: {r['params_adam_grads_gib']:.2f} GiB; compile "
        f"{r['compile_s']:.0f} s)", flush=True)
  if "live_gib" in r:
    print(f"  + resident beside it: Adam moments {r['resident_adam_gib']:.2f} + rollout copy "
          f"({r['rollout_dtype']}) {r['resident_rollout_copy_gib']:.2f} = live "
          f"{r['live_gib']:.2f} GiB (one micro-batch per minibatch; more add the "
          "gradient accumulator)", flush=True)


def main(argv):
  del argv
  device = jax.devices()[0]
  if _MEMORY.value:
    print(f"# {device.device_kind} ({device.platform}), jax {jax.__version__}; "
          "AOT compile with ShapeDtypeStructs (nothing allocated)")
    rows = memory_rows()
    note = XLA_CPU_MEMORY_NOTE if device.platform == "cpu" else (
        f"XLA:{device.platform.upper()} memory_analysis of the compiled step")
    print(f"# {note}")
    print(json.dumps(dict(mode="memory", device=device.device_kind, platform=device.platform,
                          note=note, rows=rows)))
    return
  print_header(device.device_kind)
  rows = []
  for model in _MODELS.value:
    for variant in _VARIANTS.value:
      rows += measure(model, variant, device.device_kind)
  print(json.dumps(dict(mode="latency", device=device.device_kind, platform=device.platform,
                        cpu_count=os.cpu_count(), jax=jax.__version__, rows=rows)))


if __name__ == "__main__":
  app.run(main)
