"""The stability sweep: rows, divergence as a row, resume, verdicts."""

import json

import pytest
from helpers import results_page, stored_headline

from stableattn.configs import stability as stability_config
from stableattn.experiments import stability
from stableattn.experiments.stability import analysis, report
from stableattn.harness import environment
from stableattn.harness.reporting import mean_interval, resolution


def _final(arm, lr, replicate, loss, diverged=False, max_logit=1.0):
  return {
    "kind": "final",
    "arm": arm,
    "lr": lr,
    "replicate": replicate,
    "final_loss": loss,
    "diverged": diverged,
    "max_logit_max": max_logit,
  }


def test_lr_sensitivity_and_largest_stable_lr_follow_wortsman():
  clip = 5.0
  rows = [
    _final("a", 0.01, 0, 3.0),
    _final("a", 0.1, 0, 2.0),
    _final("a", 1.0, 0, 9.0, diverged=True),  # clipped at 5
  ]
  numbers = analysis.arm_numbers(rows, "a", (0.01, 0.1, 1.0), clip)
  # mean(3, 2, 5) - min(3, 2, 5) = 1.333...
  assert numbers["lr_sensitivity"] == [pytest.approx(4 / 3)]
  assert numbers["largest_stable_lr"] == [0.1]
  assert numbers["diverged_at_top"] == [True]
  # An incomplete grid is not judged.
  assert analysis.arm_numbers(rows[:2], "a", (0.01, 0.1, 1.0), clip) is None


def test_paired_differences_need_two_replicates_for_a_verdict():
  a = {"replicates": [0, 1, 2], "lr_sensitivity": [1.0, 1.1, 0.9]}
  b = {"replicates": [0, 1, 2], "lr_sensitivity": [0.5, 0.6, 0.4]}
  diff = analysis.paired_difference(a, b, "lr_sensitivity")
  assert diff.mean == pytest.approx(0.5) and diff.low > 0
  assert analysis.change_verdict(diff) == "higher"
  one = analysis.paired_difference(
    {"replicates": [0], "lr_sensitivity": [1.0]},
    {"replicates": [0], "lr_sensitivity": [1.0]},
    "lr_sensitivity",
  )
  assert analysis.change_verdict(one) == "one replicate: no interval"
  assert analysis.change_verdict(None) == "no rows"


def test_spread_ratio_and_resolution_say_what_replicates_can_tell():
  # Flash moves the sensitivity by +-0.1, the other machine by +-0.2.
  ratio = analysis.spread_ratio([0.1, -0.1] * 3, [0.2, -0.2] * 3)
  assert ratio.mean == pytest.approx(0.5)
  assert ratio.low < 0.5 < ratio.high and ratio.count == 6
  assert analysis.spread_ratio([0.1], [0.0]) is None  # nothing to divide
  five = mean_interval([0.1, 0.2, 0.0, 0.15, 0.05])
  text = resolution(five)
  assert "5 replicates" in text and "fragile" not in text
  assert f"{(five.high - five.low) / 2:.3g}" in text
  assert "fragile" in resolution(mean_interval([0.1, 0.3]))
  assert resolution(mean_interval([0.1])) == ""
  ratios = mean_interval([1.0, 2.0, 4.0], geometric=True)
  assert "either side" in resolution(ratios, geometric=True)


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("variants", "baseline,flashy", "unknown 'flashy'"),
    ("mitigations", "none,layernorm", "unknown 'layernorm'"),
    ("train.learning_rates", "0.1", "two or more positive numbers"),
    ("low_precision", "bf16-fa2", "not below 16 bits"),
    ("context_parallel", 1, "0 \\(off\\) or the devices of the ring"),
  ],
)
def test_bad_configs_fail_fast(field, value, message):
  config = stability_config.get_config("smoke")
  section, _, name = field.rpartition(".")
  (config[section] if section else config)[name] = value
  with pytest.raises(ValueError, match=message):
    stability.settings_from_config(config)


def test_no_rows_is_no_verdict():
  settings = stability.settings_from_config(
    stability_config.get_config("smoke")
  )
  with pytest.raises(ValueError, match="nothing to judge"):
    report.numbers_of(settings, [])


