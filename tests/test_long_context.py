"""The long_context study: its inputs, its measures and its verdicts."""

import dataclasses

import numpy as np
import pytest

from stableattn.contract.golden import golden_attention
from stableattn.experiments.forward import long_context as lc
from stableattn.experiments.forward import long_context_report as report

CONFIG = lc.Config(
  lengths=(256,),
  policies=("fp8 per-tensor",),
  distributions=("needle",),
  query_rows=4,
  batch=2,
  head_dim=32,
  block_k=32,
  seeds=1,
)


def test_needles_lead_their_distractors_in_fp64():
  q, k, v, axes = lc.make_inputs("needle", 0, CONFIG, 4096)
  gold = np.asarray(golden_attention(q, k, v))
  values = lc._values(gold, gold, axes)
  assert values["retrieved"] == values["retrieved_fp64"] == 1.0


def test_a_flipped_row_counts_as_lost():
  q, k, v, axes = lc.make_inputs("needle", 1, CONFIG, 512)
  gold = np.asarray(golden_attention(q, k, v))
  out = gold.copy()
  target, distractor = axes[0, 0]
  out[0, 0, 0, [target, distractor]] = out[0, 0, 0, [distractor, target]]
  values = lc._values(out, gold, axes)
  assert values["retrieved"] == pytest.approx(1 - 1 / 8)
  assert values["rel_error"] > 0


@pytest.mark.slow
def test_the_narrow_accumulator_costs_at_long_context():
  """One level at 64K keys: 2048 truncating adds move the output beyond
  the FP8 operands' own error; two levels do not; nearest rounding does
  not either."""
  config = dataclasses.replace(
    CONFIG,
    distributions=("normal",),
    policies=(report.CONTROL, report.ONE_LEVEL, "two-level n=1",
              "fp8 one-level (nearest)"),
    block_k=128,
  )  # fmt: skip
  point = {"length": 65536, "distribution": "normal"}
  rows = lc.STUDY.measure(None, None, config, point, 0)
  error = {r["labels"]["comparison"]: r["values"]["rel_error"] for r in rows}
  assert error[report.ONE_LEVEL] > 1.2 * error[report.CONTROL]
  assert error["two-level n=1"] < 1.02 * error[report.CONTROL]
  assert error["fp8 one-level (nearest)"] < 1.05 * error[report.CONTROL]


def _summary(one_level, two_level, control, lengths=(1024, 4096, 16384)):
  rows = []
  for i, n in enumerate(lengths):
    for dist in report.ERROR_INPUTS:
      for label, errors in (
        (report.ONE_LEVEL, one_level),
        (report.CONTROL, control),
        *((name, two_level) for name in report.TWO_LEVEL),
      ):
        rows.append({"study": "long_context", "comparison": label,
                     "length": n, "distribution": dist,
                     "rel_error_mean": errors[i]})  # fmt: skip
  return rows


def test_verdicts_follow_the_rows():
  grows = _summary([0.05, 0.08, 0.12], [0.05, 0.05, 0.05], [0.05] * 3)
  assert report.grows(grows)["verdict"] == "reproduced"
  assert report.cause(grows)["verdict"] == "reproduced"
  assert report.restored(grows)["verdict"] == "reproduced"
  assert report.trade_off(grows)["verdict"] == "reproduced"
  flat = _summary([0.05] * 3, [0.06, 0.07, 0.08], [0.05] * 3)
  assert report.grows(flat)["verdict"] == "not reproduced"
  # Both grow alike: the growth is the operands', not the accumulator's.
  alike = _summary([0.05, 0.08, 0.12], [0.05] * 3, [0.05, 0.08, 0.12])
  assert report.grows(alike)["verdict"] == "reproduced"
  assert report.cause(alike)["verdict"] == "not reproduced"
  assert report.restored(flat)["verdict"] == "not reproduced"
  assert report.trade_off(flat)["verdict"] == "not reproduced"
  with pytest.raises(ValueError, match="at least 3"):
    report.grows(_summary([0.1] * 2, [0.1] * 2, [0.1] * 2, lengths=(1, 2)))


def test_unknown_policy_label_is_refused_with_the_valid_ones():
  with pytest.raises(ValueError, match="valid:.*two-level n=1"):
    lc._labels("fp8 one level", "long_context.policies")
