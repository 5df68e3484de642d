"""Paper claims read from synthetic summary rows: each verdict follows the
rows, and no verdict comes from no rows."""

import pytest

from stableattn.experiments.forward.against_golden import fig4
from stableattn.experiments.forward.format_sweep import fig3
from stableattn.experiments.forward.registry import CLAIMS
from stableattn.experiments.forward.seq_len import fig5
from stableattn.experiments.forward.tiles import fig6a, fig6b, fig6c


def _golden_row(ratio, seq_len, dist="uniform", reading=("bf16", "bf16")):
  return {
    "study": "against_golden",
    "comparison": "flash_vs_golden",
    "format": "bf16",
    "flash_policy": reading[0],
    "baseline_policy": reading[1],
    "scheme": "fa1",
    "distribution": dist,
    "seq_len": seq_len,
    "ratio_max_abs_mean": ratio,
  }


def test_fig4_maps_where_the_ratio_is_reached():
  rows = [
    _golden_row(5.0, 512),
    _golden_row(9.0, 2048),
    _golden_row(12.0, 4096),
    _golden_row(1.5, 512, "normal"),
    _golden_row(2.0, 4096, "normal"),
  ]
  result = fig4(rows)
  assert result["verdict"] == "reproduced in part"
  assert result["largest_ratio"] == 12.0
  assert result["largest_at"]["seq_len"] == 4096
  regions = {g["distribution"]: g for g in result["regions"]}
  assert regions["uniform"]["from_length"] == 2048
  assert regions["normal"]["from_length"] is None
  assert fig4([_golden_row(1.0, 512)])["verdict"] == "not reproduced"
  assert fig4([_golden_row(11.0, 512)])["verdict"] == "reproduced"


def test_fig4_region_needs_every_longer_length():
  rows = [_golden_row(9.0, 512), _golden_row(3.0, 2048), _golden_row(9.0, 4096)]
  (region,) = fig4(rows)["regions"]
  assert region["from_length"] == 4096


def _seq_row(policy, dist, seq_len, value):
  return {
    "study": "seq_len",
    "comparison": "flash_vs_baseline",
    "policy": policy,
    "distribution": dist,
    "seq_len": seq_len,
    "max_abs_mean": value,
  }


def test_fig5_says_for_which_inputs_deviation_grows():
  rows = [
    _seq_row("bf16", "uniform", 256, 1e-3),
    _seq_row("bf16", "uniform", 4096, 4e-3),
    _seq_row("bf16", "normal", 256, 4e-3),
    _seq_row("bf16", "normal", 4096, 2e-3),
  ]
  result = fig5(rows)
  assert result["verdict"] == "reproduced in part"
  grows = {g["distribution"]: g["grows"] for g in result["series"]}
  assert grows == {"uniform": True, "normal": False}


def _sweep_row(family, fmt, value):
  return {
    "study": "format_sweep",
    "comparison": "flash_vs_baseline",
    "family": family,
    "format": fmt,
    "max_abs_mean": value,
  }


def test_fig3_and_tile_claims():
  rows = [
    _sweep_row("all-stage", "fp32", 1e-7),
    _sweep_row("all-stage", "bf16", 1e-2),
    _sweep_row("fa2", "bf16", 1e-3),  # one format: not testable alone
  ]
  assert fig3(rows) == {
    "verdict": "reproduced",
    "holds_for": ["all-stage"],
    "fails_for": [],
  }
  tiles = [
    {"variant": "swap", "block_q": 32, "block_k": 128, "max_abs_mean": 2.0},
    {"variant": "swap", "block_q": 128, "block_k": 32, "max_abs_mean": 3.0},
    {
      "variant": "equal_area",
      "block_q": 64,
      "block_k": 64,
      "max_abs_mean": 2.0,
    },
    {
      "variant": "equal_area",
      "block_q": 32,
      "block_k": 128,
      "max_abs_mean": 1.0,
    },
    {
      "variant": "area",
      "format": "bf16",
      "block_area": 256,
      "max_abs_mean": 4.0,
    },
    {
      "variant": "area",
      "format": "bf16",
      "block_area": 4096,
      "max_abs_mean": 1.0,
    },
  ]
  tiles = [
    {"study": "tiles", "comparison": "flash_vs_baseline", **t} for t in tiles
  ]
  assert fig6a(tiles)["ratio"] == pytest.approx(1.5)
  assert fig6a(tiles)["verdict"] == "reproduced"
  assert fig6b(tiles)["verdict"] == "not reproduced"  # 2x apart
  assert fig6c(tiles)["verdict"] == "reproduced"


