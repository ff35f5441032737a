"""Export a policy in openpi's checkpoint layout, for openpi's own tools.

``python -m jaxvla.openpi_export --policy=DIR --out=DIR --asset_id=ID [--config=FILE]
[--identity_norm_stats] [--allow_norm_mode_mismatch] [--base_only]`` loads any policy
:func:`jaxvla.storage.policy_io.load` reads and writes it with
:func:`jaxvla.models.openpi_export.export_loaded`, which owns the layout and the flags'
rules (docs/design/policy.md, "Export in openpi's layout"). Prints one JSON line.

The command's own module, above both of its imports: the export itself lives in
``models/``, which imports nothing of :mod:`jaxvla.storage.policy_io` (policy_io builds its
policies from ``models/``).
"""

from __future__ import annotations

import json
import sys

import jax

from jaxvla.models import openpi_export
from jaxvla.storage import policy_io


def main(argv: list[str]) -> None:
  """The CLI (see the module docstring); prints one JSON line."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Run config (required for an openpi checkpoint; else the stored one).",
      lock_config=True)
  policy_flag = flags.DEFINE_string("policy", None, "A jaxvla export, run or openpi checkpoint.")
  out_flag = flags.DEFINE_string("out", None, "The openpi checkpoint directory to write.")
  asset_flag = flags.DEFINE_string("asset_id", None, "openpi's data.asset_id for the stats.")
  identity_flag = flags.DEFINE_bool("identity_norm_stats", False,
                                    "No normaliser: write identity statistics.")
  mismatch_flag = flags.DEFINE_bool("allow_norm_mode_mismatch", False,
                                    "Write statistics of the mode openpi does not use.")
  base_flag = flags.DEFINE_bool("base_only", False,
                                "A steered policy ('latent' / 'residual'): export its base flow.")
  flags.mark_flags_as_required(["policy", "out", "asset_id"])

  def run(_):
    jax.config.update("jax_platforms", "cpu")  # Host arrays only: never wake an accelerator.
    try:
      loaded = policy_io.load(policy_flag.value, config_flag.value)
      out = openpi_export.export_loaded(out_flag.value, loaded, asset_flag.value,
                                        identity_norm_stats=identity_flag.value,
                                        allow_norm_mode_mismatch=mismatch_flag.value,
                                        base_only=base_flag.value)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
      sys.exit(f"error: {e}")
    print(json.dumps(dict(out, policy=loaded.path, kind=loaded.kind)))

  app.run(run, argv)


if __name__ == "__main__":
  main(sys.argv)
