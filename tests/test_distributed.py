"""Two processes on JAX's distributed runtime (CPU, gloo collectives) train
the same weights as one process with two devices on the same batches."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _worker(args, devices: int):
  env = {
    **os.environ,
    "PYTHONPATH": str(HERE.parent),
    "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    "JAX_PLATFORMS": "cpu",
  }
  return subprocess.Popen(
    [sys.executable, str(HERE / "distributed_worker.py"), *map(str, args)],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


@pytest.mark.slow
def test_two_processes_train_the_weights_of_one(tmp_path):
  one = _worker([0, 1, 0, tmp_path / "one.npz"], devices=2)
  port = _free_port()
  two = [
    _worker([i, 2, port, tmp_path / "two.npz"], devices=1) for i in range(2)
  ]
  for p in [one, *two]:
    output, _ = p.communicate(timeout=240)
    assert p.returncode == 0, output
  a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
  # Both meshes span two devices: the batch was split, the gradient summed.
  assert int(a["mesh_devices"]) == int(b["mesh_devices"]) == 2
  assert len(a.files) == len(b.files) > 1
  for name in a.files:
    np.testing.assert_array_equal(a[name], b[name])
