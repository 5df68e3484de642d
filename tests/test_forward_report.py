"""The forward report, on synthetic rows: the summary averages whatever
values a study measures, and each section's findings follow its rows."""

import pytest

from stableattn.configs import forward_deviation as forward_config
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
  config = forward_config.get_config("smoke")
  config.studies = ",".join(STUDIES)  # every study's section, at smoke sizes
  settings = forward.settings_from_config(config)
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


def _summary(point_key, comparison, values, **labels):
  """A summary row: labels plus each value's mean/min/max over seeds."""
  row = {"point_key": point_key, "comparison": comparison, **labels}
  for name, value in values.items():
    row.update({f"{name}_{s}": value for s in ("mean", "min", "max")})
  return row


def test_format_sweep_reads_the_trend_in_mantissa_bits(tmp_path):
  rows = []
  for fmt, dev in (("bf16", 1e-2), ("fp16", 1e-3), ("fp32", 1e-7)):
    key = f"format_sweep:{fmt}"
    labels = dict(family="fa2", format=fmt, policy=fmt)
    rows += [
      _summary(
        key,
        "flash_vs_baseline",
        {"max_abs": dev, "mean_abs": dev / 9},
        **labels,
      ),
      _summary(key, "flash_vs_golden", {"max_abs": dev}, **labels),
      _summary(key, "baseline_vs_golden", {"max_abs": dev / 2}, **labels),
    ]
  ctx = _context(tmp_path, "format_sweep", rows)
  section = STUDIES["format_sweep"].report(ctx)
  (finding,) = section.findings
  assert "bf16 0.01, fp16 1.00e-03, fp32 1.00e-07" in finding
  assert "falls with every added mantissa bit" in finding
  assert ctx.headline["format_sweep_fa2_monotone"] is True
  rows[3]["max_abs_mean"] = 1.0  # fp16 above bf16: no longer monotone
  ctx = _context(tmp_path, "format_sweep", rows)
  (finding,) = STUDIES["format_sweep"].report(ctx).findings
  assert "not monotone" in finding
  assert not ctx.headline["format_sweep_fa2_monotone"]


def test_fa3_table3_section_compares_the_direction(tmp_path):
  shape = dict(batch=1, seq_len=64, heads=1, head_dim=32)
  rows = [
    _summary("fa3", "flash_vs_golden", {"rmse": 1e-4}, **shape),
    _summary("fa3", "baseline_vs_golden", {"rmse": 3e-4}, **shape),
  ]
  ctx = _context(tmp_path, "fa3_table3", rows)
  (finding,) = STUDIES["fa3_table3"].report(ctx).findings
  assert ctx.headline["fa3_rmse_ratio"] == pytest.approx(3.0)
  assert "Flash is 3x more accurate" in finding and "agrees" in finding
  rows[1]["rmse_mean"] = 5e-5
  ctx = _context(tmp_path, "fa3_table3", rows)
  (finding,) = STUDIES["fa3_table3"].report(ctx).findings
  assert "disagrees" in finding


def test_backward_section_names_the_worst_gradient(tmp_path):
  rows = []
  for grad, ratio in (("dq", 1.0), ("dk", 2.5), ("dv", 1.2)):
    labels = dict(policy="bf16-fa2", seq_len=48, grad=grad)
    key = f"backward:{grad}"
    rows += [
      _summary(
        key,
        "flash_vs_golden",
        {"max_abs": 1e-3 * ratio, "ratio_max_abs": ratio, "ratio_rmse": ratio},
        **labels,
      ),
      _summary(key, "baseline_vs_golden", {"max_abs": 1e-3}, **labels),
    ]
  ctx = _context(tmp_path, "backward", rows)
  (finding,) = STUDIES["backward"].report(ctx).findings
  assert "median 1.2, worst 2.5 (dk at length 48)" in finding
  assert ctx.headline["backward_worst_ratio_bf16-fa2"] == 2.5


