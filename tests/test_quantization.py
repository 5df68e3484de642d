"""Policies below 16 bits: options, scales, bad input, FlashAttention-3's
Table 3 claims from rows."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stableattn as sa
from stableattn.experiments.forward.fa3_fp8 import table3_claims
from stableattn.experiments.forward.fp8_stages import stage_claims
from stableattn.experiments.forward.fp8_underflow import underflow_claims
from stableattn.experiments.forward.sage_fp8 import sage_claims
from stableattn.kernels import quantization as sa_quantization
from stableattn.kernels.quantization import hadamard_matrix, row_scales


def test_presets_and_ablations_read_back_and_print_every_choice():
  fa3 = sa.Precision.from_name("fp8-fa3")
  assert (fa3.scaling, fa3.hadamard, fa3.matmul_operands) == (
    "block",
    True,
    "fp8_e4m3",
  )
  for name in ("fp8-fa3+hadamard=off", "fp8-fa3+block_quant=off"):
    policy = sa.Precision.from_name(name)
    assert sa.Precision.from_name(policy.name) == policy
  assert sa.Precision.from_name("fp8-fa3+block_quant=off").scaling == "tensor"
  text = str(sa.Precision.from_name("fp8-baseline"))
  for piece in ("scaling=tensor", "hadamard=off", "p_scale=1", "fp8_e4m3"):
    assert piece in text


@pytest.mark.parametrize(
  "name, message",
  [
    (
      "fp8-fa3+scaling=mp",
      r"valid: \['none', 'tensor', 'block', 'token', 'mx'",
    ),
    ("fp8-fa3+scaling=nvfp4", "fp4_e2m1"),
    ("fp8-fa3+matmul_operands=int8+probs=fp16+scaling=mx", "float elements"),
    ("fp8-fa3+scores=fp22", "fp22 can only be"),
    ("fp8-fa3+smooth_k=perhaps", "valid: on, off"),
    ("bf16-fa2+hadamard=on", "below 16 bits"),
    ("bf16-fa2+smooth_k=on", "below 16 bits"),
    ("fp8-fa3+hadamard=maybe", "valid: on, off"),
    ("fp8-fa3+p_scale=-3", "finite number > 0"),
    ("fp8-fa3+key_order=random", "forward"),
    ("bf16-fa2+scaling=block", "below 16 bits"),
    ("fp8-fa3+scores=int8", "int8 can only be"),
    ("fp8-fa3+probs=fp7", "valid formats"),
  ],
)
def test_bad_policies_name_the_valid_choices(name, message):
  with pytest.raises(ValueError, match=message):
    sa.Precision.from_name(name)


def test_an_all_zero_block_gets_a_finite_scale():
  policy = sa.Precision.from_name("fp8-fa3")
  x = np.ones((1, 64, 1, 16), np.float32)
  x[:, 16:32] = 0.0  # one whole block of zeros
  scales = np.asarray(row_scales(jnp.asarray(x), policy, 16))
  assert np.isfinite(scales).all() and (scales > 0).all()
  np.testing.assert_array_equal(scales[0, 0, 16:32], 1.0)
  out = sa.attention(x, x, x, precision=policy, block_q=16, block_k=16)
  assert np.isfinite(np.asarray(out, np.float32)).all()


def test_rotation_is_orthogonal_and_needs_a_power_of_two():
  signed_h, norm = hadamard_matrix(64)
  r = signed_h.astype(np.float64) * float(norm)
  np.testing.assert_allclose(r @ r.T, np.eye(64), atol=1e-12)
  with pytest.raises(ValueError, match="power of two"):
    hadamard_matrix(48)


@pytest.mark.parametrize("preset", ["fp8-fa3", "fp8-sage"])
def test_kernel_gradients_below_16_bits_are_straight_through(preset):
  rng = np.random.default_rng(0)
  q, k, v = (
    rng.standard_normal((1, 64, 2, 16)).astype(np.float32) for _ in "qkv"
  )
  weights = rng.standard_normal(q.shape).astype(np.float32)

  def loss(q, k, v, implementation):
    out = sa.attention(
      q, k, v, implementation=implementation, precision=preset, causal=True
    )
    return jnp.sum(out.astype(jnp.float32) * weights)

  kernel = jax.grad(loss, (0, 1, 2))(q, k, v, "pallas")
  reference = jax.grad(loss, (0, 1, 2))(q, k, v, "reference")
  for got, want in zip(kernel, reference):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all()
    # The same estimator; they differ by P: quantized in the reference's
    # dV, recomputed in FP32 by the kernel (about 1%).
    assert np.linalg.norm(got - want) < 0.03 * np.linalg.norm(want)


def test_token_scales_are_per_row_and_v_scales_per_channel():
  policy = sa.Precision.from_name("fp8-sage")
  rng = np.random.default_rng(1)
  q, k, v = (
    rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in "qkv"
  )
  *_, scales = sa_quantization.prepare(q, k, v, policy, 16, 16)
  np.testing.assert_array_equal(
    np.asarray(scales.q),
    (np.abs(q).max(-1) * np.float32(1 / 448)).transpose(0, 2, 1),
  )
  assert scales.v.shape == (1, 2, 16)  # [batch, heads, head_dim]
  np.testing.assert_array_equal(
    np.asarray(scales.v), np.abs(v).max(1) * np.float32(1 / 448)
  )


def test_smoothing_k_removes_a_channel_offset_and_refuses_a_softcap():
  rng = np.random.default_rng(2)
  q, k, v = (
    rng.standard_normal((1, 128, 2, 64)).astype(np.float32) for _ in "qkv"
  )
  k += 3.0  # a per-channel offset of K, which SageAttention smooths away
  x64 = [x.astype(np.float16).astype(np.float64) for x in (q, k, v)]
  golden = sa.golden_attention(*x64, True)

  def rmse(precision):
    out = sa.attention(q, k, v, precision=precision, causal=True)
    return sa.compare(golden, out).rmse

  assert rmse("fp8-sage") < 0.7 * rmse("fp8-sage+smooth_k=off")
  with pytest.raises(ValueError, match="softcap"):
    sa.attention(q, k, v, precision="fp8-sage", softcap=30.0)


def _rows(head_dim, std, seq_len=512, **rmse):
  return [
    {
      "comparison": name,
      "seq_len": seq_len,
      "head_dim": head_dim,
      "outlier_std": std,
      "rmse_mean": value,
    }
    for name, value in rmse.items()
  ]


def test_table3_claims_are_computed_from_rows():
  rows = _rows(
    128,
    10.0,
    fp8_baseline=2.4e-2,
    fp8_baseline_fp16_probs=1.8e-2,
    fp8_fa3=9.1e-3,
    fp8_fa3_no_block_quant=9.3e-3,
    fp8_fa3_no_hadamard=2.4e-2,
  ) + _rows(
    64,
    100.0,
    fp8_baseline=0.3,
    fp8_fa3=0.33,  # no gain
    fp8_fa3_no_block_quant=0.5,
    fp8_fa3_no_hadamard=0.3,
  )
  claims = table3_claims(rows)
  assert claims["gain"]["verdict"] == "reproduced in part"
  assert claims["hadamard"]["verdict"] == "reproduced in part"
  assert claims["block_quant"]["verdict"] == "reproduced in part"
  # The FP16-P reading is measured at one setting only, where it holds.
  assert claims["gain"]["by_baseline"] == {
    "P in e4m3": "reproduced in part",
    "P in FP16": "reproduced",
  }
  assert "by_baseline" not in claims["block_quant"]
  values = {
    (m["outlier_std"], m["baseline"]): m["value"]
    for m in claims["hadamard"]["settings"]
  }
  assert values[10.0, "P in e4m3"] == pytest.approx(1.0)
  # (2.4e-2 - 9.1e-3) / (1.8e-2 - 9.1e-3): more than all of the gain
  assert values[10.0, "P in FP16"] == pytest.approx(1.674, abs=1e-3)
  assert values[100.0, "P in e4m3"] is None
  with pytest.raises(ValueError, match="no setting"):
    table3_claims(_rows(64, 10.0, fp8_fa3=1.0))
  # FlashAttention-3's rows without any baseline: no verdict either.
  with pytest.raises(ValueError, match="no setting"):
    table3_claims(
      _rows(
        64,
        10.0,
        fp8_fa3=1.0,
        fp8_fa3_no_block_quant=1.0,
        fp8_fa3_no_hadamard=1.0,
      )
    )


def _at(comparison, rmse, policy="p", **where):
  return {
    "comparison": comparison,
    "rmse_mean": rmse,
    "policy": policy,
    **where,
  }


def test_underflow_claims_are_computed_from_rows():
  where = dict(distribution="outliers", causal=False)
  rows = [
    _at("P only: forward, P x1", 2.0, **where),
    _at("P only: reversed, P x256", 1.0, **where),  # MSE 4x lower
    _at("P only: reversed, P x1", 1.9, **where),  # 1.1x: helps
    _at("P only: forward, P x256", 2.0, **where),  # 1.0x: does not
  ]
  claims = underflow_claims(rows)
  assert list(claims) == ["P only"]
  assert claims["P only"]["fix"]["verdict"] == "reproduced"
  assert claims["P only"]["fix"]["settings"][0]["value"] == pytest.approx(4.0)
  assert claims["P only"]["order"]["verdict"] == "reproduced"
  assert claims["P only"]["scale"]["verdict"] == "not reproduced"
  with pytest.raises(ValueError, match="no setting"):
    underflow_claims(rows[:1])


def test_sage_claims_judge_smoothing_only_where_k_has_a_bias():
  rows = []
  for dist, no_smoothing in (("key_bias", 2.0), ("normal", 1.0)):
    where = dict(distribution=dist, head_dim=64)
    rows += [
      _at("sage", 1.0, **where),
      _at("no_smoothing", no_smoothing, **where),
      _at("per_block", 1.2, **where),
      _at("p_e5m2", 1.02, **where),  # within noise: not "less accurate"
      _at("p_fp16", 0.95, **where),
    ]
  claims = sage_claims(rows)
  assert [m["distribution"] for m in claims["smoothing"]["settings"]] == [
    "key_bias"
  ]
  assert claims["smoothing"]["verdict"] == "reproduced"
  assert claims["granularity"]["verdict"] == "reproduced"
  assert claims["p_e4m3"]["verdict"] == "reproduced"
  assert claims["p_e5m2"]["verdict"] == "not reproduced"
  with pytest.raises(ValueError, match="no setting"):
    sage_claims([r for r in rows if r["comparison"] != "sage"])


def test_stage_claims_are_computed_from_rows():
  where = dict(distribution="normal", head_dim=64)
  rows = [
    _at("all (fp8-fa3)", 1.0, **where),
    _at("all, fp22 accumulator", 1.3, **where),
    _at("P only", 0.4, **where),
    _at("Q, K, V only", 0.9, **where),
  ]
  claims = stage_claims(rows)
  assert claims["fp22"]["verdict"] == "not reproduced"
  assert claims["dominant"] == [
    {**where, "p_only": pytest.approx(0.4), "qkv_only": pytest.approx(0.9)}
  ]
  with pytest.raises(ValueError, match="no setting"):
    stage_claims(rows[:2])


@pytest.mark.slow
def test_fp8_studies_run_end_to_end(tmp_path):
  from stableattn.configs import forward_deviation as forward_config
  from stableattn.experiments import forward

  config = forward_config.get_config("smoke")
  config.studies = "fp8_underflow,sage_fp8,fp8_stages"
  result = forward.run(config, tmp_path)
  assert result["points_measured"] > 0
  report = (tmp_path / "report.md").read_text()
  headline = json.loads((tmp_path / "headline.json").read_text())
  for name in ("fp8_underflow", "sage_fp8", "fp8_stages"):
    assert forward.STUDIES[name].title in report
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    assert name in headline
  assert set(headline["fp8_underflow"]["P only"]) == {"fix", "order", "scale"}
  assert headline["sage_fp8"]["smoothing"]["settings"][0]["value"] > 0
