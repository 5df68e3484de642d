"""The training-drift experiment, end to end on its :smoke config."""

import json
import pathlib
import re

import jax
import numpy as np
import pytest
from helpers import run_once

from stableattn.configs import training_drift as drift_config
from stableattn.experiments import training_drift
from stableattn.experiments.training_drift.analysis import (
  drift_ratios,
  paper_verdict,
  ratio_summary,
)
from stableattn.experiments.training_drift.pairs import BY_NAME
from stableattn.harness import environment
from stableattn.harness.reporting import mean_interval
from stableattn.training.trainer import Trainer

# Trains the smoke model end to end (minutes cold): CI's slow step.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  config = drift_config.get_config("smoke")
  return run_once(
    tmp_path_factory, "drift_smoke", lambda d: training_drift.run(config, d)
  )


def _rows(workdir):
  return [
    json.loads(line)
    for line in (workdir / "metrics.jsonl").read_text().splitlines()
  ]


def _final_states(workdir, config):
  settings = training_drift.settings_from_config(config)
  template = {
    (name, replicate): Trainer(
      settings.model, spec, settings.optimizer, settings.batch_size
    ).init_state(replicate)
    for name, spec in settings.physical_runs.items()
    for replicate in range(settings.replicates)
  }
  return training_drift.load_checkpoint(workdir, template)


def test_writes_every_file(smoke_run):
  workdir, _ = smoke_run
  for name in (
    "config.json",
    "metrics.jsonl",
    "summary.csv",
    "report.md",
    "fig7_flash_vs_baseline.png",
    "fig8_all_pairs.png",
    "shadow_deviation.png",
    "loss.png",
    "monitor_heads.png",
  ):
    assert (workdir / name).stat().st_size > 0, name
  # The monitor's verdict per run, with its remedies where a head entered
  # a region (the calibration's 2-D map), or why there is nothing to do.
  report = (workdir / "report.md").read_text()
  assert "## The monitor's verdict, per head" in report
  assert re.search(r"Heads of \d+ of \d+ runs entered a region", report)
  # The flash run asks for "flash"; the record says which kernel it took.
  _, result = smoke_run
  assert set(result["environment"]["flash_paths"]) == {"pallas"}
  assert "'flash' ran pallas" in report


def test_controls_and_pairs(smoke_run):
  workdir, result = smoke_run
  rows = _rows(workdir)
  drift = [r for r in rows if r["kind"] == "drift" and r["scope"] == "model"]
  rerun = [r["max_abs"] for r in drift if r["pair"] == "identical_rerun"]
  flash = [
    r["max_abs"]
    for r in drift
    if r["pair"] == "flash_vs_baseline" and r["step"] > 0
  ]
  assert rerun and max(rerun) == 0.0
  assert flash and min(flash) > 0.0
  assert result["identical_rerun_max_abs"] == 0.0
  # Per-layer in-model deviation of flash vs baseline was recorded.
  shadow = [
    r for r in rows if r["kind"] == "attention" and "shadow_max_abs" in r
  ]
  assert {r["layer"] for r in shadow} == {0, 1}
  assert all(r["shadow_max_abs"] > 0 for r in shadow)
  # The monitor per head too, for every layer of every run's log.
  heads = drift_config.get_config("smoke").model.heads
  attention = [r for r in rows if r["kind"] == "attention"]
  assert {r["layer"] for r in attention} == {0, 1}
  for r in attention:
    assert len(r["max_logit_per_head"]) == len(r["near_tied_share_per_head"])
    assert len(r["max_logit_per_head"]) == heads
    assert max(r["max_logit_per_head"]) == r["max_logit"]
    tied = np.mean(r["near_tied_share_per_head"])
    assert tied == pytest.approx(r["near_tied_share"], rel=1e-6, abs=1e-9)


