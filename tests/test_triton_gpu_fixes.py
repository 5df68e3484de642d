"""The Triton path's two failures on an H100 (results/gpu/h100-2026-11-26),
fixed without a GPU and checked on the CPU from what the lowering builds:

* split-KV decoding with key lengths stopped compiling: Triton refuses a
  boolean tile in shared memory, and the key-length mask reached a select
  as one; masks are now applied by bits (`block_math.masked_fill`);
* the FP32 presets spilled their 64x64 tiles to local memory: they get
  tiles and warps that fit IEEE FP32 dots (`tiling.fp32_gpu_tiles`).

The GPU-marked tests compile both and compare with interpret mode.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv

import stableattn as sa
from stableattn.contract.tiling import fp32_gpu_tiles
from stableattn.harness.cuda_lowering import lowered_for_cuda
from stableattn.kernels.block_math import masked_fill

SPLIT_KV_DECODING = dict(
  precision="bf16-fa2",
  causal=True,
  causal_alignment="bottom_right",
  key_value_seq_lengths=np.array([150, 200], np.int32),
  num_splits=3,
)


def _triton_modules(monkeypatch, fn, *shapes) -> list[str]:
  """The Triton IR of every Pallas kernel `fn` lowers to for CUDA."""
  from jax._src.pallas.triton import pallas_call_registration as registration

  modules = []
  lower = registration.lowering.lower_jaxpr_to_triton_module

  def keep(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm())
    return result

  monkeypatch.setattr(
    registration.lowering, "lower_jaxpr_to_triton_module", keep
  )
  lowered_for_cuda(fn, *shapes)
  return modules


def _boolean_tile_selects(module: str) -> list[str]:
  """The shapes of 2-D i1 conditions of `arith.select`s."""
  return re.findall(
    r"arith\.select %\S+, %\S+, %\S+ : tensor<(\d+x\d+)xi1>", module
  )


@pytest.mark.parametrize(
  "features",
  [{}, {"segment_ids": np.repeat(np.eye(2, dtype=np.int32), 100, 1)}],
  ids=["lengths", "lengths+segments"],
)
def test_split_kv_decoding_has_no_boolean_tile_at_a_select(
  monkeypatch, features
):
  q = jax.ShapeDtypeStruct((2, 1, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
  options = {**SPLIT_KV_DECODING, **features}
  if "segment_ids" in features:  # one query: its segment of the pair
    options["segment_ids"] = (
      features["segment_ids"][:, -1:],
      features["segment_ids"],
    )

  def decode(q, k, v):
    return sa.attention(q, k, v, interpret=False, **options)

  (module,) = _triton_modules(monkeypatch, decode, q, kv, kv)
  assert "arith.select" in module  # per-row selects remain (1-D)
  assert _boolean_tile_selects(module) == []


def test_the_training_kernels_have_no_boolean_tile_at_a_select(monkeypatch):
  """Forward, delta and both backward kernels, causal with lengths."""
  q = jax.ShapeDtypeStruct((2, 200, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = sa.attention(
      q,
      k,
      v,
      precision="bf16-fa2",
      interpret=False,
      causal=True,
      key_value_seq_lengths=np.array([150, 200], np.int32),
    )
    return jnp.sum(out.astype(jnp.float32))

  fn = jax.grad(loss, argnums=(0, 1, 2))
  modules = _triton_modules(monkeypatch, fn, q, kv, kv)
  assert len(modules) >= 3
  assert [_boolean_tile_selects(m) for m in modules] == [[]] * len(modules)


@pytest.mark.parametrize(
  "dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]
)
def test_a_mask_applied_by_bits_is_jnp_where_bit_for_bit(dtype):
  values = np.array([[1.5, -0.0, np.nan, np.inf], [-np.inf, 3e-8, -7.0, 2.0]])
  x = jnp.asarray(values, dtype)
  keep = jnp.array([[True, False, True, False], [False, True, False, True]])
  for fill in (-np.inf, 0.0):
    got = masked_fill(keep, x, fill)
    want = jnp.where(keep, x, jnp.asarray(fill, dtype))
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(
      np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)),
      np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint8)),
    )


def test_fp32_tiles_fit_the_register_budget_and_lower_for_cuda():
  assert fp32_gpu_tiles(64) == {"block_q": 64, "block_k": 64, "num_warps": 4}
  assert fp32_gpu_tiles(128) == {"block_q": 32, "block_k": 32, "num_warps": 4}
  assert fp32_gpu_tiles(256)["block_q"] == 16
  q = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.float32)

  def loss(q, k, v):
    out = sa.attention(
      q, k, v, precision="fp32-stable", interpret=False, **fp32_gpu_tiles(128)
    )
    return jnp.sum(out)

  text = lowered_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, q, q).as_text()
  assert text.count("__gpu$xla.gpu.triton") >= 3


@pytest.mark.gpu
@pytest.mark.parametrize(
  "features",
  [{}, {"segment_ids": np.repeat(np.eye(2, dtype=np.int32), 256, 1)}],
  ids=["lengths", "lengths+segments"],
)
def test_compiled_split_kv_with_key_lengths_matches_interpret_mode(features):
  q, k, v = (
    jnp.asarray(x, jnp.bfloat16)
    for x in random_qkv(4, batch=2, q_len=1, kv_len=512, head_dim=64)
  )
  options = {**SPLIT_KV_DECODING, **features}
  if "segment_ids" in features:
    options["segment_ids"] = (
      features["segment_ids"][:, -1:],
      features["segment_ids"],
    )
  compiled, interpreted = (
    np.asarray(sa.attention(q, k, v, interpret=i, **options), np.float32)
    for i in (False, True)
  )
  assert float(np.mean(compiled == interpreted)) >= 0.995


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp32-stable"])
def test_compiled_fp32_presets_at_their_tiles_match_interpret_mode(precision):
  q, k, v = (
    x.astype(np.float32)
    for x in random_qkv(5, batch=1, q_len=256, head_dim=128)
  )
  tiles = fp32_gpu_tiles(128)
  outs = [
    np.asarray(sa.attention(q, k, v, precision=precision, interpret=i, **tiles))
    for i in (False, True)
  ]
  # FP32 sums in another order (test_gpu_lowering's FP32 bound).
  ulp = np.spacing(np.float32(np.abs(outs[1]).max()))
  assert float(np.abs(outs[0] - outs[1]).max() / ulp) <= 16