@pytest.mark.slow
def test_smoke_sweep_records_divergence_as_rows_and_resumes(tmp_path):
  config = stability_config.get_config("smoke")
  result = stability.run(config, tmp_path / "whole")
  arms = result["arms"]
  assert set(arms) == {
    a.name for a in stability.settings_from_config(config).arms
  }
  for numbers in arms.values():
    assert numbers["lr_sensitivity"]["count"] == 1
    assert numbers["largest_stable_lr"]["mean"] == pytest.approx(0.01)
  # The Baseline arms ran again on the other machine, when there is one.
  flags, label = environment.other_machine_flags()
  assert result["machine_pair"] == {"xla_flags": flags, "label": label}
  if flags is not None:
    assert f"baseline@{label}/bf16/none" in arms
    assert set(result["verdicts"]["machine"]) == {"none", "qk_norm"}
  assert result["environment"]["corpus_sha256"]
  whole = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").open()]
  finals = [r for r in whole if r["kind"] == "final"]
  diverged = [r for r in finals if r["diverged"]]
  assert diverged and all(r["lr"] == 1.0 for r in diverged)
  assert all(isinstance(r["diverged_at"], int) for r in diverged)
  assert all(
    r["final_loss"] == pytest.approx(5.545, abs=1e-3) for r in diverged
  )
  report_text = (tmp_path / "whole" / "report.md").read_text()
  assert "## The answer" in report_text.split("## Per arm")[0]
  assert report_text.splitlines()[2].startswith("*Environment:*")
  # Qiu & Yao's delta probe: one signed share per layer at each logged step.
  logs = [r for r in whole if r["kind"] == "log"]
  depth = config.model.depth
  assert logs and all(len(r["delta_signed_share"]) == depth for r in logs)
  assert all(-1 <= x <= 1 for r in logs for x in r["delta_signed_share"])
  assert "delta signed share" in report_text.split("## Probes")[1]
  assert (tmp_path / "whole" / "stability_loss.png").stat().st_size > 0

  # A sweep stopped after its first three cells resumes with the rest and
  # gets the same final rows (every cell is deterministic).
  stopped = tmp_path / "stopped"
  stopped.mkdir()
  (stopped / "config.json").write_text(
    (tmp_path / "whole" / "config.json").read_text()
  )
  cut = [i for i, r in enumerate(whole) if r["kind"] == "final"][2] + 1
  (stopped / "metrics.jsonl").write_text(
    "".join(json.dumps(r) + "\n" for r in whole[:cut])
  )
  stability.run(config, stopped)
  resumed = [json.loads(x) for x in (stopped / "metrics.jsonl").open()]

  def key(r):
    return (r["arm"], r["lr"], r["replicate"])

  assert sorted(
    (key(r), r["final_loss"]) for r in resumed if r["kind"] == "final"
  ) == sorted((key(r), r["final_loss"]) for r in finals)


@pytest.mark.slow
def test_a_context_parallel_flash_arm_is_swept_beside_flash(tmp_path):
  config = stability_config.get_config("smoke")
  config.variants, config.mitigations = "flash", "none"
  config.train.machine_pair = False
  config.context_parallel = 2
  settings = stability.settings_from_config(config)
  ring = next(a for a in settings.arms if a.variant == "flash_context_parallel")
  assert settings.runs[ring][1].attention.context_parallel == 2
  result = stability.run(config, tmp_path)
  flash, sharded = (
    result["arms"][f"{v}/bf16/none"]
    for v in ("flash", "flash_context_parallel")
  )
  # The same learning rates hold and break with the sequence sharded.
  assert sharded["largest_stable_lr"] == flash["largest_stable_lr"]
  finals = [
    json.loads(x) for x in (tmp_path / "metrics.jsonl").open() if '"final"' in x
  ]
  by_arm = {
    (r["arm"], r["lr"]): r["final_loss"] for r in finals if not r["diverged"]
  }
  stable = by_arm[("flash/bf16/none", 0.01)]
  assert by_arm[("flash_context_parallel/bf16/none", 0.01)] != stable