def test_fix_pair_and_attention_gradient_error(smoke_run):
  workdir, result = smoke_run
  rows = _rows(workdir)
  errors = [r for r in rows if r["kind"] == "grad_error"]
  logged = sorted({r["step"] for r in rows if r["kind"] == "drift"})
  for run in ("flash", "flash_fixed"):
    mine = [r for r in errors if r["run"] == run]
    # Every attention projection of both layers, at every logging step of
    # both replicates.
    assert len(mine) == 8 * len(logged) * 2
    assert all(r["rel_error"] > 0 for r in mine)
    assert all(0 < r["top_singular_share"] <= 1 for r in mine)
    first = [r for r in mine if r["step"] == logged[0]]
    assert len(first) == 16  # the first log of each replicate
    assert all(r["cos_previous"] is None for r in first)
    later = [r["cos_previous"] for r in mine if r["step"] > logged[0]]
    assert later and all(-1 <= c <= 1 for c in later)
  assert result["grad_error_cosine_flash"] == pytest.approx(
    float(
      np.median(
        [
          r["cos_previous"]
          for r in errors
          if r["run"] == "flash" and r["cos_previous"] is not None
        ]
      )
    )
  )
  fix = [
    r
    for r in rows
    if r["kind"] == "drift"
    and r["scope"] == "model"
    and r["pair"] == "flash_fix_vs_flash"
  ]
  assert len(fix) == 2 * len(logged)
  assert result["flash_fix_vs_flash_max_abs"] == max(r["max_abs"] for r in fix)
  report = (workdir / "report.md").read_text()
  assert "Attention-gradient error of the flash runs" in report
  assert "Flash with Qiu & Yao's fix vs without" in report


def test_report_ratios_are_recomputed_from_metrics(smoke_run):
  workdir, result = smoke_run
  rows = _rows(workdir)
  # Geometric mean over steps per replicate, then over replicates.
  per_replicate = [
    np.exp(
      np.mean(
        np.log(
          list(
            drift_ratios(
              rows, "flash_vs_baseline", "fp16_vs_fp32", replicate=r
            ).values()
          )
        )
      )
    )
    for r in (0, 1)
  ]
  expected = mean_interval(per_replicate, geometric=True)
  reported = result["ratios"]["flash_vs_baseline"]["fp16_vs_fp32"][
    "wasserstein"
  ]
  assert reported["over_replicates"]["mean"] == pytest.approx(
    expected.mean, rel=1e-12
  )
  assert reported["over_replicates"]["low"] == pytest.approx(
    expected.low, rel=1e-12
  )
  assert reported["over_replicates"]["count"] == 2
  verdicts = result["paper_verdicts"]
  # Every subject that drifted is judged against every reference with a
  # claim (the fix never changes a computation at this size: no ratio).
  assert result["flash_fix_vs_flash_max_abs"] == 0
  assert set(verdicts) == {
    "flash_vs_baseline",
    "context_parallel_vs_single",
    "stable_vs_baseline",
    "stable_vs_flash",
  }
  for subject, by_reference in verdicts.items():
    assert set(by_reference) == {
      "fp16_vs_fp32",
      "bf16_vs_fp32",
      "fp16_vs_bf16",
      "different_seed",
    }
    for pair, verdict in by_reference.items():
      summary = ratio_summary(rows, subject, pair)
      assert verdict == paper_verdict(summary, BY_NAME[pair]), pair
      assert (
        f"`{subject}` against `{pair}` (Wasserstein)"
        in (workdir / "report.md").read_text()
      )
  report = (workdir / "report.md").read_text()
  assert "95% CI over replicates" in report and "identical-rerun" in report


def test_replicates_start_apart_and_read_their_own_data(smoke_run):
  workdir, _ = smoke_run
  rows = _rows(workdir)
  # The different-seed pair is far apart in every replicate, and the
  # replicates' own base runs differ from each other: not one seed twice.
  first = {
    r["replicate"]: r["eval_loss"]
    for r in rows
    if r["kind"] == "run" and r["run"] == "base" and r["step"] == 0
  }
  assert set(first) == {0, 1} and first[0] != first[1]
  trained = {
    r["replicate"]: r["train_loss"]
    for r in rows
    if r["kind"] == "run" and r["run"] == "base" and r["step"] == 4
  }
  assert trained[0] != trained[1]
  rerun = [
    r
    for r in rows
    if r["kind"] == "drift"
    and r["scope"] == "model"
    and r["pair"] == "identical_rerun"
  ]
  assert {r["replicate"] for r in rerun} == {0, 1}
  assert all(r["max_abs"] == 0 for r in rerun)


