"""One calling contract for every attention name."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv

import stableattn as sa
from stableattn.ops import registry


def contract_attention(q, k, v, *, causal=False):
  """A user's kernel on the contract: plain FP32 attention."""
  return sa.attention(
    q, k, v, implementation="reference", precision="fp32", causal=causal
  )


def not_a_kernel(q, k):
  return q


@pytest.mark.parametrize("name", registry.IMPLEMENTATIONS)
def test_our_names_follow_the_contract(name):
  # The Hopper path multiplies 16-bit operands only (wgmma).
  dtype, precision, tolerance, tile = jnp.float32, "fp32", 1e-5, 16
  if name == "mosaic_gpu":  # its tiles are one warpgroup's
    dtype, precision, tolerance, tile = jnp.bfloat16, "bf16-fa2", 2e-2, 64
  q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(0, q_len=32))
  fn = registry.resolve(name, precision=precision, block_q=tile, block_k=tile)
  out = np.asarray(fn(q, k, v, causal=True), np.float64)
  golden = sa.golden_attention(
    *(np.asarray(x, np.float64) for x in (q, k, v)), True
  )
  assert out.shape == q.shape
  assert np.abs(out - golden).max() < tolerance


def test_import_path_resolves_to_the_function():
  fn = registry.resolve("test_registry:contract_attention")
  assert fn is contract_attention


@pytest.mark.parametrize(
  "name, message",
  [
    ("flashy", "Unknown attention 'flashy'; valid: \\['pallas'"),
    ("no_such_module_xyz:fn", "Cannot import module 'no_such_module_xyz'"),
    ("test_registry:missing", "has no 'missing'"),
    (
      "test_registry:not_a_kernel",
      "does not take \\(q, k, v, \\*\\*features",
    ),
    (":fn", "must look like 'package.module:function'"),
  ],
)
def test_bad_names_give_one_clear_error(name, message):
  with pytest.raises(ValueError, match=message):
    registry.resolve(name)


def test_only_cudnn_needs_a_gpu():
  assert registry.needs_gpu("cudnn")
  assert not registry.needs_gpu("jax_mha")  # interpret mode on a CPU
  assert not any(map(registry.needs_gpu, registry.IMPLEMENTATIONS))


def test_a_torch_name_without_torch_says_how_to_install(monkeypatch):
  """Nothing imports torch until a torch kernel runs; without the extra,
  that run fails in one line naming the install command."""
  import importlib

  from stableattn.ops import torch_bridge

  real = importlib.import_module

  def no_torch(name, *args):
    if name == "torch":
      raise ImportError("No module named 'torch'")
    return real(name, *args)

  monkeypatch.setattr(torch_bridge.importlib, "import_module", no_torch)
  for name in ("torch_sdpa_flash", "torch:my_pkg.attention:sdpa"):
    with pytest.raises(ValueError, match=r"pip install 'stableattn\[torch\]'"):
      registry.resolve(name)