def test_every_paper_claim_has_one_study():
  assert sorted(CLAIMS) == [
    "cp_bits_not_accuracy",
    "cp_fa_rule",
    "cp_te_tolerance",
    "fig3",
    "fig4",
    "fig5",
    "fig6a",
    "fig6b",
    "fig6c",
    "inference_fixed_split",
    "inference_fp32_partials",
    "inference_heuristic_split",
    "inference_split_error",
    "lc_cause",
    "lc_grows",
    "lc_interval",
    "lc_needle",
    "lc_restored",
  ]


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_no_verdict_from_no_rows(name):
  with pytest.raises(ValueError, match="no rows|verdict"):
    CLAIMS[name].compute([])


def _inference_row(axis, value, bitwise, diff, error, reference, **labels):
  return {
    "study": "inference",
    "policy": labels.pop("policy", "bf16-fa2"),
    "partials": labels.pop("partials", "fp32"),
    "axis": axis,
    "value": value,
    "bitwise_min": bitwise,
    "diff_ulps_max": diff,
    "error_ulps_max": error,
    "reference_error_ulps_max": reference,
    "error_ratio_max": error / reference,
    **labels,
  }


def test_inference_claims_follow_from_rows():
  rows = [
    _inference_row("batch", 64, 1.0, 0, 0.5, 0.5, schedule="split_size"),
    _inference_row("batch", 16, 1.0, 0, 0.5, 0.5, schedule="split_size"),
    _inference_row(
      "batch", 64, 0.0, 0.5, 0.5, 0.5, schedule="num_splits_by_batch"
    ),
    _inference_row("num_splits", 4, 0.0, 0.25, 0.5, 0.5),
    _inference_row("num_splits", 4, 0.0, 1.0, 1.5, 0.5, partials="input"),
  ]
  fixed = CLAIMS["inference_fixed_split"].compute(rows)
  assert fixed["verdict"] == "reproduced" and fixed["bitwise"] == 2
  assert CLAIMS["inference_heuristic_split"].compute(rows)["verdict"] == (
    "reproduced"
  )
  error = CLAIMS["inference_split_error"].compute(rows)
  assert error["ratio"] == {"bf16-fa2": pytest.approx(0.5)}
  assert error["verdict"] == "reproduced"
  harmless = CLAIMS["inference_fp32_partials"].compute(rows)
  assert harmless["verdict"] == "reproduced"
  assert harmless["worst_error_ratio"]["bf16-fa2 (input)"] == pytest.approx(3)
  # One row that changes bits under a fixed split size breaks the claim;
  # a split change above the FP64 error breaks the other.
  rows[1] = {**rows[1], "bitwise_min": 0.0}
  assert CLAIMS["inference_fixed_split"].compute(rows)["verdict"] == (
    "reproduced in part"
  )
  rows[3] = {**rows[3], "diff_ulps_max": 0.75, "error_ratio_max": 2.0}
  assert CLAIMS["inference_split_error"].compute(rows)["verdict"] == (
    "not reproduced"
  )
  assert CLAIMS["inference_fp32_partials"].compute(rows)["verdict"] == (
    "not reproduced"
  )


def _ring_row(tensor, *, fa=1.0, te=0.1, ulps=0.5, to_single=1.0, **labels):
  return {
    "study": "context_parallel",
    "policy": labels.pop("policy", "bf16-fa2"),
    "layout": "causal_balanced",
    "devices": 4,
    "variation": labels.pop("variation", "none"),
    "tensor": tensor,
    "fa_rule_min": fa,
    "ratio_to_baseline_max": 1.1,
    "te_share_max": te,
    "diff_ulps_max": ulps,
    "ratio_to_single_max": to_single,
    "bitwise_min": 0.0 if ulps else 1.0,
  }


def test_context_parallel_claims_follow_from_rows():
  rows = [
    _ring_row("out"),
    _ring_row("dq", ulps=0.0),
    _ring_row("out", variation="input_partials", to_single=3.0),
  ]
  assert CLAIMS["cp_fa_rule"].compute(rows)["verdict"] == "reproduced"
  te = CLAIMS["cp_te_tolerance"].compute(rows)
  assert te["verdict"] == "reproduced" and te["largest_share"] == 0.1
  same = CLAIMS["cp_bits_not_accuracy"].compute(rows)
  # Partials in the input format are left out of "bits, not accuracy".
  assert same["verdict"] == "reproduced" and same["changed_bits"] == 1
  rows.append(_ring_row("dk", fa=0.0, te=1.5))
  assert CLAIMS["cp_fa_rule"].compute(rows)["verdict"] == "reproduced in part"
  assert CLAIMS["cp_te_tolerance"].compute(rows)["verdict"] == (
    "reproduced in part"
  )
  rows[0] = {**rows[0], "ratio_to_single_max": 2.0}
  assert CLAIMS["cp_bits_not_accuracy"].compute(rows)["verdict"] == (
    "not reproduced"
  )
