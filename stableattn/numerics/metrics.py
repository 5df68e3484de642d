"""Deviation metrics, all computed in NumPy float64.

`compare(expected, actual)` is the one measurement every study uses;
`error_ratio` is the quantity of FlashAttention's test rule, whose verdict
(with the other projects' rules) lives in `stableattn.numerics.rules`.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref

import ml_dtypes
import numpy as np

from stableattn.numerics.formats import format_name, to_dtype
from stableattn.numerics.rounding import LOW_FORMATS


@dataclasses.dataclass(frozen=True)
class Deviation:
  """How far `actual` is from `expected`, elementwise and as distributions."""

  max_abs: float  # max |actual - expected|: the paper's metric
  mean_abs: float
  std_abs: float
  rmse: float  # FlashAttention-3's metric
  rel_l2: float  # ||actual - expected|| / ||expected||
  wasserstein: float  # W1 between the two value distributions
  max_ulp: float  # max |actual - expected| in units in the last place
  ulp_format: str  # the format max_ulp counts in
  mean_signed: float  # mean(actual - expected): bias
  # mean(err * sign(expected)) / mean(|err|): +1 when every error points
  # away from zero, -1 toward it; Qiu & Yao's biased rounding shows here
  # and cancels in `mean_signed` when the values have both signs. 0 if no
  # error.
  signed_share: float
  n_nan: int  # NaNs in actual
  n_inf: int  # infinities in actual
  # Where |expected| exceeds the largest finite value of `ulp_format`:
  # actual held at +-that value (a saturating cast: e4m3fn, e2m1, int8),
  # or actual infinite or NaN (an overflowing one: e5m2, FP16, BF16).
  n_saturated: int
  n_overflow: int
  argmax: tuple[int, ...]  # index of the largest |actual - expected|
  size: int

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["argmax"] = list(self.argmax)
    return d


def _float64(x) -> np.ndarray:
  """x as a float64 array; x itself when it is one (nothing here writes
  into its inputs)."""
  return np.asarray(x).astype(np.float64, copy=False)


# Sorted values of arrays compared more than once (a golden output against
# each kernel, a kernel's output against golden and a Baseline), by the
# array's identity. Only for an array that owns its data and is read-only,
# whose values cannot change unless its flags are set back on purpose; a
# weak reference tells a reused identity from the array it was.
_SORTED_KEPT = 64
_sorted: collections.OrderedDict = collections.OrderedDict()


def _sorted_values(x: np.ndarray) -> np.ndarray:
  if x.flags.writeable or not x.flags.owndata:
    return np.sort(x, axis=None)
  kept = _sorted.get(id(x))
  if kept is not None and kept[0]() is x:
    _sorted.move_to_end(id(x))
    return kept[1]
  values = np.sort(x, axis=None)
  _sorted[id(x)] = (weakref.ref(x), values)
  while len(_sorted) > _SORTED_KEPT:
    _sorted.popitem(last=False)
  return values


def ulp(x: np.ndarray, fmt: str) -> np.ndarray:
  """Spacing of `fmt` at each value of x (subnormal spacing near zero)."""
  if format_name(fmt) == "int8":
    return np.ones_like(_float64(x))
  info = ml_dtypes.finfo(to_dtype(fmt))
  magnitude = np.abs(_float64(x))
  with np.errstate(divide="ignore"):
    exponent = np.floor(np.log2(magnitude))
  exponent = np.maximum(
    np.nan_to_num(exponent, neginf=info.minexp), info.minexp
  )
  return np.exp2(exponent - info.nmant)


def largest_finite(fmt: str) -> float:
  """The largest finite value of a format (127 for int8)."""
  fmt = format_name(fmt)
  if fmt in LOW_FORMATS:
    return float(LOW_FORMATS[fmt].max_finite)
  return float(ml_dtypes.finfo(to_dtype(fmt)).max)


def _range_counts(e: np.ndarray, a: np.ndarray, fmt: str) -> dict:
  """n_saturated and n_overflow of `Deviation` (see there)."""
  largest = largest_finite(fmt)
  beyond = np.isfinite(e) & (np.abs(e) > largest)
  held = np.abs(a) == largest
  return dict(
    n_saturated=int((beyond & held).sum()),
    n_overflow=int((beyond & ~np.isfinite(a)).sum()),
  )


def wasserstein_1d(a: np.ndarray, b: np.ndarray) -> float:
  """Exact 1-D Wasserstein-1 distance between two equal-size samples."""
  a, b = _sorted_values(_float64(a)), _sorted_values(_float64(b))
  if a.shape != b.shape:
    raise ValueError(f"samples must have equal sizes, got {a.size}, {b.size}")
  return float(np.mean(np.abs(a - b)))


def compare(expected, actual, *, ulp_format: str | None = None) -> Deviation:
  """Deviation of `actual` from `expected`, in float64.

  Args:
    expected: reference values (e.g. the golden FP64 output).
    actual: values under test, same shape.
    ulp_format: format in which `max_ulp` counts units in the last place;
      defaults to `actual`'s dtype (FP64 if it is not a float format).

  Returns:
    A `Deviation`. NaN or Inf in `actual` propagate into the magnitudes and
    are counted in `n_nan` / `n_inf`. With `actual` a cast of `expected`
    (e.g. `compare(x, x.astype(jnp.float8_e4m3fn))`, or an FP32-carried
    cast with `ulp_format="fp8_e4m3"`), `n_saturated` and `n_overflow`
    count the values the cast clipped or sent to infinity.

  Raises:
    ValueError: if the shapes differ or an input is empty.
  """
  actual_arr = np.asarray(actual)
  e, a = _float64(expected), _float64(actual_arr)
  if e.shape != a.shape:
    raise ValueError(f"shapes differ: expected {e.shape}, actual {a.shape}")
  if e.size == 0:
    raise ValueError("cannot compare empty arrays")
  if ulp_format is None:
    try:
      ulp_format = format_name(actual_arr.dtype)
    except ValueError:
      ulp_format = "fp64"
  diff = a - e
  abs_diff = np.abs(diff)
  # Ratios may be inf or NaN (an exact-zero reference, a NaN result): those
  # are results, reported as such.
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    rel_l2 = float(np.linalg.norm(diff) / np.linalg.norm(e))
    max_ulp = float(np.max(abs_diff / ulp(e, ulp_format)))
  if np.isnan(abs_diff).any():
    argmax = np.unravel_index(int(np.argmax(np.isnan(abs_diff))), e.shape)
  else:
    argmax = np.unravel_index(int(np.argmax(abs_diff)), e.shape)
  mean_abs = float(np.mean(abs_diff))
  return Deviation(
    max_abs=float(np.max(abs_diff)),
    mean_abs=mean_abs,
    std_abs=float(np.std(abs_diff)),
    rmse=float(np.sqrt(np.mean(diff**2))),
    rel_l2=rel_l2,
    wasserstein=wasserstein_1d(e, a),
    max_ulp=max_ulp,
    ulp_format=ulp_format,
    mean_signed=float(np.mean(diff)),
    signed_share=_signed_share(diff, e, mean_abs),
    n_nan=int(np.isnan(a).sum()),
    n_inf=int(np.isinf(a).sum()),
    **_range_counts(e, a, ulp_format),
    argmax=tuple(int(i) for i in argmax),
    size=int(e.size),
  )


def signed_share(expected, actual) -> float:
  """mean((actual - expected) * sign(expected)) / mean(|actual - expected|).

  +1: every error points away from zero; -1: toward zero; 0 for unbiased
  errors or none. Measured relative to the sign of the true value, so a
  bias of magnitude does not cancel between positive and negative values.
  """
  e = _float64(expected)
  diff = _float64(actual) - e
  return _signed_share(diff, e, float(np.mean(np.abs(diff))))


def _signed_share(diff, e, mean_abs: float) -> float:
  """`signed_share` from the error, the expected values and mean |error|."""
  if mean_abs == 0 or not np.isfinite(mean_abs):
    return 0.0 if mean_abs == 0 else float("nan")
  return float(np.mean(diff * np.sign(e)) / mean_abs)


def safe_ratio(a: float, b: float) -> float:
  """a / b, with 0 / 0 = 0 (no error either side) and a / 0 = inf."""
  if b == 0:
    return 0.0 if a == 0 else float("inf")
  return a / b


def power_law(x, y):
  """Least-squares slope and R^2 of log y against log x."""
  x, y = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
  slope, intercept = np.polyfit(x, y, 1)
  residual = y - (slope * x + intercept)
  total = np.sum((y - y.mean()) ** 2)
  r2 = 1.0 - np.sum(residual**2) / total if total > 0 else 1.0
  return float(slope), float(r2)


def error_ratio(golden, candidate, baseline, *, metric: str = "max_abs"):
  """FlashAttention's test quantity: candidate error / baseline error.

  Both errors are measured against `golden` with `compare`. A ratio of 1
  means the candidate is as accurate as the baseline; FlashAttention's tests
  accept up to 2 (3 for gradients).
  """
  candidate_error = getattr(compare(golden, candidate), metric)
  baseline_error = getattr(compare(golden, baseline), metric)
  return safe_ratio(candidate_error, baseline_error)


def rounding_floor(golden, fmt: str) -> float:
  """FlashAttention-3's absolute slack: 2 max|(g + 0.3 - 0.3) - g| in fmt."""
  dtype = to_dtype(fmt)
  g = np.asarray(golden).astype(dtype)
  shifted = (g + np.asarray(0.3, dtype)) - np.asarray(0.3, dtype)
  return 2.0 * float(np.max(np.abs(_float64(shifted) - _float64(g))))
