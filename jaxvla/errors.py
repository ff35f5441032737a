"""Errors that more than one layer raises, in a leaf module that imports nothing (the env
pool imports it, and the env package must import without JAX: the motion planner's
worker runs in a Python environment of its own)."""


class ReplayMismatch(RuntimeError):
  """A replay found the run other than its schedule log says (the message names the
  first difference: the step, the env, the update). See :mod:`jaxvla.runtime.schedule`."""


def require(ok: bool, key: str, message: str) -> None:
  """A config rule: raises ``ValueError("config.<key>: <message>")`` unless ``ok`` (the
  one format of a bad-config error, for every module that checks a part of the config)."""
  if not ok:
    raise ValueError(f"config.{key}: {message}")
