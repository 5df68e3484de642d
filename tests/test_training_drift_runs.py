"""The training-drift experiment beyond its smoke run: runs that resume,
move to another instruction set or device count, fail fast or train a
subject of their own, and the settings' checks."""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import stableattn as sa
from stableattn.configs import training_drift as drift_config
from stableattn.experiments import training_drift
from stableattn.harness import environment
from stableattn.training.model import AttentionSpec, ModelSpec
from stableattn.training.trainer import OptimizerSpec, RunSpec, Trainer

# Trains the smoke model end to end (minutes cold): CI's slow step.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent


def _rows(workdir):
  return [
    json.loads(line)
    for line in (workdir / "metrics.jsonl").read_text().splitlines()
  ]


def test_lost_rows_after_the_snapshots_are_gone_are_measured_again(tmp_path):
  """A finished run's snapshots are deleted; rows lost later make the
  parent retrain from step 0, and the other machine's run, whose own
  checkpoint is past the lost steps, is trained again from scratch."""
  if environment.other_machine_flags()[0] is None:
    pytest.skip("no other machine to compile for here")
  config = drift_config.get_config("smoke")
  config.pairs = "other_machine"
  training_drift.run(config, tmp_path)
  assert not (tmp_path / "machine_twin" / "snapshots").exists()
  rows = _rows(tmp_path)
  kept = [r for r in rows if r["step"] <= 4]
  (tmp_path / "metrics.jsonl").write_text(
    "".join(json.dumps(r) + "\n" for r in kept)
  )
  training_drift.run(config, tmp_path)

  def drift(rows):
    return sorted(
      (r["replicate"], r["step"], r["scope"], r["max_abs"])
      for r in rows
      if r["kind"] == "drift"
    )

  assert drift(_rows(tmp_path)) == drift(rows)


