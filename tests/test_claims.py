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
  assert sorted(CLAIMS) == ["fig3", "fig4", "fig5", "fig6a", "fig6b", "fig6c"]


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_no_verdict_from_no_rows(name):
  with pytest.raises(ValueError, match="no rows|verdict"):
    CLAIMS[name].compute([])
