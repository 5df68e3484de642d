"""On a GPU: compiled gradients against interpret mode for the stable
presets and MLA's head dims, and NaN padding kept out of a compiled run
(launch/gpu_session.sh runs these with the other GPU-marked tests)."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv, value_and_grads
from test_gpu_lowering import GPU_PRESETS

import stableattn as sa
from stableattn.contract.tiling import fp32_gpu_tiles

STABLE_PRESETS = [p for p in GPU_PRESETS if p.endswith("-stable")]


def _on_grid(x):
  """Values on a 1/16 grid: products and sums start exact, so compiled and
  interpreted runs differ only where their roundings do."""
  return np.clip(np.round(x * 16) / 16, -4, 4).astype(np.float32)


def _share_identical(compiled, interpreted) -> list[float]:
  return [float(np.mean(c == i)) for c, i in zip(compiled, interpreted)]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", STABLE_PRESETS + ["bf16-fa2"])
@pytest.mark.parametrize("head_dims", [(64, 64), (192, 128)])  # MHA, MLA
def test_compiled_gradients_round_like_interpret_mode(precision, head_dims):
  """Forward and backward, compiled against interpreted, for the stable
  presets (their FP32 residuals and delta from probabilities) and MLA's
  separate q/k and v head dims."""
  q, k, _ = (
    _on_grid(x) for x in random_qkv(5, q_len=200, head_dim=head_dims[0])
  )
  _, _, v = (
    _on_grid(x) for x in random_qkv(6, q_len=200, head_dim=head_dims[1])
  )
  d_out = _on_grid(
    np.random.default_rng(7).standard_normal(q.shape[:-1] + v.shape[-1:])
  )
  # FP32 operands at their GPU tiles (the backward's follow the forward's):
  # 64x64 FP32 tiles at head dim 192 need more shared memory than a Triton
  # program gets.
  fp32 = sa.Precision.from_name(precision).matmul_operands == "fp32"
  tiles = fp32_gpu_tiles(head_dims[0]) if fp32 else {}
  runs = [
    value_and_grads(
      q, k, v, d_out, precision=precision, causal=True, interpret=i, **tiles
    )
    for i in (False, True)
  ]
  compiled, interpreted = ([out, *grads] for out, grads in runs)
  if sa.Precision.from_name(precision).output != "fp32":
    shares = _share_identical(compiled, interpreted)
    assert min(shares) >= 0.99, (
      f"bit-identical shares (o, dq, dk, dv): {shares}"
    )
    return
  # FP32 outputs: the dots' summation orders differ (see above).
  for name, c, i in zip(("o", "dq", "dk", "dv"), compiled, interpreted):
    ulp = np.spacing(np.float32(np.abs(i).max()))
    apart = float(np.abs(c - i).max() / ulp)
    assert apart <= 64, f"{name}: {apart:.1f} ulps of its largest value apart"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", STABLE_PRESETS)
def test_compiled_one_key_rows_have_no_query_or_key_gradient(precision):
  """One query over 37 keys, causal top-left: each row attends one key, so
  dQ and dK are exactly 0, as in FP64. The stable presets sum delta by a
  matmul of dP's tile shape (delta_product=matmul); on tensor cores that
  cancels dP only if both matmuls sum each entry alike, which interpret
  mode cannot show (tests/test_exact_rounding_stability.py holds it
  there)."""
  rng = np.random.default_rng(5)
  dtype = sa.Precision.from_name(precision).dtype("inputs")
  shapes = ((8, 1, 4, 64), (8, 37, 4, 64), (8, 37, 4, 64), (8, 1, 4, 64))
  q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)
  _, grads = value_and_grads(
    q, k, v, d_out, precision=precision, causal=True, interpret=False
  )
  assert np.max(np.abs(grads[0])) == 0 and np.max(np.abs(grads[1])) == 0


@pytest.mark.gpu
def test_compiled_kernel_keeps_nan_padding_out():
  """NaN in every key past a length: compiled output and gradients are the
  clean run's bit for bit (the per-tile zeroing lowers to Triton selects)."""
  q, k, v = (_on_grid(x) for x in random_qkv(8, q_len=192, head_dim=64))
  lengths = np.array([192, 70], np.int32)
  poisoned_k, poisoned_v = k.copy(), v.copy()
  poisoned_k[1, 70:] = np.nan
  poisoned_v[1, 70:] = np.inf
  d_out = _on_grid(np.random.default_rng(9).standard_normal(q.shape))
  kwargs = dict(
    precision="bf16-fa2", key_value_seq_lengths=lengths, interpret=False
  )
  clean_out, clean_grads = value_and_grads(q, k, v, d_out, **kwargs)
  out, grads = value_and_grads(q, poisoned_k, poisoned_v, d_out, **kwargs)
  assert np.array_equal(out, clean_out)
  assert np.array_equal(grads[0], clean_grads[0])
  for got, clean in zip(grads[1:], clean_grads[1:]):  # dK, dV: kept keys
    assert np.array_equal(got[1, :70], clean[1, :70]) and np.array_equal(
      got[0], clean[0]
    )
