import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import stableattn as sa
from stableattn.numerics import metrics
from stableattn.numerics.metrics import ulp, wasserstein_1d


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 500))
def test_wasserstein_matches_scipy(seed, n):
  rng = np.random.default_rng(seed)
  a = rng.standard_normal(n)
  b = rng.standard_normal(n) * 2 + 0.5
  from scipy import stats  # 1-2 s to import: only in this test's worker

  ours = wasserstein_1d(a, b)
  theirs = stats.wasserstein_distance(a, b)
  assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-300)


def test_compare_basic_quantities():
  expected = np.array([[1.0, 2.0], [3.0, 4.0]])
  actual = np.array([[1.0, 2.5], [2.0, 4.0]])
  d = sa.compare(expected, actual)
  assert d.max_abs == 1.0
  assert d.argmax == (1, 0)
  assert d.mean_abs == pytest.approx(0.375)
  assert d.mean_signed == pytest.approx(-0.125)
  assert d.rmse == pytest.approx(np.sqrt((0.25 + 1.0) / 4))
  assert d.rel_l2 == pytest.approx(np.sqrt(1.25) / np.sqrt(30))
  assert d.std_abs == pytest.approx(np.std([0, 0.5, 1.0, 0]))
  assert (d.n_nan, d.n_inf, d.size) == (0, 0, 4)


def test_compare_counts_nan_and_inf_and_does_not_hide_them():
  expected = np.zeros(4)
  actual = np.array([0.0, np.nan, np.inf, 1.0])
  d = sa.compare(expected, actual)
  assert d.n_nan == 1 and d.n_inf == 1
  assert np.isnan(d.max_abs)
  assert d.argmax == (1,)


@pytest.mark.parametrize(
  "fmt, saturated, overflow",
  [
    ("fp8_e4m3", 2, 0),  # e4m3fn saturates at +-448
    ("fp8_e5m2", 0, 1),  # e5m2 overflows to infinity beyond 57344
    ("fp4_e2m1", 3, 0),  # e2m1 saturates at +-6 (7 too)
    ("int8", 2, 0),  # +-127
    ("fp16", 0, 1),  # 65504
  ],
)
def test_compare_counts_saturated_and_overflowing_casts(
  fmt, saturated, overflow
):
  x = np.array([0.5, 7.0, -500.0, 1e5, 3.0, -6.0])
  cast = sa.round_to(jnp.asarray(x, jnp.float32), fmt)
  d = sa.compare(x, cast, ulp_format=fmt)
  assert (d.n_saturated, d.n_overflow) == (saturated, overflow)


def test_compare_rejects_shape_mismatch():
  with pytest.raises(ValueError, match="shapes differ"):
    sa.compare(np.zeros(3), np.zeros(4))


def test_ulp_of_one_in_each_format():
  assert ulp(np.array(1.0), "bf16") == 2.0**-7
  assert ulp(np.array(1.0), "fp16") == 2.0**-10
  assert ulp(np.array(-3.0), "fp32") == 2.0**-22
  # Near zero: subnormal spacing, never zero.
  assert ulp(np.array(0.0), "fp16") == 2.0**-24


def test_max_ulp_counts_in_actual_format():
  expected = np.array([1.0, 2.0])
  actual = np.array([1.0 + 2.0**-7, 2.0]).astype("float32")
  d = sa.compare(expected, actual, ulp_format="bf16")
  assert d.max_ulp == pytest.approx(1.0)
  assert sa.compare(expected, actual).ulp_format == "fp32"


def test_error_ratio_and_fa_rule():
  golden = np.zeros(10)
  baseline = np.full(10, 0.1)
  candidate = np.full(10, 0.25)
  assert sa.error_ratio(golden, candidate, baseline) == pytest.approx(2.5)
  assert not sa.passes_fa_rule(golden, candidate, baseline)
  assert sa.passes_fa_rule(golden, candidate, baseline, factor=3.0)
  assert sa.passes_fa_rule(golden, candidate, baseline, floor=0.05)


def test_rounding_floor_is_a_few_ulps():
  golden = np.linspace(-1, 1, 101)
  floor = sa.rounding_floor(golden, "bf16")
  assert 0 < floor <= 4 * 2.0**-7


def test_gradient_error_shape_measures():
  from stableattn.training.drift import cosine, top_singular_share

  u, v = np.arange(1.0, 5.0), np.arange(2.0, 5.0)
  assert top_singular_share(np.outer(u, v)) == pytest.approx(1.0)
  assert top_singular_share(np.eye(8)) == pytest.approx(1 / 8)
  assert top_singular_share(np.zeros((3, 3))) == 0.0
  a = np.random.default_rng(0).standard_normal((4, 4))
  assert cosine(a, 3 * a) == pytest.approx(1.0)
  assert cosine(a, -a) == pytest.approx(-1.0)
  assert cosine(a, np.zeros_like(a)) == 0.0


def test_one_zero_safe_ratio_for_every_report():
  from stableattn.numerics.metrics import safe_ratio

  assert safe_ratio(3.0, 2.0) == 1.5
  assert safe_ratio(0.0, 0.0) == 0.0
  assert safe_ratio(1.0, 0.0) == float("inf")
  gold = np.zeros((2, 2))
  assert sa.error_ratio(gold, gold, gold) == 0.0


def test_sorted_values_are_reused_only_for_arrays_that_cannot_change():
  """W1 sorts both samples; the sorted values of an array are kept between
  comparisons only when the array owns its data and is read-only."""
  rng = np.random.default_rng(5)
  x, y = rng.standard_normal(1000), rng.standard_normal(1000)

  def exact(a, b):
    return float(np.mean(np.abs(np.sort(a) - np.sort(b))))

  before = wasserstein_1d(x, y)
  x += 1.0  # writeable: sorted again
  assert wasserstein_1d(x, y) == exact(x, y) != before
  view = x.view()
  view.setflags(write=False)  # read-only, but its owner is not
  assert wasserstein_1d(view, y) == exact(x, y)
  x *= 3.0
  assert wasserstein_1d(view, y) == exact(x, y)
  frozen = x.copy()
  frozen.setflags(write=False)
  assert wasserstein_1d(frozen, y) == wasserstein_1d(frozen, y) == exact(x, y)
  assert wasserstein_1d(y, frozen) == exact(x, y)
  kept = metrics._sorted
  assert id(frozen) in kept and kept[id(frozen)][0]() is frozen
  assert id(x) not in kept and id(view) not in kept and id(y) not in kept
