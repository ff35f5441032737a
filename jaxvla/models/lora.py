"""LoRA adapters on the Gemma experts, as openpi's ``gemma_2b_lora`` / ``gemma_300m_lora``.

This file owns the LoRA rules: which weights carry adapters and under which names
(openpi's), their shapes, ranks and initialisation, the adapted einsum / matmul of
the forward pass, which parameters the learner trains when adapters are on
(openpi's ``Pi0Config.get_freeze_filter``), and :func:`merge_lora`, which folds
the adapters back into openpi's plain tree.

Names and shapes (openpi ``src/openpi/models/lora.py``; ``L`` = depth, ``r`` = rank,
expert ``i > 0`` names carry ``_i``), under ``PaliGemma/llm/layers``:

* ``attn/{q_einsum, kv_einsum, attn_vec_einsum}/{lora_a, lora_b}`` next to ``w``:
  ``lora_a`` is ``w``'s shape with the last axis replaced by ``r``, ``lora_b`` with
  the second-to-last axis replaced by ``r`` (``q_einsum``: ``[L, N, D, r]`` and
  ``[L, N, r, H]``). The adapted einsum is openpi's ``lora.Einsum``: ``x`` through
  ``lora_a`` then ``lora_b`` with the equations :func:`lora_eqns` derives, times
  ``alpha / rank``.
* ``mlp/{gating_einsum, linear}_lora_{a, b}`` next to the MLP weights:
  ``gating_einsum_lora_a [L, 2, D, r]``, ``gating_einsum_lora_b [L, 2, r, F]``,
  ``linear_lora_a [L, F, r]``, ``linear_lora_b [L, r, D]``. openpi's
  ``lora.FeedForward`` adds ``x @ a @ b`` *without* the ``alpha / rank`` factor;
  so does this file, so that an openpi LoRA checkpoint computes the same function.

Ranks (openpi ``gemma.get_config``): ``gemma_2b_lora`` (the PaliGemma LLM, expert 0)
rank 16, alpha 16; ``gemma_300m_lora`` (the action expert) rank 32, alpha 32. In
both alpha equals the rank, so every adapter's factor is 1.

Initialisation: ``lora_a`` is openpi's ``normal(0.01)``; ``lora_b`` is zero (openpi
draws it from ``normal(0.01)`` too). With ``b = 0`` the adapted model starts as
exactly the model it adapts, so an RL run from a warm start or an imported
checkpoint acts with that policy at its first rollout.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxvla.models import layers

# config.model.lora -> whether (expert 0 = the PaliGemma LLM, expert 1 = the action
# expert) carry adapters: openpi's paligemma_variant / action_expert_variant choice.
CHOICES = {"none": (False, False), "llm": (True, False), "expert": (False, True),
           "both": (True, True)}
# openpi's ranks: gemma_2b_lora (the LLM) and gemma_300m_lora (the action expert).
OPENPI_RANK_LLM = 16
OPENPI_RANK_EXPERT = 32
INIT_STD_A = 0.01  # openpi's LoRAConfig.init_fn, normal(stddev=0.01)
LABEL = "L"  # the rank's label in the adapter einsums (openpi's LoRAConfig.label)

# openpi's freeze-filter regexes (pi0_config.get_freeze_filter), on '/'-joined paths.
_LLM = re.compile(r".*llm.*")
_EXPERT = re.compile(r".*llm.*_1.*")
_ADAPTER = re.compile(r".*lora.*")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """One expert's adapters (openpi's ``LoRAConfig`` for both ``attn`` and ``ffn``)."""
  rank: int
  alpha: float

  @property
  def scale(self) -> float:
    """The attention adapters' factor ``alpha / rank`` (openpi's ``scaling_value``)."""
    return self.alpha / self.rank


def check_config(model: ml_collections.ConfigDict) -> None:
  """``config.model.lora*``; raises ``ValueError`` naming the key."""
  if model.lora not in CHOICES:
    raise ValueError(f"config.model.lora: must be one of {sorted(CHOICES)}, got {model.lora!r}")
  for key in ("lora_rank_llm", "lora_rank_expert"):
    if not isinstance(model[key], int) or model[key] < 1:
      raise ValueError(f"config.model.{key}: must be an int >= 1, got {model[key]!r}")
  if model.lora != "none" and model.name not in ("pi0", "pi05"):
    raise ValueError(f"config.model.lora: adapters are on the pi0 / pi0.5 Gemma experts; "
                     f"model.name={model.name!r} has none (use 'none')")


def expert_configs(model: ml_collections.ConfigDict) -> tuple[LoraConfig | None, LoraConfig | None]:
  """``(llm, action expert)`` adapters from ``config.model`` (alpha = rank, as openpi's)."""
  check_config(model)
  on_llm, on_expert = CHOICES[model.lora]
  make = lambda on, rank: LoraConfig(rank=rank, alpha=float(rank)) if on else None
  return make(on_llm, model.lora_rank_llm), make(on_expert, model.lora_rank_expert)


# ------------------------------------------------------------------ params --
def adapter_params(rngs: nnx.Rngs, shape: tuple[int, ...], axes: layers.Axes,
                   cfg: LoraConfig) -> tuple[nnx.Param, nnx.Param]:
  """``(lora_a, lora_b)`` for a weight of ``shape [..., I, O]`` with logical ``axes``.

  ``lora_a [..., I, r]`` (normal 0.01), ``lora_b [..., r, O]`` (zeros). The rank
  axis is never sharded (logical ``None``): it is 16 or 32 wide.
  """
  shape_a = (*shape[:-1], cfg.rank)
  shape_b = (*shape[:-2], cfg.rank, shape[-1])
  axes_a = (*axes[:-1], None)
  axes_b = (*axes[:-2], None, axes[-1])
  return (layers.param(rngs, jax.nn.initializers.normal(INIT_STD_A), shape_a, axes_a),
          layers.param(rngs, layers.zeros, shape_b, axes_b))


# ----------------------------------------------------------------- forward --
def _parts(eqn: str) -> tuple[str, str, str]:
  m = re.fullmatch(r"(\w+),(\w+)->(\w+)", eqn)
  if m is None or LABEL in eqn:
    raise ValueError(f"unsupported einsum {eqn!r} for LoRA (two operands, no {LABEL!r})")
  return m.group(1), m.group(2), m.group(3)


def lora_eqns(eqn: str) -> tuple[str, str]:
  """openpi's ``Einsum._make_lora_eqns``: ``x`` -> ``x @ lora_a`` -> ``@ lora_b``.

  The weight's last two labels are its (in, out) axes; ``lora_a`` has ``out``
  replaced by the rank, ``lora_b`` has ``in`` replaced. E.g. ``'btd,ndh->btnh'``
  gives ``('btd,ndL->btnL', 'btnL,nLh->btnh')``.
  """
  lhs, rhs, out = _parts(eqn)
  a_label, b_label = rhs[-2], rhs[-1]
  a_out = out.replace(b_label, LABEL)
  return (f"{lhs},{rhs.replace(b_label, LABEL)}->{a_out}",
          f"{a_out},{rhs.replace(a_label, LABEL)}->{out}")


def delta_eqn(eqn: str) -> str:
  """The einsum ``lora_a, lora_b -> w``-shaped update equal to the adapter path of ``eqn``.

  A label of ``lora_b`` that the second adapter einsum sums on its own (absent
  from the first's output: ``n`` of ``attn_vec_einsum``'s ``'btnh,nhd->btd'``)
  is summed independently of ``lora_a``'s, so it gets a fresh label here:
  ``'nhL,ALd->nhd'``.
  """
  lhs, rhs, out = _parts(eqn)
  a_label, b_label = rhs[-2], rhs[-1]
  a_out = out.replace(b_label, LABEL)
  fresh = iter(c for c in "ABCDEFGHIJKMNOPQRSTUVWXYZ" if c not in eqn)
  b_rhs = "".join(c if c in a_out or c in (b_label, LABEL) else next(fresh)
                  for c in rhs.replace(a_label, LABEL))
  return f"{rhs.replace(b_label, LABEL)},{b_rhs}->{rhs}"


def einsum(eqn: str, x: jax.Array, node: Mapping[str, jax.Array], cfg: LoraConfig | None,
           dtype) -> jax.Array:
  """``einsum(eqn, x, node['w'])`` plus the adapter path when ``cfg`` is set (openpi's
  ``lora.Einsum``); weights are cast to ``dtype``."""
  y = jnp.einsum(eqn, x, node["w"].astype(dtype))
  if cfg is None:
    return y
  eqn_a, eqn_b = lora_eqns(eqn)
  h = jnp.einsum(eqn_a, x, node["lora_a"].astype(dtype))
  return y + jnp.einsum(eqn_b, h, node["lora_b"].astype(dtype)) * jnp.asarray(cfg.scale, dtype)


def dot(x: jax.Array, w: jax.Array, a: jax.Array | None, b: jax.Array | None, dtype) -> jax.Array:
  """``x [..., I] @ w [I, O]`` plus ``x @ a [I, r] @ b [r, O]`` when adapted (openpi's
  ``FeedForward._dot``: no ``alpha / rank`` factor)."""
  y = jnp.dot(x, w.astype(dtype))
  if a is None:
    return y
  return y + jnp.dot(jnp.dot(x, a.astype(dtype)), b.astype(dtype))


# ---------------------------------------------------------------- training --
def is_adapter(path: str) -> bool:
  """Whether a ``'/'``-joined parameter path is a LoRA weight."""
  return _ADAPTER.match(path) is not None


def trainable_predicate(paths) -> Callable[[str], bool] | None:
  """openpi's freeze filter for a tree with these ``'/'``-joined ``paths``.

  None when no path is an adapter (everything trains). Otherwise a path is frozen
  when it is in the PaliGemma LLM (``.*llm.*``) and the LLM has adapters, or in
  the action expert (``.*llm.*_1.*``) and the expert has them, and it is not an
  adapter itself. Everything outside ``PaliGemma/llm`` trains: the SigLIP ViT,
  the action / time projections and the RL heads (``rl/``), as in openpi, and an
  expert without adapters trains in full.
  """
  adapters = [p for p in paths if is_adapter(p)]
  if not adapters:
    return None
  expert_lora = any(_EXPERT.match(p) for p in adapters)
  llm_lora = any(not _EXPERT.match(p) for p in adapters)

  def trainable(path: str) -> bool:
    if is_adapter(path) or not _LLM.match(path):
      return True
    in_expert = _EXPERT.match(path) is not None
    return not (expert_lora if in_expert else llm_lora)

  return trainable


# ------------------------------------------------------------------- merge --
# The forward pass's equations of the adapted attention weights (per layer);
# jaxvla.models.gemma uses the same.
ATTN_EQNS = {"q_einsum": "btd,ndh->btnh", "kv_einsum": "bsd,ckdh->cbskh",
             "attn_vec_einsum": "btnh,nhd->btd"}
MLP_WEIGHTS = ("gating_einsum", "linear")


def _merge_stacked(eqn: str, w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """``w [L, ...] + scale * delta(a, b)`` per layer, in float32, back in ``w``'s dtype."""
  delta = jax.vmap(lambda a_, b_: jnp.einsum(delta_eqn(eqn), a_.astype(jnp.float32),
                                             b_.astype(jnp.float32)))(a, b)
  return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def merge_lora(params: Mapping, *, scale: float = 1.0) -> dict:
  """openpi's plain tree: every adapter folded into its weight, the ``lora`` leaves dropped.

  Args:
    params: a pi0 / pi0.5 tree (jaxvla's or openpi's; ``PaliGemma/llm/layers/...``
      stacked ``[L, ...]``) with or without adapters; the rest is returned as is.
    scale: the attention adapters' ``alpha / rank`` (1 for openpi's variants, and for
      every jaxvla config, whose alpha equals the rank). The MLP adapters are
      unscaled, as in openpi's forward pass.

  Returns:
    The same tree without ``lora`` leaves, where ``w += scale * delta(lora_a, lora_b)``
    for ``attn/*_einsum`` (:func:`delta_eqn` of the forward equation) and
    ``gating_einsum[c] += a[c] @ b[c]``, ``linear += a @ b`` for ``mlp*``. Its forward
    pass equals the adapted model's (up to float rounding). For the export: the
    result loads into openpi's non-LoRA ``Pi0Config`` (no ``lora`` paths).
  """
  out = jax.tree.map(lambda x: x, dict(params))  # copy the containers, keep the arrays
  try:
    layer = out["PaliGemma"]["llm"]["layers"]
  except KeyError as e:
    raise ValueError(f"merge_lora: no PaliGemma/llm/layers in the tree ({e})") from None
  for name, node in layer["attn"].items():
    if "lora_a" not in node:
      continue
    base = re.sub(r"_\d+$", "", name)
    if base not in ATTN_EQNS:
      raise ValueError(f"merge_lora: adapters on an unknown attention weight {name!r}")
    layer["attn"][name] = {"w": _merge_stacked(ATTN_EQNS[base], node["w"], node["lora_a"],
                                               node["lora_b"], scale)}
  for name, node in layer.items():
    if not re.fullmatch(r"mlp(_\d+)?", name):
      continue
    merged = {k: v for k, v in node.items() if not is_adapter(k)}
    for w in MLP_WEIGHTS:
      if f"{w}_lora_a" in node:  # [L, (2,) I, r] @ [L, (2,) r, O], batched over the rest
        a, b = node[f"{w}_lora_a"], node[f"{w}_lora_b"]
        delta = jnp.einsum("...iL,...Lo->...io", a.astype(jnp.float32), b.astype(jnp.float32))
        merged[w] = (node[w].astype(jnp.float32) + delta).astype(node[w].dtype)
    layer[name] = merged
  return out
