"""The forward-deviation experiment, end to end on its :smoke config."""

import csv
import json
import pathlib
import subprocess
import sys

import pytest
from helpers import run_once

from stableattn.configs import forward_deviation as forward_config
from stableattn.experiments import forward
from stableattn.experiments.forward import STUDIES
from stableattn.harness import environment
from stableattn.numerics.metrics import Deviation

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  config = forward_config.get_config("smoke")
  workdir, result = run_once(
    tmp_path_factory, "forward_smoke", lambda d: forward.run(config, d)
  )
  return workdir, result, config


def _rows(workdir):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


def _selected(config):
  return {name: STUDIES[name] for name in config.studies.split(",")}


@pytest.mark.slow  # the smoke experiment end to end
def test_writes_every_file(smoke_run):
  workdir, result, config = smoke_run
  for name in ("config.json", "metrics.jsonl", "summary.csv", "report.md"):
    assert (workdir / name).stat().st_size > 0, name
  for study in _selected(config):
    png = workdir / f"{study}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", study
  report = (workdir / "report.md").read_text()
  for study in _selected(config).values():
    assert study.title in report
  assert report.count("**Finding.**") >= len(_selected(config))
  assert result["points_measured"] > 0 and result["points_skipped"] == 0
  stored = json.loads((workdir / "config.json").read_text())
  assert stored["common"]["seeds"] == 2


@pytest.mark.slow  # the smoke experiment end to end
def test_rows_keep_labels_and_values_apart(smoke_run):
  workdir, _, config = smoke_run
  rows = _rows(workdir)
  numeric = {
    name
    for name, f in Deviation.__dataclass_fields__.items()
    if name not in ("argmax", "ulp_format")
  }
  for row in rows:
    assert {"study", "point_key", "seed", "labels", "values"} <= row.keys()
    assert "comparison" in row["labels"]
    assert numeric <= row["values"].keys()
    assert not numeric & row["labels"].keys()
    assert all(isinstance(v, (int, float)) for v in row["values"].values())
  assert {r["study"] for r in rows} == set(_selected(config))
  with open(workdir / "summary.csv") as f:
    summary = list(csv.DictReader(f))
  assert summary and "max_abs_mean" in summary[0]
  settings = forward.settings_from_config(config)
  for r in summary:
    study = STUDIES[r["study"]]
    seeds = study.seeds(settings.common, settings.configs[r["study"]])
    assert int(r["n_seeds"]) == seeds


@pytest.mark.slow  # the smoke experiment end to end
def test_tied_study_shows_the_bias_and_its_removal_first(smoke_run):
  workdir, result, config = smoke_run
  regime = config.tied_maxima.precisions
  assert result[f"tied_share_{regime}_no fix"] >= 0.9
  assert abs(result[f"tied_share_{regime}_beta=2"]) <= 0.1
  section = (workdir / "report.md").read_text().split("(Qiu & Yao)", 1)[1]
  first_table = section.split("| policy | fix | Flash O |", 1)[1]
  no_fix, fixed = first_table.splitlines()[2:4]
  assert "no fix" in no_fix and "beta=2" in fixed
  assert float(no_fix.split("|")[3]) >= 0.9
  assert abs(float(fixed.split("|")[3])) <= 0.1


