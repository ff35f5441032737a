"""The Panda's visual meshes, decimated for the CPU renderer (``env.render_meshes = "lowpoly"``).

On lavapipe (Mesa's CPU Vulkan) a ManiSkill3 camera image costs about 30 ms, and
nearly all of it is the Panda's visual meshes: 411k vertices (140k triangles) of
the 411k in a PushCube scene, against 13k for the table, floor, cube and goal
(measured: hiding the robot leaves 1.8 ms of 45 ms). At the 64 to 128 px a camera
policy sees, a link's silhouette and colours do not need that detail. The wrist-camera
Panda (``panda_wristcam``, ``panda_v3.urdf``) adds a RealSense D415 housing of 425k
triangles, three times the arm's: 640 ms per observation of its two cameras until it
too was decimated.

:func:`use_panda_meshes` writes, once per machine (a cache), a copy of ManiSkill's
Panda URDF (``panda_v2.urdf``, ``panda_v3.urdf``) whose every visual mesh is a
decimated copy of the original (quadric decimation by ``fast-simplification``, each
sub-mesh of a glb scene keeping its own material, an STL its URDF material), and
points ManiSkill's Panda agents at it. Only the looks change: the
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
_FORMAT = 2
_LOWPOLY_DIR = "lowpoly_visual"  # In the copy: the decimated visual meshes.
# A <visual> element's mesh file (a URDF's collision meshes stay as they are).
_VISUAL_MESH = re.compile(r'<visual>(?:(?!</visual>).)*?<mesh filename="([^"]+)"', re.S)


def _cache_root() -> str:
  """Where the decimated meshes are kept: ``$JAXVLA_CACHE`` or ``~/.cache/jaxvla``."""
  return os.environ.get("JAXVLA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "jaxvla")


def _simplify(mesh, keep: float):
  """``mesh`` (a ``trimesh.Trimesh``) with ``keep`` of its triangles."""
  import fast_simplification  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import trimesh  # pylint: disable=import-outside-toplevel

  mesh = mesh.copy()
  mesh.merge_vertices()  # (the files repeat each vertex per face: flat shading)
  points, faces = fast_simplification.simplify(
      np.asarray(mesh.vertices, np.float32), np.asarray(mesh.faces, np.int32),
      target_reduction=1.0 - keep)
  return trimesh.Trimesh(points, faces, process=False)


def _decimate(src: str, dst: str, keep: float) -> tuple[int, int]:
  """Writes ``src``'s mesh file to ``dst`` with every sub-mesh decimated to ``keep`` of
  its triangles (a glb scene's materials kept; an STL has none); returns the triangle
  counts before and after."""
  import trimesh  # pylint: disable=import-outside-toplevel

  if not src.endswith(".glb"):
    mesh = trimesh.load(src, force="mesh")
    small = _simplify(mesh, keep)
    small.export(dst)
    return len(mesh.faces), len(small.faces)
  scene = trimesh.load(src, force="scene")
  before = after = 0
  out = trimesh.Scene()
  for node in scene.graph.nodes_geometry:
    transform, name = scene.graph[node]
    mesh = scene.geometry[name]
    material = getattr(mesh.visual, "material", None)
    small = _simplify(mesh, keep)
    if material is not None:
      small.visual = trimesh.visual.TextureVisuals(material=material)
    before, after = before + len(mesh.faces), after + len(small.faces)
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
    os.makedirs(os.path.join(tmp, _LOWPOLY_DIR))
    text = open(urdf, encoding="utf-8").read()
    for name in sorted(set(_VISUAL_MESH.findall(text))):
      # (flattened: franka_description/meshes/visual/link0.glb -> lowpoly_visual/franka_...)
      small = f"{_LOWPOLY_DIR}/{name.replace('/', '__')}"
      _decimate(os.path.join(src_dir, name), os.path.join(tmp, small), keep)
      text = text.replace(f'<mesh filename="{name}"', f'<mesh filename="{small}"')
    for entry in os.listdir(src_dir):  # The collision meshes and the rest, as they are.
      if entry != os.path.basename(urdf):  # (written below, never through a link)
        os.symlink(os.path.join(src_dir, entry), os.path.join(tmp, entry))
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
