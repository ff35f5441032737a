"""The Panda's visual meshes, decimated for the CPU renderer (``env.render_meshes = "lowpoly"``).

On lavapipe (Mesa's CPU Vulkan) a ManiSkill3 camera image costs about 30 ms, and
nearly all of it is the Panda's visual meshes: 411k vertices (140k triangles) of
the 411k in a PushCube scene, against 13k for the table, floor, cube and goal
(measured: hiding the robot leaves 1.8 ms of 45 ms). At the 64 to 128 px a camera
policy sees, a link's silhouette and colours do not need that detail.

:func:`use_panda_meshes` writes, once per machine (a cache), a copy of ManiSkill's
``panda_v2.urdf`` whose visual meshes are decimated copies of the originals
(quadric decimation by ``fast-simplification``, each sub-mesh keeping its own
material), and points ManiSkill's Panda agents at it. Only the looks change: the
collision meshes, the links, joints, masses and controllers are ManiSkill's own, so
the physics (and every state, reward and planner path) is the same. The before/after
image is in docs/design/envs.md ("The render itself: the Panda's meshes"), the timings in
docs/results/envs.md.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile

# Fraction of each visual sub-mesh's triangles kept.
KEEP_FRACTION = 0.05
# Bumped when the files written change, so an old cache is not read.
_FORMAT = 1
_VISUAL_DIR = "franka_description/meshes/visual"


def _cache_root() -> str:
  """Where the decimated meshes are kept: ``$JAXVLA_CACHE`` or ``~/.cache/jaxvla``."""
  return os.environ.get("JAXVLA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "jaxvla")


def _decimate_glb(src: str, dst: str, keep: float) -> tuple[int, int]:
  """Writes ``src``'s glb scene to ``dst`` with every sub-mesh decimated to ``keep`` of
  its triangles (materials kept); returns the triangle counts before and after."""
  import fast_simplification  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import trimesh  # pylint: disable=import-outside-toplevel

  scene = trimesh.load(src, force="scene")
  before = after = 0
  out = trimesh.Scene()
  for node in scene.graph.nodes_geometry:
    transform, name = scene.graph[node]
    mesh = scene.geometry[name].copy()
    material = getattr(mesh.visual, "material", None)
    mesh.merge_vertices()  # (the files repeat each vertex per face: flat shading)
    before += len(mesh.faces)
    points, faces = fast_simplification.simplify(
        np.asarray(mesh.vertices, np.float32), np.asarray(mesh.faces, np.int32),
        target_reduction=1.0 - keep)
    small = trimesh.Trimesh(points, faces, process=False)
    if material is not None:
      small.visual = trimesh.visual.TextureVisuals(material=material)
    after += len(small.faces)
    out.add_geometry(small, node_name=node, geom_name=name, transform=transform)
  out.export(dst)
  return before, after


def lowpoly_urdf(urdf: str, keep: float = KEEP_FRACTION) -> str:
  """A copy of ManiSkill's Panda ``urdf`` with decimated visual meshes (built on the first
  call, then read from the cache); returns its path.

  The copy sits in its own directory with links to the original's other files, so
  every relative mesh path but the visual ones resolves as before.
  """
  src_dir = os.path.dirname(urdf)
  key = hashlib.sha256(f"{_FORMAT} {keep} {os.path.realpath(urdf)}".encode()).hexdigest()[:16]
  root = os.path.join(_cache_root(), "lowpoly_panda", key)
  path = os.path.join(root, os.path.basename(urdf))
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(root), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f"{key}.", dir=os.path.dirname(root))
  try:
    visual_out = os.path.join(tmp, "lowpoly_visual")
    os.makedirs(visual_out)
    text = open(urdf, encoding="utf-8").read()
    for name in sorted(set(re.findall(rf'"{_VISUAL_DIR}/([^"/]+\.glb)"', text))):
      _decimate_glb(os.path.join(src_dir, _VISUAL_DIR, name), os.path.join(visual_out, name), keep)
    for entry in os.listdir(src_dir):  # The collision meshes and the rest, as they are.
      if entry != os.path.basename(urdf):  # (written below, never through a link)
        os.symlink(os.path.join(src_dir, entry), os.path.join(tmp, entry))
    text = text.replace(f'"{_VISUAL_DIR}/', '"lowpoly_visual/')
    with open(os.path.join(tmp, os.path.basename(urdf)), "w", encoding="utf-8") as f:
      f.write(text)
    try:
      os.rename(tmp, root)  # Atomic: a process that built it too keeps the first.
    except OSError:
      if not os.path.exists(path):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return path


MESHES = ("lowpoly", "full")  # env.render_meshes: the decimated or ManiSkill's own.


def use_panda_meshes(meshes: str) -> None:
  """Points ManiSkill's Panda agents (``panda``, ``panda_wristcam``) in this process at
  :func:`lowpoly_urdf`'s copies (``"lowpoly"``) or back at their own URDFs (``"full"``).

  Raises:
    ValueError: naming ``env.render_meshes``.
  """
  if meshes not in MESHES:
    raise ValueError(f"config.env.render_meshes={meshes!r} is not one of {MESHES}")
  # pylint: disable=import-outside-toplevel
  from mani_skill.agents.robots.panda import panda, panda_wristcam
  for cls in (panda.Panda, panda_wristcam.PandaWristCam):
    own = cls.__dict__.get("_jaxvla_own_urdf", cls.__dict__["urdf_path"])
    cls._jaxvla_own_urdf = own  # pylint: disable=protected-access
    cls.urdf_path = lowpoly_urdf(own) if meshes == "lowpoly" else own
