"""The attention monitor: statistics that place a run among the audit's
regimes, and what they cost a training step."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.experiments.benchmark import monitor_overhead
from stableattn.training.model import FP16_TINY, attention_statistics


def _qk(seed=0, shape=(2, 64, 4, 16)):
  keys = jax.random.split(jax.random.key(seed))
  return tuple(jax.random.normal(key, shape) for key in keys)


def test_statistics_find_outlier_channels_and_large_logits():
  q, k = _qk()
  calm = {n: float(v) for n, v in attention_statistics(q, k).items()}
  assert calm["k_outlier_ratio"] < 3 and calm["max_logit"] < 20
  massive = k.at[..., 5].multiply(100.0)
  loud = {n: float(v) for n, v in attention_statistics(q, massive).items()}
  assert loud["k_outlier_ratio"] > 30 > loud["q_outlier_ratio"]
  assert loud["max_logit"] > 100 and loud["min_row_lse"] < calm["min_row_lse"]


def test_fp16_underflow_share_counts_attended_probabilities_below_tiny():
  q, k = _qk(1)
  stats = attention_statistics(8 * q, k)
  s = np.einsum("bthd,bshd->bhts", 8 * np.asarray(q), np.asarray(k)) / 4.0
  mask = np.tril(np.ones((64, 64), bool))
  s = np.where(mask, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  allowed = np.broadcast_to(mask, p.shape)
  expected = np.mean(((p > 0) & (p < FP16_TINY))[allowed])
  assert expected > 0.01
  assert abs(float(stats["fp16_underflow_share"]) - expected) < 1e-3


def test_the_monitor_overhead_is_measured_per_step_at_the_logging_interval():
  sizes = types.SimpleNamespace(
    width=32, depth=1, heads=2, seq_len=32, batch_size=2, log_every=10
  )
  row = monitor_overhead.measure(sizes, repeats=2)
  assert row["step_ms"] > 0 and row["eval_ms_with_monitor"] > 0
  extra = max(row["eval_ms_with_monitor"] - row["eval_ms_without_monitor"], 0)
  assert np.isclose(row["overhead_per_step"], extra / 10 / row["step_ms"])
  assert "% of training time" in monitor_overhead.overhead_line(row)
  assert jnp.isfinite(row["overhead_at_every_step"])
