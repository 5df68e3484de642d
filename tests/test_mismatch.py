"""The sampler's path against the trainer's: the model's KV-cache decode,
generation, scoring and the per-token mismatch metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stableattn.contract.options import Options
from stableattn.training import rollout
from stableattn.training.model import AttentionSpec, ModelSpec, Transformer

SPEC = ModelSpec(width=32, depth=2, heads=2, max_len=40)
FP32 = AttentionSpec("reference", Options(precision="fp32"))
FLASH = AttentionSpec("pallas", Options(precision="bf16-fa2"))
PROMPT = 8


@pytest.fixture(scope="module")
def model():
  return Transformer(SPEC, FP32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
  return np.random.default_rng(1).integers(0, 256, (3, PROMPT))


@pytest.mark.slow
def test_kv_cache_decode_matches_the_full_pass(model):
  """Prefill then one token at a time through the cache gives the logits
  of one causal pass over the sequence (FP32: to summation order)."""
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 20)))
  full, _ = model(tokens)
  cache = model.empty_cache(2)
  logits, cache = model.extend(tokens[:, :12], cache, FP32)
  steps = [logits]
  for t in range(12, 20):
    logits, cache = model.extend(tokens[:, t : t + 1], cache, FP32)
    steps.append(logits)
  np.testing.assert_array_equal(cache.lengths, [20, 20])
  decoded = jnp.concatenate(steps, axis=1)
  assert float(jnp.max(jnp.abs(decoded - full))) < 1e-5


@pytest.mark.slow
def test_control_pair_is_exactly_zero_and_known_causes_are_seen(model, prompts):
  """Scoring with the sampler's own path recomputes it: every metric 0.
  A BF16 head, or the flash kernel's one pass instead of its decode
  steps, moves the probabilities."""
  sampler = rollout.Path(FLASH, mode="decode")
  tokens, log_sample = rollout.generate(
    model, prompts, 8, sampler, key=jax.random.key(0)
  )
  assert tokens.shape == (3, PROMPT + 8) and log_sample.shape == (3, 8)
  control = rollout.token_metrics(
    log_sample, rollout.score(model, tokens, PROMPT, sampler)
  )
  zero = {k: v for k, v in control.items() if k != "tokens"}
  assert zero == dict.fromkeys(zero, 0.0)
  head = rollout.token_metrics(
    log_sample,
    rollout.score(
      model, tokens, PROMPT, rollout.Path(FLASH, "bf16", mode="decode")
    ),
  )
  assert head["rollout_probs_diff_max"] > 1e-5 and head["kl_k3"] > 0
  trainer = rollout.token_metrics(
    log_sample, rollout.score(model, tokens, PROMPT, rollout.Path(FLASH))
  )
  assert 0 < trainer["rollout_probs_diff_max"] < head["rollout_probs_diff_max"]


def test_greedy_generation_is_deterministic_and_divergence_is_found(
  model, prompts
):
  path = rollout.Path(FP32, mode="decode")
  a, _ = rollout.generate(model, prompts, 6, path, greedy=True)
  b, _ = rollout.generate(model, prompts, 6, path, greedy=True)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(rollout.first_divergence(a, b, PROMPT), 6)
  c = np.asarray(a).copy()
  c[0, PROMPT + 2] += 1
  c[2, PROMPT] += 1
  np.testing.assert_array_equal(
    rollout.first_divergence(a, c, PROMPT), [2, 6, 0]
  )


def test_bf16_activations_compute_the_whole_model_in_bf16(model):
  """The engine's copy computes in BF16 throughout: its residual stream is
  BF16, and its logits are those of the FP32 model on BF16-rounded
  weights rounded once more."""
  engine = rollout.with_weights(model, "bf16-activations")
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 12)))
  stream, _ = engine.residual_stream(tokens)
  assert {x.dtype for x in stream} == {jnp.dtype(jnp.bfloat16)}
  rounded = rollout.with_weights(model, "bf16")
  for ours, theirs in zip(
    jax.tree.leaves(nnx.state(engine, nnx.Param)),
    jax.tree.leaves(nnx.state(rounded, nnx.Param)),
  ):
    np.testing.assert_array_equal(ours, theirs)
  engine_logits, _ = engine(tokens)
  rounded_logits, _ = rounded(tokens)
  gap = float(jnp.max(jnp.abs(engine_logits - rounded_logits)))
  assert 0 < gap < 0.5  # BF16 activations move the logits, not wildly


def test_token_metrics_from_known_probabilities():
  p_sample = np.array([0.5, 0.25, 0.1, 0.8])
  p_train = np.array([0.5, 0.75, 0.05, 0.8])
  got = rollout.token_metrics(np.log(p_sample), np.log(p_train))
  ratio = p_train / p_sample
  assert got["rollout_probs_diff_max"] == pytest.approx(0.5)
  assert got["rollout_probs_diff_mean"] == pytest.approx(0.55 / 4)
  assert got["kl_k1"] == pytest.approx(np.mean(np.log(p_sample / p_train)))
  assert got["kl_k3"] == pytest.approx(np.mean(ratio - 1 - np.log(ratio)))
  assert got["tis_share"] == pytest.approx(0.25)  # one ratio of 3 > 2
  assert got["tokens"] == 4


def test_bad_paths_and_lengths_say_what_is_valid(model, prompts):
  with pytest.raises(ValueError, match="head_format must be one of"):
    rollout.Path(head_format="fp16")
  with pytest.raises(ValueError, match="mode must be one of"):
    rollout.Path(mode="prefill")
  with pytest.raises(ValueError, match="decode_batch must be None or"):
    rollout.Path(decode_batch=0)
  with pytest.raises(ValueError, match="weights must be one of"):
    rollout.Path(weights="fp8")
  with pytest.raises(ValueError, match="exceed the model's max_len 40"):
    rollout.generate(model, prompts, 40, rollout.Path(), greedy=True)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    rollout.generate(model, prompts, 2, rollout.Path())


def _experiment_config(**changes):
  from stableattn.configs import mismatch as mismatch_config

  config = mismatch_config.get_config("smoke")
  config.train.steps = 4
  config.sample.prompts = 3
  config.pairs = "batch_n_vs_batch_1_decode,head_bf16_vs_fp32"
  config.rl.arms = "fp8_sampler"
  config.rl.steps = 2
  for name, value in changes.items():
    node = config
    *parents, leaf = name.split(".")
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config


@pytest.mark.slow
def test_experiment_measures_pairs_reports_and_resumes(tmp_path):
  """End to end: the control is exactly 0, the head's reference is not,
  verdicts and both figures are written, and a rerun redoes nothing."""
  import json

  from stableattn.experiments import mismatch as experiment

  first = experiment.run(_experiment_config(), tmp_path)
  # Control and two pairs, two seeds; on-policy and FP8 policy gradient.
  assert first["measured"] == 3 * 2 + 2
  headline = json.loads((tmp_path / "headline.json").read_text())
  assert headline["verdicts"]["control"]["verdict"] == "exactly 0"
  assert set(headline["verdicts"]) == {"control"}
  head = headline["pairs"]["head_bf16_vs_fp32"]["rollout_probs_diff_mean"]
  assert head["mean"] > 0 and head["count"] == 6
  # A split count that follows the batch moves a sequence's probabilities.
  batch = headline["pairs"]["batch_n_vs_batch_1_decode"]
  assert batch["rollout_probs_diff_max"]["mean"] > 0
  never = headline["pairs"]["control"]["greedy_divergence"]
  assert never["mean"] == 8  # new_tokens: the control never parts
  control = headline["pairs"]["control"]["rollout_probs_diff_max"]
  assert control["mean"] == 0
  report = (tmp_path / "report.md").read_text()
  for part in ("## Verdicts", "## Every pair", "## Subjects against"):
    assert part in report
  for png in ("mismatch.png", "importance_ratio.png", "rl_reward.png"):
    assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
  assert "## Does it matter" in report
  # The trained model's heads on the calibrated map, and their figure.
  assert "## The monitor's verdict, per head" in report
  assert (tmp_path / "monitor_heads.png").read_bytes()[:4] == b"\x89PNG"
  runs = [
    json.loads(line)
    for line in (tmp_path / "metrics.jsonl").open()
    if '"arm"' in line
  ]
  assert {r["arm"] for r in runs} == {"on_policy", "fp8_sampler"}
  for run in runs:
    assert len(run["reward"]) == 2 and run["finite"]
    kl = run["kl_k3"]
    assert (max(kl) == 0) == (run["arm"] == "on_policy")
  assert set(headline["policy_gradient"]) == {
    "mismatch_effect",
    "tis_effect",
    "collapse",
  }
  again = experiment.run(_experiment_config(), tmp_path)
  assert again["measured"] == 0 and again["verdicts"] == first["verdicts"]
  # More seeds extend the run; another model does not fit the directory.
  more = experiment.run(_experiment_config(**{"sample.seeds": 3}), tmp_path)
  assert more["measured"] == 3
  with pytest.raises(ValueError, match="another config"):
    experiment.run(_experiment_config(**{"model.width": 16}), tmp_path)


def test_experiment_settings_are_checked(tmp_path):
  from stableattn.experiments import mismatch as experiment

  with pytest.raises(ValueError, match="config.pairs: unknown \\['nope'\\]"):
    experiment.settings_from_config(_experiment_config(pairs="nope"))
  with pytest.raises(ValueError, match="tis_threshold must be a cap > 1"):
    experiment.settings_from_config(_experiment_config(tis_threshold=0.5))
  with pytest.raises(ValueError, match="target_byte must be a byte"):
    experiment.settings_from_config(
      _experiment_config(**{"rl.target_byte": 300})
    )
  with pytest.raises(ValueError, match="exceed model.max_len 32"):
    experiment.settings_from_config(
      _experiment_config(**{"sample.new_tokens": 30})
    )


def test_reward_and_collapse_from_known_sequences():
  from stableattn.experiments.mismatch import policy_gradient as pg

  tokens = np.array([[1, 2, 101, 101, 7], [1, 2, 5, 6, 101]])
  np.testing.assert_allclose(pg.reward(tokens, 2, 101), [2 / 3, 1 / 3])
  rising = [0.1] * 5 + [0.3] * 10
  assert pg.collapse_step(rising) is None
  # One bad step is noise; a lasting fall to a tenth is a collapse.
  assert pg.collapse_step(rising + [0.0] + [0.3] * 5) is None
  fall = rising + [0.02] * 8
  assert pg.collapse_step(fall) == 17  # the 5-step mean: 0.132 < 0.15
  assert pg.collapse_step([0.3] * 3) is None  # too short to judge
  with pytest.raises(ValueError, match="config.rl.arms: unknown"):
    pg.resolve_arms("fp4_sampler")


@pytest.mark.slow
def test_a_killed_run_restarts_to_the_same_rows(tmp_path):
  """SIGKILL the launcher once it has written rows; rerunning the same
  command ends with the rows of a run never interrupted."""
  import json
  import os
  import pathlib
  import signal
  import subprocess
  import sys
  import time

  repo = pathlib.Path(__file__).resolve().parent.parent
  overrides = [
    "--config.train.steps=4",
    "--config.sample.prompts=3",
    "--config.pairs=batch_n_vs_batch_1_decode,head_bf16_vs_fp32",
    "--config.rl.arms=fp8_sampler",
    "--config.rl.steps=2",
  ]
  killed = tmp_path / "killed"
  command = [
    sys.executable,
    str(repo / "launch" / "mismatch.py"),
    f"--workdir={killed}",
    "--config=smoke",
    "--json",
    *overrides,
  ]
  process = subprocess.Popen(
    command, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  metrics = killed / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and process.poll() is None:
    if metrics.exists() and metrics.read_text().count("\n") >= 2:
      break
    time.sleep(0.2)
  assert process.poll() is None, "the run ended before it could be killed"
  os.kill(process.pid, signal.SIGKILL)
  process.wait()
  written = metrics.read_text().count("\n")
  assert 2 <= written < 8
  rerun = subprocess.run(command, cwd=repo, capture_output=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  # The uninterrupted run goes through the launcher too: the tests' own
  # process has 64-bit mode on, which the launcher does not.
  whole_command = [
    c if not c.startswith("--workdir=") else f"--workdir={tmp_path / 'whole'}"
    for c in command
  ]
  whole = subprocess.run(whole_command, cwd=repo, capture_output=True)
  assert whole.returncode == 0 and json.loads(whole.stdout)["measured"] == 8

  def rows(workdir):
    return sorted(
      json.dumps(json.loads(line), sort_keys=True)
      for line in (workdir / "metrics.jsonl").open()
    )

  assert rows(killed) == rows(tmp_path / "whole")


def _short(x: float) -> str:
  """A number as docs/results.md writes it: two digits, no exponent pad."""
  return f"{x:.1e}".replace("e-0", "e-").replace("e+0", "e+")


def test_the_docs_quote_the_stored_mismatch_run_as_its_rows_give_it():
  import gzip
  import json

  from helpers import results_page, stored_headline, stored_run

  from stableattn.experiments.mismatch import report

  name = "mismatch-2026-11-27"
  with gzip.open(stored_run(name) / "metrics.jsonl.gz", "rt") as lines:
    rows = [json.loads(line) for line in lines]
  docs = results_page(folded=False)
  assert report._ratio_table([r for r in rows if "pair" in r]) in docs
  pairs = stored_headline(name)["pairs"]
  for pair in (
    "flash_decode_vs_train_bf16",
    "flash_decode_vs_train_fp16",
    "flash_decode_vs_train_bf16_activations",
    "model_bf16_activations_vs_fp32",
  ):
    mean = pairs[pair]["rollout_probs_diff_mean"]
    quoted = (
      f"| {_short(mean['mean'])} [{_short(mean['low'])}, "
      f"{_short(mean['high'])}] |"
    )
    assert quoted in docs, (pair, quoted)
  verdicts = stored_headline(name)["verdicts"]
  folded = results_page(folded=True)
  for key in ("bf16_activations", "attention_vs_bf16_model"):
    ratio = verdicts[key]["ratio"]
    assert (
      f"{report.num(ratio['mean'])}x [{report.num(ratio['low'])}, "
      f"{report.num(ratio['high'])}]" in folded
    ), key
