"""The attention monitor: statistics that place a run among the audit's
regimes, and what they cost a training step."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv

import stableattn as sa
from stableattn.experiments.benchmark import monitor_overhead
from stableattn.harness.cuda_lowering import lowered_for_cuda
from stableattn.numerics.monitor import FP16_TINY, attention_statistics


def _qk(seed=0, shape=(2, 64, 4, 16)):
  keys = jax.random.split(jax.random.key(seed))
  return tuple(jax.random.normal(key, shape) for key in keys)


def _layer(stats) -> dict:
  return {n: float(v) for n, v in stats.items() if not n.endswith("_per_head")}


def test_statistics_find_outlier_channels_and_large_logits():
  q, k = _qk()
  calm = _layer(attention_statistics(q, k))
  assert calm["k_outlier_ratio"] < 3 and calm["max_logit"] < 20
  massive = k.at[..., 5].multiply(100.0)
  loud = _layer(attention_statistics(q, massive))
  assert loud["k_outlier_ratio"] > 30 > loud["q_outlier_ratio"]
  assert loud["max_logit"] > 100 and loud["min_row_lse"] < calm["min_row_lse"]


def test_per_head_statistics_find_the_one_loud_head_a_layer_hides():
  """PyTorch #196678's NaN came from one head of Qwen2.5-0.5B: a massive
  channel in head 2's keys shows there and nowhere else."""
  q, k = _qk(3)
  loud = k.at[:, :, 2, 5].multiply(100.0)
  stats = attention_statistics(q, loud)
  per_head = {n: np.asarray(v) for n, v in stats.items() if "_per_head" in n}
  assert all(v.shape == (4,) for v in per_head.values())
  assert int(np.argmax(per_head["max_logit_per_head"])) == 2
  assert per_head["k_outlier_ratio_per_head"][2] > 30
  assert np.all(np.delete(per_head["k_outlier_ratio_per_head"], 2) < 3)
  # The layer's extremes are its heads' extremes; shares their mean (every
  # head has the same rows).
  assert float(stats["max_logit"]) == per_head["max_logit_per_head"].max()
  assert float(stats["min_row_lse"]) == per_head["min_row_lse_per_head"].min()
  for name in ("near_tied_share", "tied_max_share", "entropy"):
    assert np.isclose(
      float(stats[name]), per_head[f"{name}_per_head"].mean(), rtol=1e-6
    )
  # One head's statistics are those of that head alone.
  alone = attention_statistics(q[:, :, 2:3], loud[:, :, 2:3])
  for name, value in per_head.items():
    layer_name = name.removesuffix("_per_head")
    assert np.isclose(value[2], float(alone[layer_name]), rtol=1e-6), name


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
  row = monitor_overhead.measure(sizes, repeats=2, source="q and k")
  assert row["source"] == "q and k" and "from q and k" in (
    monitor_overhead.overhead_line(row)
  )
  assert row["step_ms"] > 0 and row["eval_ms_with_monitor"] > 0
  extra = max(row["eval_ms_with_monitor"] - row["eval_ms_without_monitor"], 0)
  assert np.isclose(row["overhead_per_step"], extra / 10 / row["step_ms"])
  assert "% of training time" in monitor_overhead.overhead_line(row)
  assert jnp.isfinite(row["overhead_at_every_step"])


@pytest.mark.slow  # a model or a sweep end to end; CI's slow tier
def test_flax_drop_in_sows_the_monitor_and_its_inputs_when_asked():
  from flax import nnx

  import stableattn as sa

  def layer(**make):
    return nnx.MultiHeadAttention(
      num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0),
      attention_fn=sa.make_attention_fn(**make),
    )  # fmt: skip

  x = jax.random.normal(jax.random.key(0), (1, 8, 16))
  with pytest.raises(ValueError, match="sow_weights=True"):
    layer(monitor=True)(x, is_causal=True)
  mha = layer(monitor=True, capture=True)

  def loss(mha, x):
    return jnp.sum(mha(x, is_causal=True, sow_weights=True) ** 2)

  _, perturbations = nnx.capture(loss, nnx.Perturbation)(mha, x)
  captured = nnx.capture(loss, nnx.Intermediate, init=perturbations)
  (value, sown), (_, d_outs) = nnx.value_and_grad(
    lambda m, p, x: nnx.capture(loss, nnx.Intermediate, init=p)(m, x),
    argnums=(0, 1),
    has_aux=True,
  )(mha, perturbations, x)
  assert float(value) == float(captured(mha, x)[0])
  stats = sown["attention_statistics"][0]
  q, k, v = sown["attention_inputs"][0]
  assert q.shape == (1, 8, 2, 8)
  expected = attention_statistics(q, k, causal=True)
  assert float(stats["max_logit"]) == float(expected["max_logit"])
  # dO of sum(out_projected ** 2) reaches the attention output: not zero.
  d_out = d_outs["attention_output"][...]
  assert d_out.shape == q.shape and float(jnp.max(jnp.abs(d_out))) > 0


def test_non_causal_statistics_count_the_first_row_and_every_key():
  q, k = _qk(2, (1, 16, 2, 8))
  full = attention_statistics(q, k, causal=False)
  causal = attention_statistics(q, k, causal=True)
  s = np.einsum("bthd,bshd->bhts", np.asarray(q), np.asarray(k)) / np.sqrt(8)
  assert np.isclose(float(full["max_logit"]), s.max(), rtol=1e-6)
  assert float(full["max_logit"]) >= float(causal["max_logit"])


