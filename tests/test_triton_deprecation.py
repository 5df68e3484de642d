"""jax 0.11 deprecated Pallas's Triton back end and warns at each Triton
lowering; our Triton path's lowerings drop that one warning (by its
exact text, for our kernels only: `kernels.triton_deprecation`)."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import stableattn as sa
from stableattn.harness.cuda_lowering import lowered_for_cuda
from stableattn.kernels import triton_deprecation as td


def _warning_lowering(*messages):
  """A stand-in for pallas_call's lowering that warns `messages`."""

  def rule(ctx, *args, **params):
    for message in messages:
      warnings.warn(message, DeprecationWarning, stacklevel=1)
    return "lowered"

  return rule


@pytest.mark.parametrize(
  "name", ["stableattn_flash_forward_fa2", "their_kernel"]
)
def test_only_our_kernels_drop_the_triton_deprecation_and_only_it(name):
  """Our lowerings drop jax's Triton deprecation (its exact text); another
  warning of ours, and every warning of anyone else's kernel, stays."""
  other = "some other deprecation"
  extended = td.TRITON_DEPRECATION + " More text."
  rule = td.quiet_for_our_kernels(
    _warning_lowering(td.TRITON_DEPRECATION, other, extended)
  )
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert rule(None, name=name) == "lowered"
  seen = [str(w.message) for w in caught]
  ours = name.startswith("stableattn_")
  assert (td.TRITON_DEPRECATION in seen) is not ours
  assert other in seen and extended in seen


def test_the_quiet_lowering_is_installed_once_over_jaxs():
  from jax._src.interpreters import mlir
  from jax._src.pallas.pallas_call import pallas_call_p

  rule = mlir._lowerings[pallas_call_p].rule
  assert rule.quiets_our_kernels
  assert not getattr(rule.__wrapped__, "quiets_our_kernels", False)
  td.install()
  assert mlir._lowerings[pallas_call_p].rule is rule


def test_our_triton_lowering_raises_no_triton_deprecation():
  """On a jax that deprecates Pallas Triton (0.11+) its warning would
  come at each lowering of our Triton path; none comes. Under jax 0.10
  there is none to drop, and this checks that no other warning does."""

  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = sa.attention(
      q, k, v, precision="bf16-fa2", causal=True, interpret=False
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lowered_for_cuda(fn, q, q, q)
  assert not [w for w in caught if td.TRITON_DEPRECATION in str(w.message)]