@pytest.mark.slow  # the smoke experiment end to end
def test_headline_claims_follow_from_the_measured_rows(smoke_run):
  workdir, result, _ = smoke_run
  headline = json.loads((workdir / "headline.json").read_text())
  env = headline["environment"]
  assert env["jax"] and env["python"] and env["backend"] == "cpu"
  assert environment.summary_line(env) in (workdir / "report.md").read_text()
  assert set(headline["claims"]) == {
    "fig3",
    "fig4",
    "fig5",
    "fig6a",
    "fig6b",
    "fig6c",
    "inference_fixed_split",
    "inference_heuristic_split",
    "inference_split_error",
    "inference_fp32_partials",
    "lc_cause",
    "lc_grows",
    "lc_interval",
    "lc_needle",
    "lc_restored",
  }
  assert headline["claims"] == json.loads(json.dumps(result["claims"]))
  fig4 = headline["claims"]["fig4"]
  # Recompute Fig. 4 from metrics.jsonl: mean ratio per setting over seeds.
  ratios = {}
  for r in _rows(workdir):
    labels = r["labels"]
    if (
      r["study"] == "against_golden"
      and labels["comparison"] == "flash_vs_golden"
      and labels["format"] == "bf16"
    ):
      ratios.setdefault(r["point_key"], []).append(r["values"]["ratio_max_abs"])
  means = [sum(v) / len(v) for v in ratios.values()]
  assert fig4["settings"] == len(means)
  assert fig4["largest_ratio"] == pytest.approx(max(means))
  reaching = sum(m >= fig4["threshold"] for m in means)
  assert fig4["settings_reaching"] == reaching
  expected = (
    "reproduced"
    if reaching == len(means)
    else "reproduced in part"
    if reaching
    else "not reproduced"
  )
  assert fig4["verdict"] == expected
  first_screen = (workdir / "report.md").read_text().split("\n## ", 2)[1]
  assert first_screen.startswith("The paper's claims, mapped")
  assert f"**{fig4['verdict']}**" in first_screen


def _rounded(x):
  """A JSON structure with floats to 10 significant digits (the sums over
  seeds may differ in the last bit)."""
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_rounded(v) for v in x]
  if isinstance(x, float):
    return float(f"{x:.10g}")
  return x


@pytest.mark.slow  # the smoke experiment end to end
def test_every_verdict_follows_from_the_rows_in_metrics_jsonl(smoke_run):
  workdir, _, _ = smoke_run
  headline = json.loads((workdir / "headline.json").read_text())
  # An independent summary of metrics.jsonl: means over seeds per point.
  groups = {}
  for r in _rows(workdir):
    key = (r["point_key"], json.dumps(r["labels"], sort_keys=True))
    groups.setdefault(key, []).append(r)
  summary = []
  for members in groups.values():
    row = {"study": members[0]["study"], "point_key": members[0]["point_key"]}
    row.update(members[0]["labels"])
    for name in members[0]["values"]:
      values = [m["values"][name] for m in members]
      row[f"{name}_mean"] = sum(values) / len(values)
      row[f"{name}_min"], row[f"{name}_max"] = min(values), max(values)
    summary.append(row)
  claims_table = (workdir / "report.md").read_text().split("\n## ")[1]
  ran = {r["study"] for r in summary}
  for study in STUDIES.values():
    if study.name not in ran:  # outside the smoke variant: no verdict
      assert not set(study.claims) & set(headline["claims"]), study.name
      continue
    for claim_id, claim in study.claims.items():
      rows = [r for r in summary if r["study"] == study.name]
      expected = json.loads(json.dumps(claim.compute(rows)))
      reported = dict(headline["claims"][claim_id])
      assert reported.pop("claim") == claim.text
      assert _rounded(reported) == _rounded(expected), claim_id
      assert f"| {claim_id} | {claim.text} | **{expected['verdict']}** |" in (
        claims_table
      )


@pytest.mark.slow  # the smoke experiment end to end
def test_invariants(smoke_run):
  workdir, _, _ = smoke_run
  rows = [
    r
    for r in _rows(workdir)
    if r["study"] == "format_sweep"
    and r["labels"]["comparison"] == "flash_vs_baseline"
  ]
  by_format = {}
  for r in rows:
    by_format.setdefault(r["labels"]["format"], []).append(
      r["values"]["max_abs"]
    )
  worst = {fmt: max(v) for fmt, v in by_format.items()}
  assert worst["fp64"] < 1e-12
  # Fewer mantissa bits, larger deviation.
  assert worst["fp64"] < worst["fp32"] < worst["bf16"]
  assert all(r["values"]["n_nan"] == 0 for r in _rows(workdir))


