"""The Hopper path's backward over head dims (`mosaic_backward_layout`):
dK and dV in one thread block up to head dim 128, apart above it, and
column parts with chunked contractions over 256 (absorbed MLA's
576/512). Each layout lowers for sm_90 in the shared memory the plan
counts, every backward kernel fits wherever the forward does, and MLA's
gradients are within the Triton path's error."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stableattn as sa
from stableattn.experiments import hopper_check
from stableattn.harness.cuda_lowering import lowered_for_cuda
from stableattn.kernels import mosaic_plan
from stableattn.kernels.mosaic_backward_layout import (
  backward_layout,
  kernel_bytes,
)
from stableattn.kernels.mosaic_forward_block import shared_bytes
from stableattn.kernels.mosaic_support import SHARED_MEMORY_BYTES
from stableattn.ops import dispatch


def _plan(q_shape, k_shape, value_dim, keywords, interpret):
  options, features = dispatch.split_keywords(None, None, dict(keywords))
  spec, _ = features.split(q_shape, k_shape)
  cfg = dispatch.kernel_config(
    options, q_shape, k_shape, spec, value_dim, interpret
  )
  return mosaic_plan.plan_of(cfg, q_shape[2] // k_shape[2])


def _smem_counts(monkeypatch):
  """The shared-memory bytes Mosaic GPU's lowering counts for each kernel
  it builds, in order (a list that fills as kernels lower)."""
  import jax.experimental.mosaic.gpu.core as mosaic_core

  counts = []
  count = mosaic_core._smem_tree_size

  def counted(tree):
    counts.append(count(tree))
    return counts[-1]

  monkeypatch.setattr(mosaic_core, "_smem_tree_size", counted)
  return counts


@pytest.mark.parametrize(
  "dims, keywords, kernels",
  [
    # dK and dV in one thread block, with a bias and block ranges.
    (
      (128, 128),
      {"bias": np.zeros((1, 4, 200, 300), np.float32),
       "key_value_seq_lengths": np.array([100, 300])},
      ("dkdv", "dq"),
    ),
    # dV and dK apart; dQ at 64 keys where 128 would not fit.
    ((256, 256), {"causal": True, "block_k": 128}, ("dv", "dk", "dq")),
    # Absorbed MLA: three parts of 192 columns, two of 256, chunked.
    (
      (576, 512),
      {"key_value_seq_lengths": np.array([230, 300])},
      ("dv", "dk", "dq"),
    ),
    # d(sink) from the softmax's own P: dQ also stores two row sums.
    (
      (64, 64),
      {"sink": np.zeros(4, np.float32),
       "precision": "fp16-fa2+sink_delta=probs"},
      ("dkdv", "dq"),
    ),
  ],
  ids=["fused-bias-lengths", "split-d256", "mla-576-512", "sink-probs"],
)  # fmt: skip
def test_the_backward_lowers_for_sm90_in_the_shared_memory_it_counts(
  monkeypatch, dims, keywords, kernels
):
  """Forward and backward build for sm_90, and each backward kernel's
  shared memory is `kernel_bytes`' count, byte for byte (the forward's
  is `shared_bytes`')."""

  counts = _smem_counts(monkeypatch)
  d, dv = dims
  kwargs = dict(interpret=False, **keywords)
  precision = sa.Precision.from_name(kwargs.get("precision", "bf16-fa2"))
  dtype = precision.dtype("inputs")
  q = jax.ShapeDtypeStruct((2, 200, 4, d), dtype)
  k = jax.ShapeDtypeStruct((2, 300, 2, d), dtype)
  v = jax.ShapeDtypeStruct((2, 300, 2, dv), dtype)

  def loss(q, k, v):
    out = sa.attention(q, k, v, implementation="mosaic_gpu", **kwargs)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  text = lowered_for_cuda(
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), q, k, v
  ).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1 + len(kernels)
  plan = _plan(q.shape, k.shape, dv, kwargs, interpret=False)
  backward = kernel_bytes(plan)
  assert tuple(backward) == kernels
  assert counts == [shared_bytes(plan), *backward.values()]