def test_verdicts_not_bits_travel_to_another_instruction_set(tmp_path):
  """The smoke run's verdicts are the same when XLA compiles for the
  instruction set one step down; its bits are not."""
  flags, label = environment.other_machine_flags()
  if flags is None:
    pytest.skip(f"no other machine to compile for here: {label}")
  outputs = {}
  for name, xla_flags in (("here", environment.xla_flags()), (label, flags)):
    # A user's machine compiles at XLA's default optimization level, not
    # at the tests' level 0: at level 0 the smoke run's verdicts against
    # BF16-vs-FP32 and FP16-vs-BF16 sit at their edge and part ways.
    xla_flags = re.sub(r"--xla_backend_optimization_level=\S+", "", xla_flags)
    env = dict(os.environ, XLA_FLAGS=xla_flags.strip())
    cmd = [
      sys.executable,
      str(REPO / "launch" / "training_drift.py"),
      f"--workdir={tmp_path / name}",
      "--config=smoke",
      "--config.pairs=flash_vs_baseline,bf16_vs_fp32,fp16_vs_bf16,"
      "different_seed,identical_rerun",
      "--config.train.grad_error=False",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs[name] = json.loads((tmp_path / name / "headline.json").read_text())
  here, there = outputs["here"], outputs[label]
  assert there["environment"]["xla_cpu_isa"] == label
  assert here["paper_verdicts"] == there["paper_verdicts"]
  for headline in (here, there):
    assert headline["identical_rerun_max_abs"] == 0
  assert here["ratios"] != there["ratios"]  # the flag took effect


def test_batch_is_sharded_over_four_simulated_devices(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  cmd = [
    sys.executable,
    str(REPO / "launch" / "training_drift.py"),
    f"--workdir={tmp_path}",
    "--config=smoke",
    "--config.pairs=one_vs_n_devices",
    "--json",
    "--config.train.devices=0",
    "--config.train.total_steps=2",
    "--config.train.warmup_steps=1",
    "--config.train.log_every=1",
  ]
  out = subprocess.run(
    cmd,
    check=True,
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  ).stdout
  result = json.loads(out[out.index("{") :])
  assert result["devices"] == {"base": 4, "one_device": 1}
  assert result["batch_shards"] == [[2, 33]] * 4


@pytest.mark.parametrize(
  "override, message",
  [
    (("attention", "flash", "triton"), "attention.flash: unknown 'triton'"),
    (("train", "precision", "fp8"), "train.precision: unknown 'fp8'"),
    (("attention", "flash_precision", "bf17"), "Unknown attention precision"),
    (("train", "batch_size", 7), "not divisible by the device count"),
    (("attention", "fix", "tie_beta=1.0"), "attention.fix.*finite number > 1"),
  ],
)
def test_bad_configs_fail_fast(override, message, tmp_path):
  config = drift_config.get_config("smoke")
  section, field, value = override
  config[section][field] = value
  if field == "batch_size":
    # Checked before any device is touched, so 3 "devices" work anywhere.
    config.train.devices = 3
  with pytest.raises(ValueError, match=message):
    training_drift.run(config, tmp_path)


def test_sequence_longer_than_data_fails_fast(tmp_path):
  config = drift_config.get_config("smoke")
  config.data.corpus_tokens = 16
  with pytest.raises(ValueError, match="fewer than seq_len"):
    training_drift.run(config, tmp_path)


def test_nan_loss_stops_with_step_named(tmp_path):
  config = drift_config.get_config("smoke")
  config.pairs = "identical_rerun"
  config.train.precision = "fp32"
  config.train.learning_rate = 1e12
  config.train.clip_norm = 1e30
  config.train.warmup_steps = 0
  # The loss of step 2 is the first NaN; it comes from step 1's update.
  with pytest.raises(
    FloatingPointError,
    match=r"at step 2, computed with the parameters after step 1's update",
  ):
    training_drift.run(config, tmp_path)
  assert any(r["kind"] == "nonfinite" for r in _rows(tmp_path))


def test_fp16_loss_scaling_skips_overflowing_steps():
  spec = RunSpec(
    AttentionSpec("reference", sa.Options("fp16-framework", 16, 16)),
    precision="fp16",
    init_loss_scale=2.0**40,
  )
  trainer = Trainer(
    ModelSpec(width=16, depth=1, heads=2, max_len=8),
    spec,
    OptimizerSpec(total_steps=4, warmup_steps=0),
    4,
  )
  state = trainer.init_state()
  before = jax.tree.leaves(jax.device_get(state.params))
  batch = trainer.shard_batch(np.ones((4, 9), np.int32))
  state, metrics = trainer.step(state, batch)
  assert not bool(metrics["finite_grads"])  # 2^40 overflows fp16
  after = jax.tree.leaves(jax.device_get(state.params))
  assert all(np.array_equal(a, b) for a, b in zip(before, after))
  assert float(state.loss_scale) == 2.0**39


def test_gpu_config_trains_two_steps_on_cpu_with_tiny_overrides(tmp_path):
  config = drift_config.get_config("gpu")
  assert (config.model.depth, config.model.width) == (12, 768)
  assert config.model.seq_len == 1024 and config.data.corpus == "python_stdlib"
  config.model.width, config.model.heads, config.model.seq_len = 32, 2, 32
  config.model.depth, config.train.replicates = 2, 1
  config.attention.block_q = config.attention.block_k = 16
  config.train.batch_size, config.train.devices = 2, 1
  config.train.total_steps, config.train.warmup_steps = 2, 1
  config.train.log_every = config.train.checkpoint_every = 1
  config.pairs = "flash_vs_baseline,fp16_vs_bf16,identical_rerun"
  result = training_drift.run(config, tmp_path)
  assert result["identical_rerun_max_abs"] == 0.0
  steps = {r["step"] for r in _rows(tmp_path) if r["kind"] == "drift"}
  assert steps == {0, 1, 2}


def test_shared_policy_compares_only_the_algorithm():
  config = drift_config.get_config("smoke")
  natural = training_drift.settings_from_config(config)
  config.attention.compare = "shared"
  shared = training_drift.settings_from_config(config)

  def policy(settings, run):
    return settings.runs[run].attention.options.precision.name

  assert policy(natural, "base") == "bf16-framework"
  assert policy(shared, "base") == "bf16-fa2"
  assert policy(shared, "flash") == "bf16-fa2"
  # The flash run's shadow computes the base run's baseline beside it.
  assert shared.runs["flash"].attention.shadow_baseline.precision.name == (
    "bf16-fa2"
  )
  config.attention.compare = "same"
  with pytest.raises(ValueError, match="attention.compare: unknown 'same'"):
    training_drift.settings_from_config(config)


def test_a_users_kernel_trains_as_a_subject_against_every_reference(tmp_path):
  config = drift_config.get_config("smoke")
  config.attention.candidate = "audit_kernels:correct"  # FP32 attention
  config.pairs = "candidate_vs_baseline,fp16_vs_bf16,different_seed"
  config.train.replicates = 2
  result = training_drift.run(config, tmp_path)
  ratios = result["ratios"]["candidate_vs_baseline"]
  assert set(ratios) == {"fp16_vs_bf16", "different_seed"}
  assert (
    ratios["different_seed"]["wasserstein"]["over_replicates"]["count"] == 2
  )
  assert set(result["paper_verdicts"]["candidate_vs_baseline"]) == {
    "fp16_vs_bf16",
    "different_seed",
  }
  report = (tmp_path / "report.md").read_text()
  assert "| candidate_vs_baseline | fp16_vs_bf16 | wasserstein |" in report
  assert "candidate: audit_kernels:correct attention (its own" in report
  assert (tmp_path / "fig7_candidate_vs_baseline.png").stat().st_size > 0


def test_a_candidate_that_does_not_resolve_is_one_clear_error():
  config = drift_config.get_config("smoke")
  config.attention.candidate = "no_such_module_xyz:attention"
  with pytest.raises(ValueError, match="Cannot import module"):
    training_drift.settings_from_config(config)
  config = drift_config.get_config("smoke")
  config.pairs = "candidate_vs_baseline"
  with pytest.raises(ValueError, match="needs config.attention.candidate"):
    training_drift.settings_from_config(config)


def test_fp8_flash_trains_as_a_subject_against_every_reference(tmp_path):
  config = drift_config.get_config("smoke")
  config.attention.low_precision = "fp8-fa3"
  config.pairs = "low_precision_vs_baseline,different_seed"
  settings = training_drift.settings_from_config(config)
  assert settings.runs["flash_low"].attention.options.precision.name == (
    "fp8-fa3"
  )
  result = training_drift.run(config, tmp_path)
  ratios = result["ratios"]["low_precision_vs_baseline"]
  assert set(ratios) == {"different_seed"}
  drift = [
    r
    for r in _rows(tmp_path)
    if r["kind"] == "drift" and r["pair"] == "low_precision_vs_baseline"
  ]
  assert drift and all(np.isfinite(r["wasserstein"]) for r in drift)
  assert drift[-1]["wasserstein"] > 0


@pytest.mark.parametrize(
  "low, message",
  [("bf16-fa2", "below 16 bits"), ("fp9", "Unknown precision preset")],
)
def test_low_precision_pair_needs_a_quantizing_policy(low, message):
  config = drift_config.get_config("smoke")
  config.attention.low_precision = low
  with pytest.raises(ValueError, match=message):
    training_drift.settings_from_config(config)
  config = drift_config.get_config("smoke")
  config.pairs = "low_precision_vs_baseline"
  with pytest.raises(ValueError, match="needs config.attention.low_precision"):
    training_drift.settings_from_config(config)
