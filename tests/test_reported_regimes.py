"""The regimes where users' kernels broke (`reported_regimes.py`): each
builds what it names, NaN padding never reaches our implementations, and
a kernel broken in one of them passes the default audit and fails there.
"""

import edge_kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stableattn as sa
from stableattn.auditing import regimes
from stableattn.auditing.inputs import Shape
from stableattn.contract import masking
from stableattn.contract.features import Features
from stableattn.ops.registry import resolve

SHAPE = Shape(1, 64, 64, 2, 2, 32)
REPORTED = (
  "poisoned_padding",
  "finite_mask",
  "score_ramp",
  "empty_splits",
  "sink_extremes",
  "gqa_groups",
)


def _allowed(case):
  spec, ops = Features.of(case.features).split(case.q.shape, case.k.shape)
  return np.asarray(
    masking.allowed_pairs(spec, ops, case.q.shape[1], case.k.shape[1])
  )


def test_the_new_regimes_are_part_of_all_and_selectable_by_name():
  assert set(REPORTED) <= set(regimes.parse("all"))
  assert regimes.parse("poisoned_padding,gqa_groups") == (
    "poisoned_padding",
    "gqa_groups",
  )


def test_poisoned_keys_are_exactly_those_no_query_attends():
  cases = regimes.edge_cases("poisoned_padding", SHAPE, "bf16")
  assert {np.isnan(c.poison_value) for c in cases} == {True, False}
  for case in cases:
    attended = _allowed(case).any(axis=(1, 2))  # [B, S]
    assert case.poison.any(), case.detail
    np.testing.assert_array_equal(case.poison, ~attended, case.detail)


def test_small_logits_reach_the_reported_trigger_with_every_mask():
  cases = regimes.edge_cases("small_logits", SHAPE, "fp32")
  masked = [c for c in cases if c.features]
  assert {tuple(c.features) for c in masked} == {
    ("key_value_seq_lengths",),
    ("segment_ids",),
    ("mask",),
    ("bias",),
  }
  for case in masked:
    assert case.k.shape[1] % 128 == 64
    scores = np.einsum("bthd,bshd->bhts", case.q, case.k) / np.sqrt(32)
    lse = np.log(np.exp(scores).sum(-1))
    assert np.all(lse < -88.7)


def test_finite_masks_cover_full_rows_and_whole_tiles_without_infinity():
  cases = regimes.edge_cases("finite_mask", SHAPE, "bf16")
  floors = [
    float(np.asarray(c.features["bias"], np.float64).min()) for c in cases
  ]
  assert np.isclose(floors[1], -1e9) and floors[2] == -65504.0
  assert floors[0] < -3e38  # BF16's minimum, finite
  for case in cases:
    bias = np.asarray(case.features["bias"], np.float64)
    assert np.all(np.isfinite(bias))
    masked = bias[0, 0] < 0
    assert masked[:, 64:256].all()  # a whole 64- and a whole 128-key tile
    np.testing.assert_array_equal(masked.all(axis=1), case.unjudged_rows[0])
    assert 0 < case.unjudged_rows.sum() < SHAPE.q_len


def test_score_ramps_raise_the_row_max_in_every_block():
  for case, step in zip(
    regimes.edge_cases("score_ramp", SHAPE, "fp32"), (0.5, 4, 20)
  ):
    s = np.einsum("bthd,bshd->bhts", case.q, case.k) / np.sqrt(32)
    block_max = s.reshape(*s.shape[:3], -1, 64).max(-1)
    rise = np.diff(block_max, axis=-1)
    assert np.median(rise) == pytest.approx(step, rel=0.5)
    if step >= 4:
      assert np.all(rise > 0)