def _within_the_triton_paths_error(case):
  """Asserts each of the Hopper path's tensors (out, dq, dk, dv) is
  within 1.5x of the Triton path's error against FP64 on `case`
  (`hopper_check`'s form); [(tensor, ours, the Triton path's)]."""
  ours = hopper_check.value_and_grads("mosaic_gpu", case)
  triton = hopper_check.value_and_grads("pallas", case)
  golden = hopper_check.golden(case)
  for name, a, b, g in zip(hopper_check.TENSORS, ours, triton, golden):
    errors = [np.abs(x - g).max() for x in (b, a)]
    assert errors[1] <= 1.5 * errors[0], (name, errors)
  return list(zip(hopper_check.TENSORS, ours, triton))


def test_mla_576_512_gradients_are_within_the_triton_paths_error():
  """Absorbed MLA's 576/512 with gradients: dQ and dK in three column
  parts of 192, dV in two of 256, S and dP summed chunk by chunk. Each
  tensor's error against FP64 is within 1.5x of the Triton path's, and
  most entries are the Triton path's bit for bit."""
  case = ("bf16-fa2", 64, 64, 1, 1, (576, 512), {"causal": True})
  for name, ours, triton in _within_the_triton_paths_error(case):
    assert np.mean(ours == triton) > 0.95, name


def test_dq_at_its_own_key_block_reads_its_own_block_ranges():
  """Head dim 256 at `block_k=128`: the forward takes 128-key blocks, dQ
  64 (128 would not fit), so dQ reads key-block ranges of 64 keys,
  recomputed from the lengths, not the forward's; the gradients are the
  Triton path's to its error. (Queries 64-69 reach the second 64-key
  block, which the forward's range, one 128-key block, would read as
  the first only.)"""
  lengths = np.array([40, 200])
  keywords = {"block_k": 128, "causal": True, "key_value_seq_lengths": lengths}
  plan = _plan((2, 70, 1, 256), (2, 200, 1, 256), 256, keywords, True)
  assert plan.block_k == 128 and backward_layout(plan).block_k == 64
  _within_the_triton_paths_error(("bf16-fa2", 70, 200, 1, 1, 256, keywords))


def test_every_backward_kernel_fits_where_the_forward_does():
  """Over head dims 16 to 576 (MLA's), value dims 16 to 512, both key
  blocks and each feature that takes shared memory: wherever the
  forward fits an H100's block, so does each backward kernel (which is
  why the backward refuses nothing by its bytes)."""

  lengths = np.array([100, 300])
  features = {
    "none": {},
    "bias": {"bias": np.zeros((1, 4, 200, 300), np.float32)},
    "mask": {"mask": np.ones((2, 1, 200, 300), bool)},
    "lengths": {"key_value_seq_lengths": lengths},
    "sink-probs": {
      "sink": np.zeros(4, np.float32),
      "precision": "fp16-fa2+sink_delta=probs",
    },
    "positions": {
      "causal_alignment": "bottom_right",
      "key_value_seq_lengths": lengths,
      "query_seq_lengths": np.array([100, 200]),
    },
  }
  fitted = []
  for d, dv, block_k, name in itertools.product(
    (16, 64, 128, 192, 256, 320, 448, 576),
    (16, 64, 128, 256, 512),
    (64, 128),
    features,
  ):
    kwargs = {"block_k": block_k, "causal": True, **features[name]}
    plan = _plan((2, 200, 4, d), (2, 300, 2, d), dv, kwargs, interpret=True)
    if shared_bytes(plan) <= SHARED_MEMORY_BYTES:
      needs = max(kernel_bytes(plan).values())
      fitted.append(needs)
      assert needs <= SHARED_MEMORY_BYTES, (d, dv, block_k, name, needs)
  # Most combinations fit, and some come within 2% of the limit.
  assert len(fitted) > 300 and max(fitted) > 0.98 * SHARED_MEMORY_BYTES
