"""Edge regimes: the inputs and shapes where attention kernels break.

The default audit draws benign inputs (standard normal, whole tiles, many
queries, equal lengths). Kernels break elsewhere: exp overflowing without
a running max (large logits), 0/0 where every score of a row underflows
(small logits) or no key is allowed (empty rows), the last partial tile,
a single query's backward, an example of length 0, an FP32 bias beside
half inputs. Each regime here builds a family of cases from an audit
shape; the audit judges them against the FP64 reference like any case,
and also checks that rows no key may attend are exactly 0 (Flax's and
FlashAttention's documented value) and that nothing is NaN or Inf.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import numpy as np

from stableattn.auditing import offsets, reported_regimes
from stableattn.auditing.edge_case import EdgeCase, at, normal
from stableattn.auditing.inputs import Shape, TiedMaximaSpec, make_inputs
from stableattn.auditing.invariance import our_attention
from stableattn.auditing.measure import (
  ContractError,
  error_row,
  first_line,
  measure_arrays,
)
from stableattn.contract import arguments
from stableattn.ops.dispatch import attention
from stableattn.ops.registry import unaccepted_features

REGIMES = (
  "large_logits",
  "small_logits",
  "outlier_channels",
  "tied_maxima",
  "empty_rows",
  "remainders",
  "single_query",
  "zero_length",
  "mixed_dtypes",
  "head_dims",
  "poisoned_padding",
  "finite_mask",
  "score_ramp",
  "empty_splits",
  "sink_extremes",
  "gqa_groups",
  "key_offset",
)
DESCRIPTIONS = {
  "large_logits": "scores of standard deviation 100 and 3,000: exp "
  "overflows in FP32 above 88.7 without a running max",
  "small_logits": "every score of a row near -120 (log-sum-exp below "
  "FP32's -88.7 and FP16's -11): exp underflows to 0 without a running max; "
  "also at a key length of 64 mod 128 with lengths, segments, a boolean "
  "and a -inf bias mask (PyTorch #196678)",
  "outlier_channels": "two Q and K channels 10x the rest (100x in their "
  "score terms), as trained LLMs have",
  "tied_maxima": "rows won by bit-identical keys (Qiu & Yao)",
  "empty_rows": "rows no key may attend: a zero key length, a query "
  "segment with no keys, bottom-right causal with more queries than keys; "
  "such rows must be exactly 0",
  "remainders": "lengths that are not whole tiles (1, 63, 65, 100, 127, "
  "129, 192), q_len != kv_len, with and without a causal mask",
  "single_query": "one query (decode) over every key, forward and backward",
  "zero_length": "an example of length 0 beside full ones in a batch",
  "mixed_dtypes": "an FP32 bias and an FP32 sink with half-precision inputs",
  "head_dims": "QK and V head dims that differ (MLA's 192/128; 576/512 "
  "of absorbed MLA decoding)",
  "poisoned_padding": "NaN, then +Inf, in K and V where no query may "
  "attend (past the lengths, a padded batch, a segment without queries, a "
  "decode cache's unused slots): the clean run's values, finite",
  "finite_mask": "masks as an additive bias of the format's minimum, -1e9 "
  "and FP16's minimum, with fully masked rows (reported against 0 and the "
  "mean of V) and fully masked 64- and 128-key tiles",
  "score_ramp": "scores rising along the keys (the row max grows by 0.5, 4 "
  "and 20 every 64 keys): every key block rescales",
  "empty_splits": "split-KV decoding with more splits than key blocks, "
  "splits past the length or in a segment without queries, and a "
  "sequence of length 0",
  "sink_extremes": "sink logits of -20, 0, 20 and 100, and d(sink) terms "
  "that cancel to 1e-3 of their size",
  "gqa_groups": "8, 16 and 64 query heads per KV head: dK and dV sum over "
  "the group",
  "key_offset": "keys alpha u + sigma eps sharing a component (alpha/sigma "
  "1-100), values with a shared offset, queries orthogonal to u or "
  "aligned to row logits of 300: a trained model's geometry, where "
  "delta from the rounded O enters dQ along u (Qiu & Yao, Eq. 1)",
}
SMALL_LOGITS_LEVEL = reported_regimes.SMALL_LOGITS_LEVEL


def parse(value) -> tuple[str, ...]:
  """`value` ("large_logits,remainders", a sequence, "all", "" or None)."""
  return arguments.chosen(value, "regimes", REGIMES)


def large_logits(shape, rng, inputs_format):
  out = []
  for std in (100.0, 3000.0):
    q, k, v = normal(rng, *at(shape))
    # q.k / sqrt(d) has standard deviation std when both are scaled by
    # sqrt(std).
    scale = np.sqrt(std)
    out.append(EdgeCase("large_logits", f"score std {std:g}", q * scale,
                        k * scale, v))  # fmt: skip
  return out


def outlier_channels(shape, rng, inputs_format):
  q, k, v = normal(rng, *at(shape))
  channels = rng.choice(shape.head_dim, size=2, replace=False)
  q[..., channels] *= 10.0
  k[..., channels] *= 10.0
  return [EdgeCase("outlier_channels", f"channels {sorted(channels)}", q, k, v)]


def tied_maxima(shape, rng, inputs_format):
  spec = TiedMaximaSpec(block_k=min(64, shape.kv_len))
  q, k, v = make_inputs("tied_maxima", int(rng.integers(1 << 30)), shape,
                        tied=spec)  # fmt: skip
  return [EdgeCase("tied_maxima", "2 tied keys in one tile", q, k, v)]


def empty_rows(shape, rng, inputs_format):
  b, t, s = 2, shape.q_len, shape.kv_len
  h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
  cases = []
  q, k, v = normal(rng, b, t, s, h, hkv, d)
  lengths = np.array([s, 0], np.int32)
  empty = np.zeros((b, t), bool)
  empty[1] = True
  cases.append(EdgeCase("empty_rows", "key length 0 in example 1", q, k, v,
                        {"key_value_seq_lengths": lengths}, empty))  # fmt: skip
  q_ids = np.zeros((b, t), np.int32)
  q_ids[:, t // 2 :] = 2  # a query segment no key belongs to
  kv_ids = np.where(np.arange(s) < s // 2, 0, 1)[None].repeat(b, 0)
  cases.append(EdgeCase("empty_rows", "a query segment with no keys", q, k,
                        v, {"segment_ids": (q_ids, kv_ids.astype(np.int32))},
                        q_ids == 2))  # fmt: skip
  short = max(1, s // 4)
  q, k, v = normal(rng, b, t, short, h, hkv, d)
  rows = np.arange(t) < t - short  # bottom-right: the first t - short see none
  cases.append(EdgeCase("empty_rows", f"bottom-right causal, {t} queries "
                        f"over {short} keys", q, k, v,
                        {"causal": True, "causal_alignment": "bottom_right"},
                        np.broadcast_to(rows, (b, t)).copy()))  # fmt: skip
  return cases


def remainders(shape, rng, inputs_format):
  h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
  cases = []
  for t, s, causal in ((1, 63, False), (65, 63, True), (100, 100, False),
                       (127, 129, True), (192, 192, True)):  # fmt: skip
    q, k, v = normal(rng, 16 if t == 1 else 1, t, s, h, hkv, d)
    features = {"causal": True} if causal else {}
    label = f"T{t} S{s}" + (" causal" if causal else "")
    cases.append(EdgeCase("remainders", label, q, k, v, features))
  return cases


def single_query(shape, rng, inputs_format):
  cases = []
  # A decode batch: one query per example, enough examples that a mean
  # error (FlexAttention's rule) rests on more than a few values.
  for s in (shape.kv_len, 100):
    q, k, v = normal(rng, *at(shape, batch=16, q_len=1, kv_len=s))
    cases.append(EdgeCase("single_query", f"T1 S{s}", q, k, v))
  return cases


def zero_length(shape, rng, inputs_format):
  t = s = shape.kv_len
  q, k, v = normal(rng, *at(shape, batch=3, q_len=t, kv_len=s))
  lengths = np.array([s, 0, s // 2], np.int32)
  empty = np.zeros((3, t), bool)
  empty[1] = True
  features = {"query_seq_lengths": lengths, "key_value_seq_lengths": lengths}
  return [EdgeCase("zero_length", "lengths [S, 0, S/2]", q, k, v, features,
                   empty)]  # fmt: skip


def mixed_dtypes(shape, rng, inputs_format):
  if inputs_format not in ("bf16", "fp16"):
    return [EdgeCase("mixed_dtypes", "-", not_applicable=(
      f"inputs are {inputs_format}, not a half format"))]  # fmt: skip
  b, t, s, h, hkv, d = at(shape)
  q, k, v = normal(rng, b, t, s, h, hkv, d)
  # Values a half format cannot hold: the kernel must not round them.
  bias = (rng.standard_normal((1, h, t, s)) * 1.001).astype(np.float32)
  sink = (1.0 + 1e-3 * rng.standard_normal(h)).astype(np.float32)
  return [
    EdgeCase("mixed_dtypes", "FP32 bias", q, k, v, {"bias": bias}),
    EdgeCase("mixed_dtypes", "FP32 sink", q, k, v, {"sink": sink}),
  ]


BUILDERS = {
  name: globals().get(name)
  or getattr(reported_regimes, name, None)
  or getattr(offsets, name)
  for name in REGIMES
}


def edge_cases(regime: str, shape: Shape, inputs_format: str, seed: int = 0):
  """The cases of one regime built from an audit shape (its heads and head
  dim; lengths and batch as the regime needs)."""
  rng = np.random.default_rng([seed, REGIMES.index(regime)])
  return BUILDERS[regime](shape, rng, inputs_format)


def _features_label(features: dict) -> str:
  return ",".join(features) or "none"


def with_split(fn, split: dict | None):
  """(fn run with the split-KV options `split`, or fn itself without
  them; why it cannot, or None). Our Pallas kernel takes them through its
  Options; another kernel through keywords of those names."""
  if not split:
    return fn, None
  ours = our_attention(fn)
  if ours is not None and ours.get("implementation") == "pallas":
    options = ours["options"].replace(
      **{"num_splits": None, "split_size": None, **split}
    )
    return functools.partial(attention, **{**ours, "options": options}), None
  if ours is None and not unaccepted_features(fn, split) and _names(fn, split):
    return functools.partial(fn, **split), None
  return fn, (
    f"the kernel takes no split-KV option {sorted(split)} (stableattn's "
    "Options.num_splits and split_size, or keywords of those names)"
  )


def _names(fn, split) -> bool:
  """Whether fn's signature names every key of `split` (not **kwargs)."""
  try:
    return set(split) <= set(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return False


def measure_regime(
  fn, policy, shape: Shape, regime: str, repeats: int, tensors, rules
) -> tuple[list[dict], list[dict], list[dict]]:
  """(rows, notes, errors) of one regime at one audit shape: a row per
  tensor per case, judged like any audit row; a note per case that does
  not apply (the regime's reason, a feature the kernel does not take, or
  its ValueError or NotImplementedError refusing the case); an error per
  case it raised on otherwise (the error's type and first line)."""
  return measure_cases(
    fn, policy, edge_cases(regime, shape, policy.inputs), repeats, tensors,
    rules,
  )  # fmt: skip


def measure_cases(
  fn, policy, edge_cases_, repeats: int, tensors, rules
) -> tuple[list[dict], list[dict], list[dict]]:
  """(rows, notes, errors) of `EdgeCase`s, each under its own regime name
  (a constructed regime's, or "captured" for a model's own tensors)."""
  rows, notes, errors = [], [], []
  for case in edge_cases_:
    regime = case.regime
    note = {"regime": regime, "detail": case.detail, "policy": policy.name}
    case_fn, why = with_split(fn, case.split)
    if case.not_applicable is None and why:
      case = dataclasses.replace(case, not_applicable=why)
    if case.not_applicable is None:
      missing = unaccepted_features(fn, case.features)
      if missing:
        case = dataclasses.replace(
          case, not_applicable=f"the kernel does not take {missing}"
        )
    if case.not_applicable is not None:
      notes.append({**note, "reason": case.not_applicable})
      continue
    label = {
      "shape": case.shape.label,
      "distribution": "edge",
      "seed": 0,
      "features": _features_label(case.features),
      "regime": regime,
      "detail": case.detail,
    }
    try:
      rows += measure_arrays(
        case_fn,
        policy,
        label,
        (case.q, case.k, case.v),
        case.features,
        repeats,
        tensors,
        rules,
        case.checks,
      )
    except ContractError as e:  # e.g. an output of the wrong shape here
      errors.append(error_row(label, policy, e))
    except (ValueError, NotImplementedError) as e:  # a refusal says why
      notes.append({**note, "reason": f"refused with {first_line(e)}"})
    except Exception as e:  # noqa: BLE001 - the kernel broke: a row, go on
      errors.append(error_row(label, policy, e))
  return rows, notes, errors