@pytest.mark.slow  # a launcher process end to end (CI's slow tier)
def test_launcher_names_a_bad_field_in_one_line(tmp_path):
  import pathlib
  import subprocess
  import sys

  repo = pathlib.Path(__file__).resolve().parent.parent
  out = subprocess.run(
    [
      sys.executable,
      str(repo / "launch" / "stability.py"),
      f"--workdir={tmp_path}",
      "--config=smoke",
      "--config.mitigations=none,dropout",
    ],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=repo,
  )
  assert out.returncode == 2
  assert "config.mitigations: unknown 'dropout'" in out.stderr
  assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_delta_probe_compares_the_run_with_fp32_attention():
  """delta's two versions share dO and differ only through O: equal for an
  FP32 reference run, not for flash with every stage in BF16."""
  import numpy as np

  from stableattn.contract.options import Options
  from stableattn.training import data as data_lib
  from stableattn.training.model import AttentionSpec, ModelSpec
  from stableattn.training.trainer import OptimizerSpec, RunSpec, Trainer

  model = ModelSpec(width=32, depth=2, heads=2, max_len=32)
  batch = data_lib.generate_corpus(4 * 33, 0)[: 4 * 33].reshape(4, 33)
  differences = {}
  for kind, policy in (("reference", "fp32"), ("pallas", "bf16")):
    attention = AttentionSpec(
      kind=kind, options=Options(policy, block_q=16, block_k=16)
    )
    trainer = Trainer(model, RunSpec(attention), OptimizerSpec(), 4)
    state = trainer.init_state(0)
    pairs = trainer.deltas(state, trainer.shard_batch(batch))
    assert len(pairs) == model.depth
    differences[kind] = [
      float(np.max(np.abs(np.asarray(ours) - np.asarray(exact))))
      for exact, ours in pairs
    ]
    assert all(np.isfinite(np.asarray(x)).all() for p in pairs for x in p)
  assert differences["reference"] == [0.0, 0.0]
  assert min(differences["pallas"]) > 0


def _quoted(interval: dict, digits: int, unit: str = "") -> str:
  """An interval as docs/results.md writes it: mean, then [low, high]."""
  return (
    f"{interval['mean']:.{digits}f}{unit} [{interval['low']:.{digits}f}, "
    f"{interval['high']:.{digits}f}]"
  )


def _stored_variant(run: str, variant: str) -> dict:
  return stored_headline(run)["verdicts"]["variants"][variant]


def test_the_docs_quote_the_stored_bf16_rerun_as_its_rows_give_it():
  flash = _stored_variant("stability-activations-2026-11-27", "flash (none)")
  docs = results_page(folded=True)
  difference = _quoted(flash["lr_sensitivity_difference"], 3)
  assert f"differs from Baseline's by {difference}" in docs
  spread = flash["spread_ratio"]
  assert f"{_quoted(spread['BF16-vs-FP32'], 2, 'x')} BF16-vs-FP32" in docs
  recompiled = _quoted(spread["other-machine (AVX)"], 2, "x")
  assert f"{recompiled} the recompiled" in docs


def test_the_docs_quote_the_stored_stable_arm_as_its_rows_give_it():
  stable = _stored_variant(
    "stable-arm-stability-2026-11-27", "flash_stable (none)"
  )
  docs = results_page(folded=True)
  difference = _quoted(stable["lr_sensitivity_difference"], 3)
  assert f"{difference} (stable Flash)" in docs
  spread = _quoted(stable["spread_ratio"]["BF16-vs-FP32"], 2, "x")
  assert f"{spread} BF16-vs-FP32's" in docs


def test_the_docs_quote_the_stored_sweeps_across_sizes_side_by_side():
  from stableattn.experiments.stability.across_sizes import before_after_tables

  now = stored_headline("stability-sizes-2026-11-27")
  before = stored_headline("stability-sizes-2026-11-26")
  assert before_after_tables(now, before) in results_page(folded=False)
  flash = now["changes"]["w96-d3"]["flash (none)"]
  assert "above 0.192" in flash["lr_sensitivity_resolution"]
