"""openpi-sized pi0 / pi0.5 (~3.3B) on a LIBERO task: ``--config=configs/openpi.py:MODEL[,TASK]``.

MODEL is ``pi0`` or ``pi05``; TASK a LIBERO task (default ``libero_spatial/0``),
e.g. ``--config=configs/openpi.py:pi05,libero_10/3``. The network has openpi's
tree and sizes (PaliGemma 2B + action expert 300M + SigLIP So400m/14, 224 px
images, 32-dim padded state and actions), so an openpi checkpoint loads into it
directly: ``--config.model.init_checkpoint=<openpi ckpt>/params``. PaliGemma's
tokenizer must be on the machine: ``--config.model.tokenizer_path=.../
paligemma_tokenizer.model``. Meant for an accelerator (bfloat16 compute,
rematerialised layers); everything not set here is ``configs/libero.py``.
"""

import ml_collections

from configs import libero
from jaxvla.models import pi0

MODELS = ("pi0", "pi05")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name, _, task = (arg or "pi0").partition(",")
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r} of configs/openpi.py; choose one of {MODELS}")
  c = libero.get_config(task or None)
  c.model.name = name  # 'pi0' or 'pi05'.
  c.model.variant = "full"  # openpi's sizes.
  c.model.dtype = "bfloat16"  # Compute dtype; float32 master weights.
  c.model.remat = True  # Recompute each layer in the backward pass (activation memory).
  c.model.image_size = 224  # SigLIP So400m/14 at 224 px: 256 tokens per camera.
  c.model.posemb = "learn"  # SigLIP's learned position embedding (in the checkpoint).
  c.model.action_dim = 32  # openpi pads actions to 32; the env's 7 are executed.
  c.model.state_dim = 32  # openpi pads the state to 32.
  c.model.vocab_size = pi0.PALIGEMMA_VOCAB_SIZE  # PaliGemma's embedding table.
  c.model.tokenizer = "paligemma"  # SentencePiece; set model.tokenizer_path.
  c.model.max_token_len = 48 if name == "pi0" else 200  # openpi's prompt lengths.
  c.model.discrete_state_input = False  # As openpi's pi05_libero: no state in the prompt.
  c.model.value_source = "expert" if name == "pi0" else "prefix"  # Value head input.
  c.model.value_hidden = 1024  # Hidden units of the value head.
  c.model.chunk_len = 10  # LIBERO chunk in the literature (openpi trains 50; shapes allow any).
  c.model.num_denoise_steps = 4  # Denoise steps for RL (openpi samples with 10).
  return c