@pytest.mark.slow  # the smoke experiment end to end
def test_inference_study_keeps_rows_bitwise_where_the_kernel_promises(
  smoke_run,
):
  """Measured, not assumed: one split, a fixed split size across batch
  sizes, pages, chunked prefill and decode positions leave every bit; a
  split count from the batch size, or several splits, do not."""
  workdir, _, _ = smoke_run
  rows = [r for r in _rows(workdir) if r["study"] == "inference"]
  assert rows

  def bitwise(**labels):
    found = [
      r["values"]["bitwise"]
      for r in rows
      if all(r["labels"].get(k) == v for k, v in labels.items())
    ]
    assert found, labels
    return found

  assert all(bitwise(axis="num_splits", value=1))
  assert all(bitwise(axis="batch", schedule="split_size"))
  assert all(bitwise(axis="batch", schedule="unsplit"))
  for axis in ("page_size", "chunk", "position"):
    assert all(bitwise(axis=axis)), axis
  assert not all(bitwise(axis="batch", schedule="num_splits_by_batch"))
  assert not all(bitwise(axis="num_splits", value=4))
  # The input-format partials round once more: never closer to FP64.
  errors = {
    r["labels"]["partials"]: r["values"]["error_ulps"]
    for r in rows
    if r["labels"]["axis"] == "num_splits" and r["labels"]["value"] == 4
  }
  assert errors["input"] >= errors["fp32"]


@pytest.mark.slow  # the smoke experiment end to end
def test_rerun_skips_finished_points_and_repairs_a_cut_line(
  smoke_run, tmp_path
):
  workdir, first, config = smoke_run
  copy = tmp_path / "copy"
  copy.mkdir()
  lines = (workdir / "metrics.jsonl").read_text().splitlines(keepends=True)
  # An interrupted write: the last row cut in half.
  (copy / "metrics.jsonl").write_text(
    "".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]
  )
  result = forward.run(config, copy)
  # Only the point whose row was cut is measured again.
  assert result["points_measured"] == 1
  assert result["points_skipped"] == first["points_measured"] - 1
  again = _rows(copy)  # every line parses, no row is duplicated
  assert len(again) == len(lines)
  assert len({json.dumps(r, sort_keys=True) for r in again}) == len(again)
  assert forward.run(config, copy)["points_measured"] == 0


@pytest.mark.slow  # the smoke experiment end to end
def test_launcher_accepts_command_line_overrides(tmp_path):
  cmd = [
    sys.executable,
    str(REPO / "launch" / "forward_deviation.py"),
    f"--workdir={tmp_path}",
    "--config=smoke",
    "--config.studies=seq_len",
    "--config.seq_len.lengths=32,48",
    "--config.common.seeds=1",
  ]
  subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=300)
  lengths = {r["labels"]["seq_len"] for r in _rows(tmp_path)}
  assert lengths == {32, 48}


def test_bad_config_fails_fast():
  config = forward_config.get_config("smoke")
  config.studies = "format_sweep,fig9"
  with pytest.raises(ValueError, match="fig9.*valid"):
    forward.run(config, "/nonexistent/never/written")
  with pytest.raises(ValueError, match="variant 'papers'"):
    forward_config.get_config("papers")


def test_overflow_is_recorded_and_named_not_hidden(tmp_path):
  config = forward_config.get_config("smoke")
  config.studies = "format_sweep"
  config.common.formats = "fp32,fp16"
  config.common.distributions = "scaled"
  config.common.scale = 200.0  # scores overflow fp16 when stored in it
  config.common.seeds = 1
  result = forward.run(config, tmp_path)
  assert result["nonfinite_rows"] > 0
  rows = _rows(tmp_path)
  bad = [r for r in rows if r["values"]["n_nan"] or r["values"]["n_inf"]]
  assert bad and all(r["labels"]["policy"] == "fp16" for r in bad)
  report = (tmp_path / "report.md").read_text()
  section = report.split("## Non-finite values", 1)[1]
  assert '"policy": "fp16"' in section and "NaN" in section


@pytest.mark.parametrize("variant", ["default", "paper", "smoke"])
def test_every_value_lives_in_the_config_file(variant):
  """Each block holds exactly its dataclass's fields, so a study has no
  default of its own; a missing or unknown field is named."""
  from stableattn.experiments.forward.study import Common
  from stableattn.harness.config_values import from_section

  c = forward_config.get_config(variant)
  from_section(Common, c, "common")
  for name, study in STUDIES.items():
    from_section(study.Config, c, name)
  del c.seq_len["lengths"]
  c.seq_len.length = 8
  with pytest.raises(
    ValueError,
    match="missing fields \\['lengths'\\], unknown fields \\['length'\\]",
  ):
    from_section(STUDIES["seq_len"].Config, c, "seq_len")
