"""The policy server's settings: ``python -m jaxvla.serve --serve=configs/serve.py[:MAP]``.

The fields, their comments and the observation key maps (``MAP``: ``jaxvla``, ``libero``,
``droid`` or ``aloha``) live in ``jaxvla/serving/config.py``, which ``jaxvla.serve`` reads
by default; this file is that config, to compose your own from.
"""

from jaxvla.serving.config import OBS_MAPS, get_config, obs_map  # noqa: F401
