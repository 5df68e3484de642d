"""FP8 operands on the Hopper path (`mosaic_gpu`): FlashAttention-3's
e4m3 presets with their scales (per tensor, per tile with the Hadamard
rotation, SageAttention's per token and per channel with P scaled by
448) run bit for bit with the Triton path in GPU interpret mode, in the
interpreter's form (K^T and V N-major) and, where jax's interpreter reads
transposed views, in the K-major form a GPU compiles; their gradient is
refused in one line naming the Triton path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mosaic_lowered_text, sampled

import stableattn as sa
from stableattn.experiments import hopper_check

FP8_PRESETS = ("fp8-baseline", "fp8-fa3", "fp8-sage")
_RNG = np.random.default_rng(8)
# GQA at ragged lengths, causal over each example's own key lengths.
BASE = {"causal": True, "key_value_seq_lengths": np.array([90, 130])}
FEATURES = {
  "bias-mask": {
    "bias": _RNG.standard_normal((1, 4, 70, 130)).astype(np.float32),
    "mask": _RNG.random((2, 1, 70, 130)) < 0.7,
  },
  "window-softcap": {"local_window_size": (40, 10), "softcap": 5.0},
  "sink": {"causal": True, "sink": np.array([0.5, 4.0, -1.0, 2.0], np.float32)},
  "split-kv": {"num_splits": 2, **BASE},
  "block-k-128": {"block_k": 128, **BASE},
}


def _outputs(preset, features, head_dim=64, **options):
  """(Triton path, Hopper path, FP64 golden) outputs in FP64, of q [2,
  70, 4, D] over k, v [2, 130, 2, D] (`hopper_check`'s case inputs)."""
  case = (preset, 70, 130, 4, 2, head_dim, features)
  triton = hopper_check.value_and_grads("pallas", case)[0]
  hopper = hopper_check.value_and_grads("mosaic_gpu", case, **options)[0]
  return triton, hopper, hopper_check.golden(case)[0]


def _assert_same(triton, hopper, golden, differ_at_most=0):
  differ = int(np.sum(triton != hopper))
  assert differ <= differ_at_most, f"{differ} of {triton.size} entries differ"
  # An entry that differs is one FP16 unit apart at the largest value.
  unit = float(np.finfo(np.float16).eps) * np.abs(triton).max()
  assert np.abs(triton - hopper).max() <= unit
  errors = [np.abs(x - golden).max() for x in (triton, hopper)]
  assert errors[1] <= 1.5 * errors[0], errors


# One preset in the fast tier: the three share every kernel but the
# scales and the stages they round.
@pytest.mark.parametrize("preset", sampled(FP8_PRESETS, 1))
def test_fp8_presets_run_bit_for_bit_with_the_triton_path(preset):
  _assert_same(*_outputs(preset, BASE))


@pytest.mark.slow
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("preset", FP8_PRESETS)
def test_fp8_presets_with_each_feature(preset, feature):
  features = FEATURES[feature]
  if preset == "fp8-sage" and "softcap" in features:
    features = {"local_window_size": features["local_window_size"]}
  _assert_same(*_outputs(preset, features))


@pytest.mark.slow
def test_fp8_value_parts_of_absorbed_mla():
  """MLA's 576/512 in two value parts: V's per-channel scales by part.
  As in BF16 (docs/performance.md), a few outputs round apart from the
  Triton path's (measured: 8 of 286,720, by 0.15 of an FP16 unit at the
  largest; the order of the sums that moves them was not traced)."""
  outputs = _outputs("fp8-sage", BASE, head_dim=(576, 512))
  _assert_same(*outputs, differ_at_most=20)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["warp_specialized", "two_consumers"])
def test_fp8_in_flashattention3s_warpgroup_forms(form):
  """A copy warpgroup filling the ring (and two compute warpgroups in
  ping-pong), each reading K's and V's scales itself: the one-warpgroup
  kernel's result, so the Triton path's, bit for bit."""
  _assert_same(*_outputs("fp8-sage", BASE, hopper_form=form))


E5M2 = "fp8-fa3+matmul_operands=fp8_e5m2+probs=fp8_e5m2"


@pytest.mark.slow
def test_e5m2_operands_run_bit_for_bit_and_lower_for_sm90():
  """wgmma's other FP8 format: FlashAttention-3's per-tile preset with
  Q, K, V and P in e5m2."""
  _assert_same(*_outputs(E5M2, BASE))
  text = mosaic_lowered_text(E5M2, gradients=False, causal=True)
  assert text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.skipif(
  jax.__version_info__ < (0, 11),
  reason="jax 0.10's GPU interpreter has no rule for a transposed "
  "shared-memory view (docs/performance.md); jax 0.11's runs it",
)
@pytest.mark.parametrize("preset", FP8_PRESETS)
def test_the_k_major_form_a_gpu_compiles_is_bit_for_bit(preset):
  """K as stored and V^T, both read through transposed views (8-bit
  wgmma operands K-major), as every compiled FP8 plan reads them."""
  _assert_same(*_outputs(preset, BASE, hopper_form="k_as_stored"))


def test_the_fp8_gradient_is_refused_naming_the_triton_path():
  (q, k, v, _), _ = hopper_check.inputs(("fp8-fa3", 70, 130, 4, 2, 64, {}))

  def loss(q):
    out = sa.attention(
      q, k, v, precision="fp8-fa3", implementation="mosaic_gpu"
    )
    return jnp.sum(out.astype(jnp.float32))

  with pytest.raises(
    ValueError, match=r"no gradient under precision 'fp8-fa3'.*'pallas'"
  ):
    jax.grad(loss)(q)
