"""Packaging for jaxvla.

The core install is pure JAX and runs on a laptop CPU. The simulators live in the
`sim` extra because they are heavy and pin old libraries; `launch/setup.sh` installs
them in the right order (torch's CPU wheel first, LIBERO itself with --no-deps).
"""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax>=0.5",  # make_mesh with axis_types; tested on 0.10.x
    "flax>=0.10",  # nnx + linen; tested on 0.12.x
    "optax",
    "orbax-checkpoint",
    "grain",
    "tensorflow-datasets",  # data sources for ArrayRecord RLDS; TensorFlow itself is optional
    "pyarrow",  # LeRobot parquet files
    "av",  # PyAV: LeRobot mp4 frames (AV1 / H.264), decoded and, in tests, encoded
    "pillow",  # PNG / JPEG images stored inline, resizing
    "ml-collections",
    "chex",
    "gymnasium>=0.29.1",  # mani-skill 3 needs >=0.29.1
    "tensorboardX",
    "tqdm",
    "rich",
    "matplotlib",
    "imageio",  # notebooks/quickstart.ipynb writes its rollout GIF (through pillow)
    "numpy",
    "absl-py",
    "sentencepiece",  # Gemma / PaliGemma tokenizer
    "tokenizers>=0.15",  # the FAST action tokenizer's byte-level BPE (jaxvla.models.fast_tokenizer)
    "scipy>=1.4",  # scipy.fft's DCT, for the FAST action tokenizer
    # The policy server (python -m jaxvla.serve): openpi's websocket protocol; 14+ for the
    # websockets.asyncio API that openpi's server and client use.
    "websockets>=14",
    "msgpack",  # the server's wire format (openpi_client.msgpack_numpy's)
    "psutil",  # python -m jaxvla.plan --measure: the env workers' CPU time
]

EXTRAS_REQUIRE = {
    # Simulators. Pins are the ones measured to work together (see DESIGN.md).
    "sim": [
        # CPU wheel; an unpinned torch pulls a multi-GB CUDA build. setup.sh installs it first.
        "torch==2.13.0",
        # ManiSkill3; pulls sapien 3.0.x (Vulkan renderer, needs the lavapipe ICD on CPU).
        "mani-skill==3.0.1",
        # Quadric decimation of the Panda's visual meshes for the CPU renderer
        # (jaxvla/envs/lowpoly.py).
        "fast-simplification",
        # LIBERO's simulator stack. LIBERO itself (libero==0.1.1) is installed by setup.sh
        # with --no-deps because its metadata pulls training-only packages (wandb,
        # transformers, robomimic, ...). mujoco >= 3.17 / 4.x break robosuite 1.4.
        "robosuite==1.4.0",
        "mujoco>=3.3,<3.4",
        "bddl==1.0.1",
        # What `import libero.libero.{benchmark,envs}` + OffScreenRenderEnv + stepping
        # really import (measured), instead of LIBERO's declared training stack:
        "future",  # bddl 1.0.1 imports it but does not declare it
        "easydict",
        "termcolor",
        "cloudpickle",
        "PyYAML",
    ],
    "test": [
        "pytest",
        "pytest-timeout",
        "pytest-xdist",  # the fast step runs on every core (launch/test.sh)
        "psutil",  # tests/test_pool.py checks no worker outlives the pool
        # tests/test_notebook.py executes notebooks/quickstart.ipynb in a Jupyter kernel.
        "nbclient",
        "nbformat",
        "ipykernel",
        # tests/test_docs.py builds the docs site (docs/conf.py) with warnings as errors.
        "sphinx",
        "myst-parser",
    ],
}

setup(
    name="jaxvla",
    version="0.1.0",
    description="JAX framework to RL-fine-tune Vision-Language-Action policies in simulators",
    packages=find_packages(include=["jaxvla", "jaxvla.*"]),
    # openpi's parameter trees (shapes only), for the import checks and the summary.
    package_data={"jaxvla.models": ["openpi_params.json"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