def test_groups_sinks_splits_and_head_dims_are_built_as_named():
  groups = regimes.edge_cases("gqa_groups", SHAPE, "fp32")
  assert [c.q.shape[2] // c.k.shape[2] for c in groups] == [8, 8, 64]
  assert groups[0].q.shape[2] == 16 and groups[0].q.shape[0] == 2
  sinks = regimes.edge_cases("sink_extremes", SHAPE, "fp32")
  assert [float(c.features["sink"][0]) for c in sinks[:4]] == [-20, 0, 20, 100]
  cancel = sinks[4]
  assert np.array_equal(cancel.q[:, 1::2], cancel.q[:, 0::2])
  ratio = cancel.d_out[:, 1::2] / cancel.d_out[:, 0::2]
  assert np.allclose(ratio, -1, atol=1e-2) and not np.allclose(ratio, -1)
  splits = regimes.edge_cases("empty_splits", SHAPE, "fp32")
  assert all(c.split for c in splits) and splits[-1].empty_rows.any()
  dims = regimes.edge_cases("head_dims", SHAPE, "fp32")
  assert [(c.k.shape[3], c.v.shape[3]) for c in dims] == [
    (192, 128),
    (576, 512),
  ]


def _poisoned(x, lengths, value):
  x = np.array(x)
  for b, n in enumerate(lengths):
    x[b, n:] = value
  return x


@pytest.mark.parametrize("implementation", ["pallas", "reference", "xla"])
def test_nan_in_padding_never_reaches_our_outputs_or_gradients(implementation):
  """flash-attention #1745's symptom, on our three implementations: the
  poisoned run is bit for bit the clean run, output and gradients."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((2, 32, 2, 16)).astype(np.float32)
             for _ in range(3))  # fmt: skip
  lengths = np.array([32, 11], np.int32)

  def run(k, v):
    def fn(q, k, v):
      return sa.attention(
        q, k, v, implementation=implementation, precision="fp32",
        key_value_seq_lengths=lengths,
      )  # fmt: skip

    out, vjp = jax.vjp(fn, q, jnp.asarray(k), jnp.asarray(v))
    return [np.asarray(x) for x in (out, *vjp(jnp.ones_like(out)))]

  clean = run(k, v)
  poisoned = run(_poisoned(k, lengths, np.nan), _poisoned(v, lengths, np.inf))
  for a, b in zip(clean, poisoned):
    np.testing.assert_array_equal(a, b)


def test_a_paged_caches_unused_slots_and_pages_never_reach_the_output():
  """vLLM #936's symptom: NaN and Inf in a sequence's unused slots, in
  its table's pages past its length and in pages no table names."""
  rng = np.random.default_rng(0)
  k, v = (rng.standard_normal((8, 64, 2, 32)).astype(np.float32)
          for _ in range(2))  # fmt: skip
  q = rng.standard_normal((2, 1, 4, 32)).astype(np.float32)
  table = np.array([[3, 1, 6], [0, 5, 2]], np.int32)
  lengths = np.array([150, 70], np.int32)
  dirty_k, dirty_v = k.copy(), v.copy()
  for x in (dirty_k, dirty_v):
    x[6, 22:] = np.nan  # sequence 0: keys 150-191
    x[5, 6:] = np.inf  # sequence 1: keys 70-127
    x[[2, 4, 7]] = np.nan  # sequence 1's third page; pages no table names

  def run(k, v, implementation):
    return np.asarray(sa.paged_attention(
      q, k, v, table, implementation=implementation, precision="fp32",
      key_value_seq_lengths=lengths,
    ))  # fmt: skip

  for implementation in ("pallas", "reference"):
    np.testing.assert_array_equal(
      run(k, v, implementation), run(dirty_k, dirty_v, implementation)
    )


@pytest.mark.slow
def test_jax_nn_lets_nan_padding_through_and_the_audit_names_it():
  """jax.nn.dot_product_attention with key_value_seq_lengths (its XLA
  path, as users call it): NaN beyond a length reaches every row."""
  report = sa.audit(
    resolve("jax_nn"), precision="fp32", shapes=((1, 32, 2, 16),),
    regimes="poisoned_padding", repeats=1,
  )  # fmt: skip
  assert not report.passed
  leaks = [f for f in report.failures if "NaN/Inf values" in f]
  assert leaks and all("regime poisoned_padding" in f for f in leaks)
  bitwise = [r["poison_bitwise"] for r in report.rows if "poison_bitwise" in r]
  assert bitwise and not all(bitwise)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(edge_kernels.REPORTED))
def test_each_reported_break_passes_the_default_audit_and_fails_its_regime(
  name,
):
  fn = getattr(edge_kernels, name)
  regime, expected = edge_kernels.REPORTED[name]
  assert sa.audit(fn, repeats=2).passed
  report = sa.audit(fn, shapes=((1, 64, 2, 32),), repeats=1, regimes=regime)
  assert any(expected in f for f in report.failures), report.failures


@pytest.mark.slow
@pytest.mark.parametrize(
  "precision", ["fp8-fa3", "bf16-fa2", "fp16-fa2-stable"]
)
def test_no_policy_lets_padding_reach_a_result(precision):
  """Every path of ours over poisoned keys: lengths, segments, split-KV
  and quantized scales (an Inf in padding would set FP8's scale)."""
  cases = regimes.edge_cases("poisoned_padding", Shape(2, 64, 64, 2, 2, 32),
                             "bf16")  # fmt: skip
  for case in cases:
    for split in (None, {"num_splits": 4}):
      if split and case.q.shape[1] != 1:
        continue
      options = sa.Options(precision=precision, **(split or {}))
      args = [jnp.asarray(x, jnp.bfloat16) for x in (case.q, case.k, case.v)]
      keys = case.poison[:, :, None, None]
      bad = [jnp.where(keys, case.poison_value, x) for x in args[1:]]
      clean = sa.attention(*args, options=options, **case.features)
      dirty = sa.attention(args[0], *bad, options=options, **case.features)
      np.testing.assert_array_equal(
        np.asarray(clean, np.float32), np.asarray(dirty, np.float32)
      )


def test_the_report_says_whether_poisoned_runs_were_the_clean_runs():
  from stableattn.auditing.report import edge_checks_section

  def row(tensor, bitwise, moved, **more):
    return {"policy": "fp32", "shape": "B2 T8", "detail": "lengths (NaN)",
            "tensor": tensor, "poison_bitwise": bitwise,
            "poison_max_diff": moved, **more}  # fmt: skip

  text = "\n".join(edge_checks_section([
    row("out", True, 0.0), row("dq", False, float("nan")),
    {"policy": "fp32", "shape": "B1 T8", "detail": "bias -1e9",
     "masked_rows_vs_zero": 0.25, "masked_rows_vs_mean_v": 1e-8},
  ]))  # fmt: skip
  assert "| fp32 | B2 T8 | lengths (NaN) | **no** | nan |" in text
  assert "| fp32 | B1 T8 | bias -1e9 | 0.25 | 1e-08 |" in text
  assert edge_checks_section([{"policy": "fp32", "tensor": "out"}]) == []