def test_the_drift_report_names_where_a_run_met_a_calibrated_kernels_miss():
  from stableattn.experiments.training_drift.edges import regime_verdicts

  rows = [
    {
      "kind": "attention",
      "run": "flash",
      "layer": 0,
      "step": 10,
      "max_logit": 5.0,
    },
    {
      "kind": "attention",
      "run": "flash",
      "layer": 2,
      "step": 40,
      "max_logit": 400.0,
    },
    {
      "kind": "attention",
      "run": "base",
      "layer": 1,
      "step": 40,
      "max_logit": 8.0,
    },
  ]
  data = {
    "command": "python launch/monitor_thresholds.py",
    "thresholds": {
      "pallas fp32": {"misses_from": 369.0},
      "jax_mha fp32": {"misses_from": 35.3},
      "xla fp32": {"misses_from": None},
    },
  }
  lines = regime_verdicts(rows, data)
  assert (
    lines[0].startswith("- base: largest logit 8")
    and "no calibrated" in lines[0]
  )
  assert "layer 2, step 40" in lines[1]
  assert "pallas fp32, jax_mha fp32" in lines[1] and "xla" not in lines[1]


def test_statistics_from_our_kernels_pass_match_the_evaluations():
  """The same step's statistics two ways: from the kernel's own row max,
  runner-up and log-sum-exp (no second pass), and from q and k."""
  import stableattn as sa
  from stableattn.numerics.monitor import KERNEL_STATISTICS
  from stableattn.training.model import AttentionSpec, ModelSpec
  from stableattn.training.trainer import OptimizerSpec, RunSpec, Trainer

  spec = ModelSpec(vocab_size=64, width=32, depth=2, heads=4, max_len=32)
  attention = AttentionSpec("pallas", sa.Options("bf16-fa2", 16, 16))
  trainer = Trainer(spec, RunSpec(attention, "bf16"), OptimizerSpec(), 4)
  state = trainer.init_state()
  # Without positions, one token repeated makes equal keys: the rows that
  # see only those tie exactly, and others may.
  state.params["positions"][...] = jnp.zeros_like(state.params["positions"])
  tokens = np.random.default_rng(0).integers(0, 64, (4, 33), dtype=np.int32)
  tokens[:, :8] = 7
  batch = trainer.shard_batch(tokens)
  _, _, from_kernel = trainer.evaluate(state, batch)
  captured = jax.jit(trainer._capture_impl)(state.params, batch)
  assert all("entropy" not in layer for layer in from_kernel)
  for layer, inputs in zip(from_kernel, captured):
    evaluated = attention_statistics(
      inputs["q"], inputs["k"], jnp.bfloat16, v_BxTxHxD=inputs["v"]
    )
    for name in KERNEL_STATISTICS:
      for key in (name, f"{name}_per_head"):
        np.testing.assert_allclose(
          np.asarray(layer[key]),
          np.asarray(evaluated[key]),
          rtol=1e-5,
          atol=1e-6,
          err_msg=key,
        )
  shares = [float(layer["tied_max_share"]) for layer in from_kernel]
  assert max(shares) > 0  # the tie was seen, by both sources


def test_kernel_statistics_are_refused_where_they_do_not_exist():
  import stableattn as sa

  q, k = _qk(4, (1, 32, 2, 16))
  with pytest.raises(ValueError, match="return_statistics=True is only"):
    sa.attention(q, k, k, implementation="reference", return_statistics=True)
  with pytest.raises(ValueError, match="split-KV.*attention_statistics"):
    sa.attention(
      q, k, k, num_splits=2, block_q=16, block_k=16, return_statistics=True
    )


@pytest.mark.parametrize("precision", ["bf16-fa2", "fp32", "bf16-fa2+exp2=on"])
def test_the_forward_with_the_monitors_row_statistics_lowers_for_cuda(
  precision,
):
  """The forward that also keeps each row's top two scores (the monitor
  from the kernel's own pass) is one Triton call with its two outputs."""
  dtype = sa.Precision.from_name(precision).dtype("inputs")
  q = jax.ShapeDtypeStruct((2, 200, 4, 64), dtype)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 64), dtype)

  def forward(q, k, v):
    return sa.attention(
      q, k, v, precision=precision, block_q=64, block_k=64, causal=True,
      interpret=False, return_statistics=True,
    )  # fmt: skip

  text = lowered_for_cuda(forward, q, kv, kv).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_compiled_monitor_statistics_match_interpret_mode():
  """The row statistics the compiled forward keeps for the monitor are the
  interpreted kernel's: ties (a repeated key) found by both."""
  q, k, v = (
    np.clip(np.round(x * 16) / 16, -4, 4).astype(np.float32)
    for x in random_qkv(4, batch=1, q_len=256, head_dim=64)
  )
  k[:, 100] = k[:, 30]
  stats = [
    sa.attention(
      q, k, v, precision="bf16-fa2", block_q=64, block_k=64, causal=True,
      interpret=interpret, return_statistics=True,
    )[1]
    for interpret in (False, True)
  ]  # fmt: skip
  for name in ("row_max", "second"):
    np.testing.assert_array_equal(stats[0][name], stats[1][name], name)
  np.testing.assert_allclose(stats[0]["lse"], stats[1]["lse"], rtol=1e-6)
  assert float(np.mean(np.asarray(stats[1]["second"] == stats[1]["row_max"])))
