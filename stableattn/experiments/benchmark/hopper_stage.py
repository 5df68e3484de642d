"""The GPU session's `hopper` stage: the Hopper path
(`implementation="mosaic_gpu"`) against cuDNN, jax's `mha` and
`attention_mgpu` and our Triton path, forward and forward+backward,
causal and not, at every length, with FlashAttention-3's forms of its
forward (`Options.hopper_form`); then each feature on both of our paths
and cuDNN at the goals' length. `launch/gpu_stage.py --stage=hopper`
runs it; `hopper_record` reads the rows back.
"""

from __future__ import annotations

import functools
import itertools

import jax

from stableattn.contract.options import HOPPER_SWITCHES
from stableattn.experiments.benchmark.gpu_stages import (
  MODES,
  Sizes,
  _labels,
  _timed_rows,
)
from stableattn.experiments.benchmark.timing import (
  attention_fn,
  compile_all,
  flops,
  random_inputs,
  timed_fn,
)
from stableattn.numerics.precision import Precision

# The Hopper path against what it should beat (issue goals: forward >= 0.8x
# cuDNN's speed, forward+backward >= 0.7x), BF16 at every length.
HOPPER_NAMES = ("mosaic_gpu", "cudnn", "jax_mha", "jax_mgpu", "pallas")
HOPPER_PRECISION = "bf16-fa2"


# FlashAttention-3's form of the Hopper path's forward against the
# interpreter's (`Options.hopper_form`): every switch in both modes, and
# each alone in the forward (the backward is the same program).
def hopper_forms(mode: str) -> dict[str, str]:
  """{row name: hopper_form} timed beside the interpreter's form."""
  forms = ("fa3", *HOPPER_SWITCHES) if mode == "forward" else ("fa3",)
  return {f"mosaic_gpu {form}": form for form in forms}


# The Hopper path's features, each timed against the Triton path and
# cuDNN (an error row where cuDNN lacks it) at the goals' length:
# name -> (causal, features of (length, sizes)).
def _bias(seq_len, s):
  # One bias for every example and head: 256 MB at 8K.
  return {
    "bias": jax.random.normal(jax.random.key(7), (1, 1, seq_len, seq_len))
  }