def test_interrupted_run_resumes_bitwise(smoke_run, tmp_path):
  full_dir, _ = smoke_run
  config = drift_config.get_config("smoke")
  config.pairs = "flash_vs_baseline"
  config.train.stop_at_step = 6
  assert training_drift.run(config, tmp_path)["stopped_at_step"] == 6
  config.train.stop_at_step = 0
  training_drift.run(config, tmp_path)
  step, resumed = _final_states(tmp_path, config)
  full_step, full = _final_states(full_dir, drift_config.get_config("smoke"))
  assert step == full_step == config.train.total_steps
  for key in [("base", 0), ("flash", 0), ("base", 1), ("flash", 1)]:
    a, b = jax.tree.leaves(resumed[key]), jax.tree.leaves(full[key])
    assert all(np.array_equal(x, y) for x, y in zip(a, b)), key
  # Metrics after the checkpoint were not duplicated.
  for replicate in (0, 1):
    steps = [
      r["step"]
      for r in _rows(tmp_path)
      if r["kind"] == "run"
      and r["run"] == "base"
      and r["replicate"] == replicate
    ]
    assert steps == sorted(set(steps)) == [0, 4, 8, 12]


def test_the_other_machine_pair_drifts_and_records_where_it_ran(smoke_run):
  workdir, result = smoke_run
  flags, label = environment.other_machine_flags()
  if flags is None:
    pytest.skip(f"no other machine to compile for here: {label}")
  drift = {
    (r["replicate"], r["step"]): r["max_abs"]
    for r in _rows(workdir)
    if r["kind"] == "drift"
    and r["scope"] == "model"
    and r["pair"] == "other_machine"
  }
  logged = sorted({r["step"] for r in _rows(workdir) if r["kind"] == "drift"})
  assert set(drift) == {(r, s) for r in (0, 1) for s in logged}
  # Another instruction set rounds otherwise: the weights move apart.
  assert all(drift[r, logged[-1]] > 0 for r in (0, 1))
  headline = json.loads((workdir / "headline.json").read_text())
  assert headline["machine_pair"] == {"xla_flags": flags, "label": label}
  assert headline["environment"]["xla_cpu_isa"] == environment.compiled_isa()
  assert headline["environment"]["corpus_sha256"]
  assert "other_machine" in headline["ratios"]["flash_vs_baseline"]
  assert result["identical_rerun_max_abs"] == 0.0  # the control stays 0
  # The snapshots are gone once the report is written.
  assert not (workdir / "machine_twin" / "snapshots").exists()


def test_interrupted_run_with_the_other_machine_ends_with_the_same_rows(
  smoke_run, tmp_path
):
  if environment.other_machine_flags()[0] is None:
    pytest.skip("no other machine to compile for here")
  full_dir, _ = smoke_run
  config = drift_config.get_config("smoke")
  config.pairs = "other_machine"
  config.train.stop_at_step = 6
  training_drift.run(config, tmp_path)
  config.train.stop_at_step = 0
  training_drift.run(config, tmp_path)

  def machine_rows(workdir):
    return sorted(
      (r["replicate"], r["step"], r["scope"], r["max_abs"], r["wasserstein"])
      for r in _rows(workdir)
      if r["kind"] == "drift" and r["pair"] == "other_machine"
    )

  assert machine_rows(tmp_path) == machine_rows(full_dir)


def test_context_parallel_run_is_a_subject_against_every_reference(
  smoke_run,
):
  workdir, result = smoke_run
  drift = [
    r["max_abs"]
    for r in _rows(workdir)
    if r["kind"] == "drift"
    and r["pair"] == "context_parallel_vs_single"
    and r["step"] > 0
  ]
  # The ring changes the order of summation, so the runs part.
  assert drift and min(drift) > 0.0
  ratios = result["ratios"]["context_parallel_vs_single"]
  for reference in ("bf16_vs_fp32", "fp16_vs_bf16", "different_seed"):
    interval = ratios[reference]["wasserstein"]["over_replicates"]
    assert interval["count"] == 2
    assert interval["low"] <= interval["mean"] <= interval["high"]
  verdicts = result["paper_verdicts"]["context_parallel_vs_single"]
  assert set(verdicts) >= {"bf16_vs_fp32", "different_seed"}
  assert "ring attention" in (workdir / "report.md").read_text()
