"""Two processes on JAX's distributed runtime (CPU, gloo collectives)
compute what one process with two devices does, bit for bit: data-parallel
training, and ring attention (with a context-parallel model's training)
whose shards and ring hops cross the process boundary."""

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


def _one_and_two_processes(mode: str, tmp_path):
  one = _worker([mode, 0, 1, 0, tmp_path / "one.npz"], devices=2)
  port = _free_port()
  two = [
    _worker([mode, i, 2, port, tmp_path / "two.npz"], devices=1)
    for i in range(2)
  ]
  for p in [one, *two]:
    output, _ = p.communicate(timeout=240)
    assert p.returncode == 0, output
  return np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")


def _assert_bitwise_equal(a, b):
  assert sorted(a.files) == sorted(b.files)
  for name in a.files:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow
def test_two_processes_train_the_weights_of_one(tmp_path):
  a, b = _one_and_two_processes("train", tmp_path)
  # Both meshes span two devices: the batch was split, the gradient summed.
  assert int(a["mesh_devices"]) == int(b["mesh_devices"]) == 2
  assert len(a.files) > 2
  _assert_bitwise_equal(a, b)


@pytest.mark.slow
def test_ring_attention_across_two_processes_is_one_processes(tmp_path):
  a, b = _one_and_two_processes("ring", tmp_path)
  assert int(a["mesh_devices"]) == int(b["mesh_devices"]) == 2
  assert a["ring_out"].shape == (2, 128, 4, 32)
  assert np.isfinite(a["ring_dk"]).all() and np.abs(a["ring_dk"]).max() > 0
  _assert_bitwise_equal(a, b)
