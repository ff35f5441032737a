"""Serving a policy over openpi's websocket + msgpack protocol (``python -m jaxvla.serve``).

* :mod:`jaxvla.serving.wire`: the msgpack + NumPy message format (openpi_client's).
* :mod:`jaxvla.serving.obs_map`: a request dict -> the policy's observation, by key map.
* :mod:`jaxvla.serving.runner`: batched, jitted act on a batching thread.
* :mod:`jaxvla.serving.server`: the websocket server (metadata, replies, errors).
"""