def test_stage_attribution_splits_the_gap_between_policies(tmp_path):
  from stableattn.experiments.forward.stage_attribution import (
    attribution_variants,
  )

  # Rounding the output accumulator alone closes 60% of the gap between
  # bf16-fa2 (error 1) and all-bf16 (error 11); the other stages 20% each.
  errors = {"fa2 preset": 1.0, "all bf16": 11.0}
  for stage, share in (
    ("scores", 0.2),
    ("softmax_stats", 0.2),
    ("out_accum", 0.6),
  ):
    errors[f"only {stage}"] = 1.0 + 10 * share
    errors[f"all but {stage}"] = 11.0 - 10 * share
  assert set(errors) == set(attribution_variants("bf16"))
  rows = []
  for variant, error in errors.items():
    labels = dict(
      format="bf16", scheme="fa2", distribution="normal", variant=variant
    )
    key = f"attr:{variant}"
    rows += [
      _summary(
        key,
        "flash_vs_golden",
        {"max_abs": error, "ratio_max_abs": error},
        **labels,
      ),
      _summary(key, "baseline_vs_golden", {"max_abs": 1.0}, **labels),
    ]
  ctx = _context(tmp_path, "stage_attribution", rows)
  (finding,) = STUDIES["stage_attribution"].report(ctx).findings
  assert "rounding `out_accum` explains 60%" in finding
  assert ctx.headline["attribution_top_stage_bf16"] == "out_accum"


def _tied(
  policy, beta, implementation, quantity, share, *, headline=True, **at
):
  condition = dict(
    ties=2, placement="same_tile", values="one_sign", margin=1e-4
  )
  return {
    "point_key": f"tied:{policy}{beta}{implementation}{quantity}{at}",
    "comparison": "vs_golden",
    "policy": policy,
    "tie_beta": beta,
    "implementation": implementation,
    "quantity": quantity,
    "headline": headline,
    **{**condition, **at},
    "signed_share_mean": share,
  }


def test_tied_maxima_section_separates_the_bias_the_fix_removes(tmp_path):
  policy = "bf16-fa2+out_accum=bf16"  # the smoke config's policy, beta 2
  rows = [
    # Headline condition: biased, and the fix removes it.
    _tied(policy, None, "flash", "O", 0.99),
    _tied(policy, 2.0, "flash", "O", 0.02),
    _tied(policy, None, "flash", "delta(dO positive)", 0.97),
    _tied(policy, None, "flash", "delta(dO random)", 0.05),
    _tied(policy, None, "baseline", "O", 0.9),
    # One key winning: biased, and the fix (which needs ties) cannot act.
    _tied(policy, None, "flash", "O", 0.8, headline=False, ties=1),
    _tied(policy, 2.0, "flash", "O", 0.8, headline=False, ties=1),
  ]
  ctx = _context(tmp_path, "tied_maxima", rows)
  section = STUDIES["tied_maxima"].report(ctx)
  flash, baseline, delta = section.findings
  assert "biased away from zero (share >= 0.5) in 2 of 2 conditions" in flash
  assert "brings 1 of them to |share| <= 0.1" in flash
  assert "1 stay biased with one key" in flash
  assert "Baseline under" in baseline and "+0.90 (no fix)" in baseline
  assert "+0.97 for a one-sign dO and +0.05" in delta
  assert ctx.headline[f"tied_share_{policy}_no fix"] == 0.99
  assert ctx.headline[f"tied_share_{policy}_beta=2"] == 0.02


def test_feature_verdicts_are_computed_from_rows():
  from stableattn.experiments.forward.features_study import feature_verdicts

  def flash_row(setting, pairing, ratio):
    return {
      "comparison": "flash_vs_golden",
      "setting": setting,
      "pairing": pairing,
      "distribution": "normal",
      "ratio_rmse_mean": ratio,
    }

  rows = [
    flash_row("plain", "natural", 0.5),
    flash_row("softcap_30", "natural", 0.6),  # 1.2x: within 1.5x
    flash_row("plain", "all_stage", 1.0),
    flash_row("softcap_30", "all_stage", 2.0),  # 2x: outside
    flash_row("causal", "natural", 0.5),
    flash_row("window_64", "natural", 0.55),
  ]
  verdicts = feature_verdicts(rows)
  assert verdicts["softcap_30"]["verdict"] == "holds in part"
  assert verdicts["window_64"]["verdict"] == "holds"
  assert [c["change"] for c in verdicts["softcap_30"]["changes"]] == [1.2, 2.0]
  with pytest.raises(ValueError, match="no rows for 'kv_cache'"):
    feature_verdicts([flash_row("kv_cache", "natural", 1.0)])