def _kv_cache_lengths(seq_len, s):
  """Bottom-right causal over each example's own lengths: half the
  queries of a cache filled to 7/8."""

  def lengths(n):
    return jax.numpy.full((s.batch,), n, jax.numpy.int32)

  return {
    "causal_alignment": "bottom_right",
    "query_seq_lengths": lengths(seq_len // 2),
    "key_value_seq_lengths": lengths(seq_len - seq_len // 8),
  }


def _sink(s):
  return {"sink": jax.numpy.zeros((s.heads,))}


HOPPER_FEATURES = {
  "window 1024": (True, lambda n, s: {"local_window_size": (1024, 0)}),
  "softcap 30": (False, lambda n, s: {"softcap": 30.0}),
  "sink": (True, lambda n, s: _sink(s)),
  "bias": (False, _bias),
  "bottom-right lengths": (True, _kv_cache_lengths),
  "fp8-fa3": (True, lambda n, s: {}),
  # Qiu & Yao's fix: a tile's maximum moved off its ties.
  "tie fix": (True, lambda n, s: {"tie_beta": 2.0}),
  # d(sink) from the softmax's own P, summed in the dQ kernel.
  "fp16 stable sink": (True, lambda n, s: _sink(s)),
}
# Features under their own preset (FP8 operands: the forward only, the
# Hopper path's gradient being refused); the others are HOPPER_PRECISION's.
FEATURE_PRECISIONS = {
  "fp8-fa3": "fp8-fa3",
  "fp16 stable sink": "fp16-fa2-stable",
}
FEATURE_NAMES = ("mosaic_gpu", "pallas", "cudnn")


def feature_modes(feature: str, modes=MODES) -> tuple[str, ...]:
  """The modes a feature is timed in: every one, or the forward alone
  where the Hopper path has no gradient (FP8 operands)."""
  precision = FEATURE_PRECISIONS.get(feature, HOPPER_PRECISION)
  if Precision.from_name(precision).quantizes:
    return tuple(m for m in modes if m == "forward")
  return tuple(modes)


def hopper_feature_points(s: Sizes, modes=MODES):
  """(mode, feature, length): each feature at the first (the goals')
  length, forward then forward+backward (`feature_modes`)."""
  for feature in HOPPER_FEATURES:
    for mode in feature_modes(feature, modes):
      yield mode, feature, s.lengths[0]


def hopper_feature_rows(s: Sizes, mode, feature, seq_len) -> list[dict]:
  """Our two paths and cuDNN on one feature, in one alternation."""
  precision = FEATURE_PRECISIONS.get(feature, HOPPER_PRECISION)
  shape = (s.batch, seq_len, s.heads, s.head_dim)
  args = random_inputs(jax.random.key(seq_len), shape, precision)
  causal, build = HOPPER_FEATURES[feature]
  features = build(seq_len, s)
  fns = {
    name: timed_fn(
      functools.partial(attention_fn(name, precision, causal), **features),
      mode,
    )
    for name in FEATURE_NAMES
  }
  compiled = compile_all(fns, args)

  def labels_of(name):
    labels = _labels("hopper", mode, causal, precision, s, seq_len)
    return {**labels, "feature": feature}

  # The window and lengths do less work: the FLOPs of the full causal
  # pass keep the rows comparable among names, not across features.
  work = flops(s.batch, s.heads, seq_len, s.head_dim, causal, mode)
  return _timed_rows(compiled, args, labels_of, s, work)


def _in_fp16(fn):
  def run(q, k, v):
    return fn(*(x.astype(jax.numpy.float16) for x in (q, k, v)))

  return run


def hopper_points(s: Sizes, modes=MODES):
  """(mode, causal, length) in the order they are measured: the lengths
  in turn (8K, the goals', first), each with every mode and masking."""
  for seq_len, mode, causal in itertools.product(
    s.lengths, modes, (False, True)
  ):
    yield mode, causal, seq_len


def hopper_rows(s: Sizes, mode, causal, seq_len) -> list[dict]:
  """Our Mosaic GPU kernel beside cuDNN, jax's `mha` and `attention_mgpu`
  and our Triton path, in one alternation; a name that cannot run here
  (jax_mgpu's causal backward, cuDNN off a GPU) is an error row."""
  shape = (s.batch, seq_len, s.heads, s.head_dim)
  args = random_inputs(jax.random.key(seq_len), shape, HOPPER_PRECISION)
  fns = {}
  for name in HOPPER_NAMES:
    fn = attention_fn(name, HOPPER_PRECISION, causal)
    if name == "jax_mgpu":
      # attention_mgpu compiles FP16 only (docs/findings.md): it is timed
      # on FP16 copies of the inputs, the cast inside its program.
      fn = _in_fp16(fn)
    fns[name] = timed_fn(fn, mode)
  for name, form in hopper_forms(mode).items():
    fn = attention_fn("mosaic_gpu", HOPPER_PRECISION, causal, hopper_form=form)
    fns[name] = timed_fn(fn, mode)
  compiled = compile_all(fns, args)

  def labels_of(name):
    labels = _labels("hopper", mode, causal, HOPPER_PRECISION, s, seq_len)
    if name == "jax_mgpu":
      labels["inputs"] = "fp16 (cast from bf16 in its program)"
    return labels

  work = flops(s.batch, s.heads, seq_len, s.head_dim, causal, mode)
  rows = _timed_rows(compiled, args, labels_of, s, work)
  times = {r["implementation"]: r.get("median_ms") for r in rows}
  for row in rows:
    if times.get("cudnn") and "median_ms" in row:
      row["speed_vs_cudnn"] = times["cudnn"] / row["median_ms"]
  return rows
