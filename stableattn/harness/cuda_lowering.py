"""Lowering a program for CUDA on a machine without a GPU: the check that
a GPU configuration builds (Pallas's Triton and Mosaic GPU lowerings run
on the CPU and raise on what they cannot compile).

jax 0.10 lowers for CUDA anywhere. From jax 0.11 Pallas's Triton lowering
asks which GPU it compiles for ("No supported GPU devices found, please
specify an abstract GPU device"); without a local GPU it is named here
through an abstract mesh, an H100 unless told otherwise.
"""

from __future__ import annotations

import contextlib

import jax

TARGET = "NVIDIA H100"


def needs_abstract_gpu() -> bool:
  """Whether lowering for CUDA must name its GPU: jax 0.11 and later,
  without a local GPU."""
  return jax.__version_info__ >= (0, 11) and not _has_gpu()


def abstract_gpu_mesh(mesh=None, device_kind: str = TARGET):
  """An abstract mesh shaped like `mesh` (one device where None) whose
  devices are `device_kind` GPUs: a program sharded over it (shard_map
  included) lowers for CUDA on any machine."""
  device = jax.sharding.AbstractDevice(
    device_kind=device_kind, num_cores=None, platform="gpu"
  )
  if mesh is None or mesh.empty:
    return jax.sharding.AbstractMesh(
      (1,), ("cuda_target",), abstract_device=device
    )
  return jax.sharding.AbstractMesh(
    mesh.axis_sizes, mesh.axis_names, mesh.axis_types, abstract_device=device
  )


@contextlib.contextmanager
def cuda_target(device_kind: str = TARGET, mesh=None):
  """A context in which lowering for CUDA knows its GPU: the local one,
  or (`needs_abstract_gpu`) `device_kind` as the abstract device of a
  mesh shaped like `mesh` (an `abstract_gpu_mesh` a program shards over)
  or like the mesh in context."""
  if not needs_abstract_gpu():
    yield
    return
  shape = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  with jax.sharding.use_abstract_mesh(abstract_gpu_mesh(shape, device_kind)):
    yield


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def lowered_for_cuda(fn, *args, device_kind: str = TARGET, mesh=None):
  """`jax.jit(fn)` traced on `args` (arrays or ShapeDtypeStructs) and
  lowered for CUDA, on any machine (`mesh`: see `cuda_target`)."""
  with cuda_target(device_kind, mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
