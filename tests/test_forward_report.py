"""The forward report, on synthetic rows: the summary averages whatever
values a study measures, and each section's findings follow its rows."""

import pytest

from configs import forward_deviation as forward_config
from stableattn.experiments import forward
from stableattn.experiments.forward import STUDIES
from stableattn.experiments.forward.study import ReportContext


def _measured(study, point_key, seed, labels, values):
  return {
    "study": study,
    "point_key": point_key,
    "seed": seed,
    "rows_in_group": 1,
    "labels": labels,
    "values": values,
  }


def test_summary_averages_every_value_without_a_list_of_names():
  rows = [
    _measured("s", "s:1", 0, {"comparison": "a"}, {"max_abs": 1.0}),
    # A value no other row has (a metric added later) joins the same group.
    _measured("s", "s:1", 1, {"comparison": "a"}, {"max_abs": 3.0, "new": 5}),
    _measured("s", "s:1", 0, {"comparison": "b"}, {"max_abs": 7.0}),
  ]
  summary = {r["comparison"]: r for r in forward.summarize(rows)}
  assert set(summary) == {"a", "b"}
  assert summary["a"]["n_seeds"] == 2
  assert summary["a"]["max_abs_mean"] == 2.0
  assert (summary["a"]["max_abs_min"], summary["a"]["max_abs_max"]) == (1, 3)
  assert summary["a"]["new_mean"] == 5.0  # over the rows that have it
  assert summary["b"]["max_abs_mean"] == 7.0


def test_a_label_among_the_values_is_refused():
  rows = [_measured("s", "s:1", 0, {"comparison": "a"}, {"policy": "bf16"})]
  with pytest.raises(ValueError, match="'policy' .* not a number"):
    forward.summarize(rows)


def _context(tmp_path, study, rows, claims=None):
  settings = forward.settings_from_config(forward_config.get_config("smoke"))
  return ReportContext(
    rows=rows,
    common=settings.common,
    config=settings.configs[study],
    out_dir=tmp_path,
    headline={},
    claims=claims or {},
  )


def _seq_row(dist, seq_len, max_abs, rel_l2):
  return {
    "study": "seq_len",
    "point_key": f"seq_len:{dist}{seq_len}",
    "comparison": "flash_vs_baseline",
    "policy": "bf16",
    "distribution": dist,
    "seq_len": seq_len,
    "n_rescales": seq_len // 16 - 1,
    **{
      f"max_abs_{k}": v
      for k, v in {"mean": max_abs, "min": max_abs, "max": max_abs}.items()
    },
    "mean_abs_mean": max_abs / 10,
    "std_abs_mean": max_abs / 20,
    "rel_l2_mean": rel_l2,
  }


def test_seq_len_section_reads_growth_and_shrinkage_off_the_rows(tmp_path):
  rows = [
    # Uniform inputs: the deviation grows 4x over 4x the rescales.
    _seq_row("uniform", 32, 1e-3, 1e-3),
    _seq_row("uniform", 80, 4e-3, 4e-3),
    # Normal inputs: it shrinks while the relative difference grows.
    _seq_row("normal", 32, 4e-3, 1e-3),
    _seq_row("normal", 80, 1e-3, 4e-3),
  ]
  ctx = _context(tmp_path, "seq_len", rows)
  section = STUDIES["seq_len"].report(ctx)
  uniform, normal = (
    next(f for f in section.findings if f.startswith(f"bf16, {d}"))
    for d in ("uniform", "normal")
  )
  assert "(rescales)^1.00" in uniform and "grows with length" in uniform
  assert "(rescales)^-1.00" in normal and "shrinks with length" in normal
  assert "relative difference grows" in normal
  assert ctx.headline["seq_len_slope_bf16_uniform"] == pytest.approx(1.0)
  assert (tmp_path / "seq_len.png").exists()


def _golden_row(fmt, reading, dist, seq_len, ratio, error):
  return {
    "study": "against_golden",
    "point_key": f"g:{fmt}{reading}{dist}{seq_len}",
    "comparison": "flash_vs_golden",
    "format": fmt,
    "flash_policy": reading[0],
    "baseline_policy": reading[1],
    "scheme": "fa2",
    "distribution": dist,
    "seq_len": seq_len,
    "max_abs_mean": error,
    "ratio_max_abs_mean": ratio,
    "ratio_max_abs_min": ratio,
    "ratio_max_abs_max": ratio,
    "ratio_rmse_mean": ratio,
  }


def test_against_golden_section_names_the_largest_ratio_and_reading(
  tmp_path,
):
  same, natural = ("bf16", "bf16"), ("bf16-fa2", "bf16-framework")
  rows = [
    _golden_row("bf16", same, "normal", 64, 2.0, 1e-2),
    _golden_row("bf16", same, "normal", 32, 1.5, 1e-2),
    _golden_row("bf16", natural, "normal", 64, 0.5, 1e-3),
    _golden_row("bf16", natural, "normal", 32, 0.4, 1e-3),
    _golden_row("fp32", ("fp32", "fp32"), "normal", 64, 1.1, 1e-7),
  ]
  ctx = _context(tmp_path, "against_golden", rows)
  section = STUDIES["against_golden"].report(ctx)
  largest = next(f for f in section.findings if f.startswith("Largest"))
  assert largest.startswith("Largest Flash/Baseline ratio: 2x (bf16, Flash")
  assert "length 64" in largest
  assert ctx.headline["bf16_all_stage_ratio"] == 2.0
  assert ctx.headline["bf16_natural_ratio"] == 0.5
  # Two lengths at BF16: the over-length table and the heatmap.
  assert "over length" in section.body
  assert section.plots == ["against_golden.png", "reconcile.png"]


def test_tiles_section_reads_the_swap_and_the_area_slope(tmp_path):
  def tile(variant, block_q, block_k, value, fmt="bf16"):
    return {
      "study": "tiles",
      "point_key": f"t:{variant}{block_q}x{block_k}",
      "comparison": "flash_vs_baseline",
      "variant": variant,
      "format": fmt,
      "block_q": block_q,
      "block_k": block_k,
      "block_area": block_q * block_k,
      "max_abs_mean": value,
      "max_abs_min": value,
      "max_abs_max": value,
    }

  rows = [
    tile("area", 16, 16, 4e-3),
    tile("area", 32, 32, 1e-3),
    tile("swap", 16, 32, 1e-3),
    tile("swap", 32, 16, 3e-3),
  ]
  ctx = _context(tmp_path, "tiles", rows)
  section = STUDIES["tiles"].report(ctx)
  area = next(f for f in section.findings if f.startswith("bf16:"))
  assert "slope -1.00" in area and "smaller deviation" in area
  swap = next(f for f in section.findings if f.startswith("Swapping"))
  assert "(ratio 3)" in swap
  assert ctx.headline["tile_area_slope_bf16"] == pytest.approx(-1.0)


def test_a_study_without_rows_writes_no_section(tmp_path):
  for name in STUDIES:
    assert STUDIES[name].report(_context(tmp_path, name, [])) is None, name
