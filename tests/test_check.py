import jax
import jax.numpy as jnp
import numpy as np

import stableattn as sa

SHAPES = [(1, 40, 2, 16)]


def test_check_passes_our_kernel():
  def flash(q, k, v):
    return sa.attention(q, k, v, precision="bf16-fa2", block_q=16, block_k=16)

  report = sa.check(flash, precision="bf16-fa2", shapes=SHAPES, seeds=2)
  assert report.passed, str(report)
  assert len(report.rows) == 2
  assert "PASSED" in str(report)


def test_check_fails_a_kernel_with_a_bug():
  def wrong_scale(q, k, v):
    # A classic bug: scaling by 1/d instead of 1/sqrt(d).
    d = q.shape[-1]
    s = (
      jnp.einsum(
        "bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)
      )
      / d
    )
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32))

  report = sa.check(wrong_scale, precision="bf16-fa2", shapes=SHAPES)
  assert not report.passed
  assert "FAIL" in str(report)
  assert np.isfinite(report.rows[0].ratio) and report.rows[0].ratio > 2


def test_check_says_when_fn_returns_nothing_or_the_wrong_shape():
  import pytest

  def skeleton(q, k, v):  # the README's skeleton, run as it is
    ...

  with pytest.raises(ValueError, match="the kernel returned None"):
    sa.check(skeleton, shapes=SHAPES)
  with pytest.raises(ValueError, match="the kernel returned \\(1, 40, 2, 8\\)"):
    sa.check(lambda q, k, v: q[..., :8], shapes=SHAPES)
