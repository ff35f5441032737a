"""LoRA vs full fine-tuning memory per budget: ``python -m jaxvla.bench.memory``.

This module owns one question: for a memory budget (24, 40, 80 GiB), what is the
largest PPO minibatch of a full-size pi0 / pi0.5 learner step that fits, with
LoRA (``config.model.lora``) and with full fine-tuning?

Each step is AOT-compiled from ``ShapeDtypeStruct`` s only
(``Learner.update_jit.lower(abstract state, abstract trajectory).compile()``:
nothing is allocated, so a 2-core CPU without an accelerator can do it) and
its ``compiled.memory_analysis()`` gives the step's peak: argument (params and
optimizer state) + output - alias (the donated state) + temp (gradients, the
optimizer's temporaries, activations) + generated code. The step is
:mod:`jaxvla.bench.policy`'s ``ppo_minibatch``: one epoch, one minibatch, the
K-step denoise chain's log-probs, backward, clip + Adam, remat on, float32
master weights, bfloat16 compute, 3 cameras at 224², chunk H = 10.

The search per (model, mode) and budget (:func:`largest_fitting`): compile at the
``--grid`` batch sizes up to the first one over the budget, then narrow that
bracket by interpolation until the largest fitting batch B and B + 1 have both
been compiled: every reported figure is a compiled measurement, not an
extrapolation.

On a CPU this is XLA:CPU's buffer assignment, an estimate of XLA:GPU's: for full
fine-tuning docs/results/policy.md found the GPU's peak 5 to 15 GiB lower than the CPU's.

Flags (``--models``, ``--learner_denoise_steps``, ``--chunk_len`` and ``--seed`` are
:mod:`jaxvla.bench.policy`'s) plus ``--budgets_gib``, ``--lora_modes``, ``--grid``.
Prints one line per compile, the table, and last one JSON line with every row.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxvla.bench import policy as bench_policy
from jaxvla.learner import learner as learner_lib
from jaxvla.models import summary as summary_lib

_BUDGETS = flags.DEFINE_list("budgets_gib", ["24", "40", "80"], "Memory budgets (GiB).")
_LORA_MODES = flags.DEFINE_list("lora_modes", ["both", "none"],
                                "config.model.lora settings to compare ('none': full FT).")
_GRID = flags.DEFINE_list("grid", ["1", "16", "64", "256"],
                          "Minibatch sizes compiled first (ascending).")

FLAGS = flags.FLAGS  # (with jaxvla.bench.policy's flags, which this module reuses)
GIB = 2**30
VARIANT = "full"


class StepMemory:
  """The compiled PPO minibatch step of one full-size (model, LoRA mode), by batch size."""

  def __init__(self, model: str, lora_mode: str):
    cfg = bench_policy.bench_config(
        model, VARIANT, dtype="bfloat16", chunk_len=FLAGS.chunk_len,
        denoise_steps=FLAGS.learner_denoise_steps, remat=True)
    cfg.lora = lora_mode
    self.model, self.lora_mode = model, lora_mode
    self.policy = summary_lib.make_policy(model, VARIANT, config=cfg)
    self.spec = summary_lib.env_spec(VARIANT)
    self.learner = bench_policy.make_learner(self.policy)
    params = self.policy.abstract_params()
    self.trained, self.total = self.learner.trainable.count(params)
    self.state = jax.eval_shape(
        lambda p: learner_lib.init_state(p, self.learner.ppo_tx, jax.random.PRNGKey(0)), params)
    self._params = params
    self.cache: dict[int, dict] = {}

  def measure(self, batch: int) -> dict:
    """The memory analysis (GiB) of the step at minibatch ``batch`` (compiled once)."""
    if batch in self.cache:
      return self.cache[batch]
    seed = FLAGS.seed
    batch_np = bench_policy.make_batch(self.policy, self.spec, batch, seed)
    chain = jax.eval_shape(lambda p, b, r: self.policy.act(p, b, r, "train"), self._params,
                           batch_np, jax.ShapeDtypeStruct((2,), jnp.uint32)).chain
    traj = bench_policy.make_trajectory(batch_np, chain, seed)
    data = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), traj)
    t0 = time.perf_counter()
    compiled = self.learner.update_jit.lower(self.state, data).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    if m is None:
      raise RuntimeError(f"backend {jax.devices()[0].platform!r} gives no memory_analysis()")
    sizes = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
                 alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
                 code=m.generated_code_size_in_bytes)
    peak = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"] + sizes["code"]
    row = dict(model=self.model, lora=self.lora_mode, batch=batch,
               trained_params=self.trained, total_params=self.total,
               **{f"{k}_gib": round(v / GIB, 3) for k, v in sizes.items()},
               peak_gib=round(peak / GIB, 3), compile_s=round(compile_s, 1))
    print(f"# {self.model} lora={self.lora_mode} batch={batch}: argument "
          f"{row['argument_gib']:.2f} + temp {row['temp_gib']:.2f} + ... = "
          f"{row['peak_gib']:.2f} GiB (compile {compile_s:.0f} s)", flush=True)
    self.cache[batch] = row
    return row


def largest_fitting(step: StepMemory, budget_gib: float, grid: list[int]) -> int:
  """The largest minibatch whose compiled peak is <= ``budget_gib`` (0: not even 1).

  Walks ``grid`` up to the first point over the budget (compiles are cached across
  budgets), then narrows the bracket ``(lo fits, hi does not)`` by interpolating
  the peak (piecewise linear in the batch; bisection after three steps, so a kink
  cannot stall it) until ``hi = lo + 1``. Returns ``max(grid)`` when that fits.
  """
  peak = lambda b: step.measure(b)["peak_gib"]
  lo = hi = None
  for b in grid:
    if peak(b) > budget_gib:
      hi = b
      break
    lo = b
  if lo is None or hi is None:
    return 0 if lo is None else lo
  for tries in range(64):
    if hi - lo <= 1:
      return lo
    slope = (peak(hi) - peak(lo)) / (hi - lo)
    guess = (lo + hi) // 2 if tries >= 3 or slope <= 0 else lo + int(
        (budget_gib - peak(lo)) / slope)
    guess = min(max(guess, lo + 1), hi - 1)
    if peak(guess) <= budget_gib:
      lo = guess
    else:
      hi = guess
  raise RuntimeError(f"largest_fitting did not converge between {lo} and {hi}")


def _cell(largest: int, grid: list[int], need_gib: float) -> str:
  if largest == 0:
    return f"none (B = 1 needs {need_gib:.1f})"
  return f">= {largest}" if largest == max(grid) else str(largest)


def main(argv):
  del argv
  device = jax.devices()[0]
  budgets = [float(b) for b in _BUDGETS.value]
  grid = sorted(int(b) for b in _GRID.value)
  print(f"# {device.device_kind} ({device.platform}), jax {jax.__version__}; PPO minibatch "
        "step of the full variants, AOT-compiled from ShapeDtypeStructs (nothing allocated)")
  rows, table = [], []
  for model in FLAGS.models:
    for mode in _LORA_MODES.value:
      step = StepMemory(model, mode)
      cells = {b: largest_fitting(step, b, grid) for b in budgets}
      one = step.measure(1)
      table.append((model, mode, step.trained, step.total, one, cells))
      rows += sorted(step.cache.values(), key=lambda r: r["batch"])
  print(f"\n{'model':<6}{'mode':<18}{'trained params':>16}{'B=1 peak GiB':>14}"
        + "".join(f"{f'{b:g} GiB':>24}" for b in budgets))
  for model, mode, trained, total, one, cells in table:
    name = "full fine-tuning" if mode == "none" else f"LoRA ({mode})"
    print(f"{model:<6}{name:<18}{f'{trained / 1e6:.0f}M / {total / 1e6:.0f}M':>16}"
          f"{one['peak_gib']:>14.2f}"
          + "".join(f"{_cell(cells[b], grid, one['peak_gib']):>24}" for b in budgets))
  note = ("XLA:CPU memory_analysis: an estimate of the GPU's buffer assignment"
          if device.platform == "cpu" else f"XLA:{device.platform.upper()} memory_analysis")
  print(f"# {note}")
  print(json.dumps(dict(mode="lora_memory", device=device.device_kind, platform=device.platform,
                        note=note, budgets_gib=budgets,
                        largest=[dict(model=m, lora=mode, trained_params=t, total_params=n,
                                      **{f"{b:g}": c[b] for b in budgets})
                                 for m, mode, t, n, _, c in table],
                        rows=rows)))


if __name__ == "__main__":
  app.run(main)
