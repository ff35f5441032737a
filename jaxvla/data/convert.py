"""Converts a TFDS dataset stored as TFRecord (most public RLDS sets) to ArrayRecord, once.

``python -m jaxvla.data.convert --src=DIR --out=DIR`` (needs TensorFlow:
``pip install tensorflow-cpu``, an optional extra; nothing else in jaxvla does).

Every record (one serialized episode) is copied byte for byte, shard by shard,
with TFDS's own file adapters (TensorFlow reads the TFRecord shards,
``array_record`` writes the new ones), so shard lengths and ``features.json``
stay valid; ``dataset_info.json`` is rewritten by TFDS with the new file
format. The result reads with :class:`jaxvla.data.rlds.RldsReader`, without
TensorFlow. (``tfds convert_format`` does the same but also needs Apache Beam.)
"""

from __future__ import annotations

import json
import os
import sys

from jaxvla.data import rlds
from jaxvla.data.episodes import ONE_LINE_ERRORS, DataError


def convert(src: str, out: str) -> dict[str, int]:
  """Writes the ArrayRecord copy of the TFDS dataset ``src`` into the new directory ``out``.

  Returns:
    episodes per split.

  Raises:
    DataError: ``src`` is no TFDS dataset, or is ArrayRecord already.
    FileExistsError: ``out`` already holds a dataset.
    ImportError: TensorFlow is not installed.
  """
  try:
    import tensorflow  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise ImportError("reading TFRecord shards needs TensorFlow: pip install tensorflow-cpu "
                      "(only this conversion needs it)") from e
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  from tensorflow_datasets.core import file_adapters  # pylint: disable=import-outside-toplevel

  directory = rlds.find_dataset_dir(src)
  if directory is None:
    raise DataError(f"{src}: no dataset_info.json here or in exactly one subdirectory")
  if os.path.exists(os.path.join(out, "dataset_info.json")):
    raise FileExistsError(f"{out} already holds a TFDS dataset")
  info = tfds.builder_from_directory(directory).info
  in_format = info.file_format or file_adapters.FileFormat.TFRECORD
  if in_format == file_adapters.FileFormat.ARRAY_RECORD:
    raise DataError(f"{directory}: already array_record; read it directly")
  reader = file_adapters.ADAPTER_FOR_FORMAT[in_format]
  writer = file_adapters.ADAPTER_FOR_FORMAT[file_adapters.FileFormat.ARRAY_RECORD]
  os.makedirs(out, exist_ok=True)
  counts = {}
  for name, split in info.splits.items():
    template = split.filename_template.replace(
        data_dir=out, filetype_suffix=file_adapters.FileFormat.ARRAY_RECORD.file_suffix)
    shards = split.filepaths
    for i, path in enumerate(shards):
      records = reader.make_tf_data(path).as_numpy_iterator()
      writer.write_examples(template.sharded_filepath(shard_index=i, num_shards=len(shards)),
                            enumerate(records))
    counts[name] = split.num_examples
  info.set_file_format(file_adapters.FileFormat.ARRAY_RECORD, override=True,
                       override_if_initialized=True)
  info.write_to_directory(out)
  return counts


def main(argv: list[str]) -> None:
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

  src_flag = flags.DEFINE_string("src", None, "TFDS dataset (version directory) in TFRecord.")
  out_flag = flags.DEFINE_string("out", None, "New directory for the ArrayRecord copy.")
  flags.mark_flags_as_required(["src", "out"])

  def run(_):
    absl_logging.set_verbosity(absl_logging.WARNING)  # TFDS's INFO lines
    try:
      counts = convert(src_flag.value, out_flag.value)
    except (*ONE_LINE_ERRORS, ImportError) as e:
      sys.exit(f"error: {e}")
    print(json.dumps({"out": out_flag.value, "episodes": counts}))

  app.run(run, argv)


if __name__ == "__main__":
  main(sys.argv)
