"""Offsets shared by every key or value: the key_shift and value_shift
invariances, the key_offset regime, Options(center_kv=True) and the
monitor's offset ratios."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import offset_inputs

import stableattn as sa
from stableattn.auditing import offsets
from stableattn.auditing.inputs import Shape, make_inputs
from stableattn.numerics.monitor import attention_statistics, offset_ratio
from stableattn.ops.registry import resolve

SHAPE = (1, 64, 2, 32)


def _errors(precision, center_kv, features=None, dtype=jnp.bfloat16):
  """Mean |error| against FP64 of out, dq, dk, dv of our kernel."""
  features = features or {}
  q, k, v = offset_inputs(dtype=dtype)
  wide = [np.asarray(x, np.float64) for x in (q, k, v)]
  golden = sa.golden_attention(*wide, **features)
  d_out = np.random.default_rng(1).standard_normal(golden.shape)
  golden_grads = sa.golden_attention_vjp(*wide, d_out, **features)

  def fn(q, k, v):
    return sa.attention(
      q, k, v, precision=precision, center_kv=center_kv, **features
    )

  out, vjp = jax.vjp(fn, q, k, v)
  grads = vjp(jnp.asarray(d_out, out.dtype))
  return [
    float(np.mean(np.abs(np.asarray(x, np.float64) - g)))
    for x, g in zip((out, *grads), (golden, *golden_grads))
  ]


# With a feature on (and on the Hopper path) in the fast tier through
# test_offsets_features.py; the causal case here is slow.
@pytest.mark.parametrize(
  "features",
  [
    pytest.param({}, id="plain"),
    pytest.param(
      {"causal": True, "key_value_seq_lengths": np.array([50], np.int32)},
      id="causal-lengths",
      marks=pytest.mark.slow,
    ),
  ],
)
def test_center_kv_removes_the_delta_error_from_dq(features):
  """Eq. 1's term is along the mean key: gone with the keys centred,
  while the output and dK, dV stay as accurate as before."""
  base = _errors("bf16-fa2", False, features)
  centred = _errors("bf16-fa2", True, features)
  assert centred[1] < base[1] / 30, (base, centred)
  for before, after in zip(base[:1] + base[2:], centred[:1] + centred[2:]):
    assert after < 1.5 * before, (base, centred)


def test_center_kv_is_the_same_function_in_fp32():
  """Exact in exact arithmetic: at FP32 every tensor is as close to FP64
  as the plain kernel's (and dQ closer)."""
  base = _errors("fp32", False, dtype=jnp.float32)
  centred = _errors("fp32", True, dtype=jnp.float32)
  assert all(c <= 1.2 * b for b, c in zip(base, centred)), (base, centred)
  assert max(centred) < 1e-5


def test_center_kv_leaves_zero_mean_inputs_bitwise_alone_and_empty_rows_zero():
  rng = np.random.default_rng(2)
  q, k, v = (
    jnp.asarray(rng.standard_normal((2, 256, 2, 32)), jnp.bfloat16)
    for _ in range(3)
  )
  # Sample means of 256 tokens stay below a quarter of the spread.
  lengths = np.array([256, 0], np.int32)
  plain = sa.attention(q, k, v, key_value_seq_lengths=lengths)
  centred = sa.attention(q, k, v, key_value_seq_lengths=lengths, center_kv=True)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(centred))
  q, k, v = offset_inputs(dtype=jnp.bfloat16)
  k2 = jnp.concatenate([k, k])
  v2 = jnp.concatenate([v, v])
  q2 = jnp.concatenate([q, q])
  out = sa.attention(
    q2, k2, v2, key_value_seq_lengths=np.array([72, 0], np.int32),
    center_kv=True,
  )  # fmt: skip
  assert not np.any(np.asarray(out[1], np.float32))
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.parametrize(
  "keywords, words",
  [
    ({"sink": np.zeros(2, np.float32)}, "sink"),
    ({"softcap": 30.0}, "softcap"),
    ({"implementation": "reference"}, "flash kernels"),
    ({"precision": "fp8-fa3"}, "quantizing|16- or 32-bit"),
    ({"return_lse": True}, "log-sum-exp"),
  ],
)
def test_center_kv_refuses_what_it_cannot_keep_exact(keywords, words):
  q, k, v = offset_inputs(dtype=jnp.bfloat16)
  keywords = {"precision": "bf16-fa2", **keywords}
  with pytest.raises(ValueError, match=words):
    sa.attention(q, k, v, center_kv=True, **keywords)


def test_shift_cases_move_only_what_they_name():
  shape = Shape(1, 64, 64, 4, 2, 32)
  q, k, v = make_inputs("normal", 0, shape)
  for name in offsets.SHIFT_INVARIANCES:
    built = offsets.shift_cases(name, shape, "normal")
    assert [c.regime for c in built] == [name] * len(offsets.SHIFTS)
    for case, shift in zip(built, offsets.SHIFTS):
      np.testing.assert_array_equal(case.q, q)
      moved, kept, same, untouched = (
        (case.k, k, case.v, v)
        if name == "key_shift"
        else (case.v, v, case.k, k)
      )
      np.testing.assert_array_equal(same, untouched)
      c = moved - kept  # one vector per head, the same for every token
      assert np.allclose(c, c[:, :1])
      rms = np.sqrt(np.mean(np.sum(kept**2, -1), axis=(0, 1)))
      np.testing.assert_allclose(np.linalg.norm(c[0, 0], axis=-1), shift * rms)
  # The key shift's direction is the one the queries see least of.
  direction = offsets.least_query_direction(q, 2)
  energy = np.sum((q.reshape(1, 64, 2, 2, 32) * direction[:, :, :, None]) ** 2)
  other = np.random.default_rng(0).standard_normal((1, 1, 2, 1, 32))
  other /= np.linalg.norm(other, axis=-1, keepdims=True)
  assert energy < np.sum((q.reshape(1, 64, 2, 2, 32) * other) ** 2)


@pytest.mark.parametrize("kernel", ["bf16-fa2", "xla"])
def test_key_shift_fails_fa2_delta_and_passes_eager_attention(kernel):
  if kernel == "xla":
    fn = resolve("xla", sa.Options(precision="bf16-framework"))
  else:
    fn = resolve("pallas", sa.Options(precision=kernel))
  report = sa.audit(
    fn,
    precision="bf16-framework",
    shapes=[SHAPE],
    repeats=1,
    invariances="key_shift,value_shift",
  )
  shifted = [r for r in report.rows if r["regime"] in offsets.SHIFT_INVARIANCES]
  assert len(shifted) == 4 * 2 * len(offsets.SHIFTS)
  if kernel == "xla":
    assert report.passed, report.failures
  else:
    assert not report.passed
    assert any("key_shift" in f and "dq" in f for f in report.failures)
    assert any("value_shift" in f and "dq" in f for f in report.failures)


@pytest.mark.parametrize(
  "precision, center_kv, passes",
  [("bf16-fa2", False, False), ("bf16-fa2-stable", False, True),
   ("bf16-fa2", True, True)],
)  # fmt: skip
def test_key_offset_regime_fails_the_base_kernel_only(
  precision, center_kv, passes
):
  fn = resolve("pallas", sa.Options(precision=precision, center_kv=center_kv))
  report = sa.audit(
    fn, precision="bf16-framework", shapes=[SHAPE], repeats=1,
    regimes="key_offset",
  )  # fmt: skip
  rows = [r for r in report.rows if r["regime"] == "key_offset"]
  assert len(rows) == 4 * len(offsets.KEY_OFFSET_CASES)
  assert report.passed == passes, report.failures
  if not passes:
    worst = max(
      r["flexattention_value"] / r["flexattention_limit"]
      for r in rows
      if r["tensor"] == "dq"
    )
    assert worst > 10  # tens of times the Baseline's error, as on captures


def test_offset_ratios_in_the_monitor():
  q, k, v = offset_inputs(key_offset=30.0, value_offset=5.0)
  k_ratio = np.asarray(offset_ratio(jnp.asarray(k), over_heads=False))
  # |mean| = 30 sqrt(d) (plus noise), spread sqrt(d).
  np.testing.assert_allclose(k_ratio, 30.0, rtol=0.05)
  stats = attention_statistics(
    jnp.asarray(q[:, :72]), jnp.asarray(k), v_BxTxHxD=jnp.asarray(v)
  )
  assert float(stats["value_offset_ratio"]) == pytest.approx(5.0, rel=0.1)
  assert len(stats["key_offset_ratio_per_head"]) == 2
  zero_mean = attention_statistics(jnp.asarray(q), jnp.asarray(q))
  assert float(zero_mean["key_offset_ratio"]) < 0.5
  assert "value_offset_ratio" not in zero_mean


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["pallas", "mosaic_gpu"])
def test_center_kv_compiled_matches_interpret_accuracy(implementation):
  """Compiled, each flash path with center_kv keeps its CPU accuracy: dQ
  within 1.5x of the Triton path's interpret mode and far below the base
  kernel's on the same offset inputs; out, dK, dV within 1.5x of
  interpret mode's."""
  features = {"causal": True}
  q, k, v = offset_inputs(dtype=jnp.bfloat16)
  wide = [np.asarray(x, np.float64) for x in (q, k, v)]
  golden = [sa.golden_attention(*wide, **features)]
  d_out = np.random.default_rng(1).standard_normal(golden[0].shape)
  golden += sa.golden_attention_vjp(*wide, d_out, **features)

  def errors(implementation, center_kv, interpret):
    def fn(q, k, v):
      return sa.attention(
        q, k, v, implementation=implementation, precision="bf16-fa2",
        center_kv=center_kv, interpret=interpret, **features,
      )  # fmt: skip

    out, vjp = jax.vjp(fn, q, k, v)
    found = (out, *vjp(jnp.asarray(d_out, out.dtype)))
    return [
      float(np.mean(np.abs(np.asarray(x, np.float64) - g)))
      for x, g in zip(found, golden)
    ]

  compiled = errors(implementation, True, False)
  interpreted = errors("pallas", True, True)
  base = errors(implementation, False, False)
  assert compiled[1] < base[1] / 30, (compiled, base)
  for c, i in zip(compiled, interpreted):
    assert c <= 1.5 * i, (compiled, interpreted)


def test_the_docs_quote_the_stored_offset_study_as_its_rows_give_it():
  import json

  from helpers import results_page, stored_run

  from stableattn.auditing import offset_mechanism

  folder = stored_run("key-offset-2026-11-28")
  rows = [
    json.loads(line)
    for line in (folder / "mechanism" / "rows.jsonl").read_text().splitlines()
  ]
  page = results_page(folded=False)
  assert offset_mechanism.table(rows) in page
  audits = offset_mechanism.load_audits(folder / "audits")
  assert offset_mechanism.kernels_table(audits) in page
  # The claims the findings rest on, read from the rows.
  captured = [r for r in rows if r["counterfactual"] == "captured"]
  large = [r for r in captured if r["key_offset"] >= 7.5]
  assert {r["capture"] for r in large} and all(
    r["dq_flex_ratio"] > 50 for r in large if r["kernel"] == "bf16-fa2"
  )
  assert all(
    r["dq_flex_ratio"] < 1 for r in captured if "stable" in r["kernel"]
  )
  verdicts = {name: h["verdict"] for name, (h, _) in audits.items()}
  assert verdicts["jax_mha"] == verdicts["pallas"] == "FAILED"
  assert verdicts["pallas_center_kv"] == verdicts["xla"] == "PASSED"


def test_the_captured_section_places_each_layer_and_gives_its_verdicts():
  from helpers import stored_run

  from stableattn.auditing import captured_report, captures

  layers = captures.load(
    stored_run("key-offset-2026-11-28")
    / "calibration/captures/smoke-lr0.3-40steps",
    steps=[10],
  )
  placed = [captured_report.layer_statistics(layer) for layer in layers]
  assert [p["label"] for p in placed] == [
    "step 10, layer 0",
    "step 10, layer 1",
  ]
  # Layer 1's keys share a component (the mechanism table's 142).
  assert placed[1]["key_offset_ratio"] > 100 > 3 > placed[0]["key_offset_ratio"]
  rows = [
    {
      "regime": "captured", "detail": p["label"],
      "policy": "bf16-framework", "tensor": tensor,
      "flexattention_value": value, "flexattention_limit": 1.0,
      "flexattention_passed": value <= 1.0, "flexattention_applies": True,
    }
    for p, value in zip(placed, (0.5, 200.0))
    for tensor in ("out", "dq")
  ]  # fmt: skip
  lines = captured_report.section(rows, placed, ("flexattention",))
  text = "\n".join(lines)
  assert "| step 10, layer 0 | bf16-framework |" in text
  assert "pass 0.5x (out)" in text and "FAIL 2e+02x (out)" in text
  heads = [x for x in lines[-1].splitlines() if x.startswith("| step 10")]
  assert len(heads) == 4  # two layers of two heads


def test_the_docs_quote_the_stored_training_runs_as_their_rows_give_them():
  import json

  from helpers import results_page, stored_run

  from stableattn.auditing import offset_mechanism

  folder = stored_run("key-offset-2026-11-28")
  runs = {
    f"lr {lr}": [
      json.loads(line)
      for line in (folder / f"training-lr{lr}" / "metrics-selected.jsonl")
      .read_text()
      .splitlines()
    ]
    for lr in ("0.03", "0.3")
  }
  assert offset_mechanism.training_table(runs) in results_page(folded=False)


def test_the_running_sum_cosine_sees_a_bias_that_keeps_its_direction():
  from stableattn.training.drift import attention_grad_error_rows

  rng = np.random.default_rng(0)
  bias = rng.standard_normal((8, 8))
  exact = {"w": np.ones((8, 8))}
  running, noisy = None, None
  for step in range(6):
    error = {"w": bias + 0.3 * rng.standard_normal((8, 8))}
    (row,) = attention_grad_error_rows("r", step, error, exact, None, running)
    running = {"w": error["w"] + (running["w"] if running else 0.0)}
  assert row["cos_running_sum"] > 0.9
  for step in range(6):
    error = {"w": rng.standard_normal((8, 8))}
    (row,) = attention_grad_error_rows("r", step, error, exact, None, noisy)
    noisy = {"w": error["w"] + (noisy["w"] if noisy else 0.0)}
  assert abs(row["cos_running_sum"]) < 0.5


def test_the_docs_quote_the_stored_price_of_the_fixes():
  import json

  from helpers import REPO, stored_run

  from stableattn.auditing import offset_mechanism

  rows = [
    json.loads(line)
    for line in (stored_run("key-offset-2026-11-28") / "price_interpret.jsonl")
    .read_text()
    .splitlines()
  ]
  table = offset_mechanism.price_table(rows)
  assert table.count("\n") == 5  # four points, each timed
  assert table in (REPO / "docs" / "precision.md").read_text()


def test_the_captured_calibration_is_fitted_and_names_the_runs_own_kernel():
  from stableattn.auditing import map_check, monitor_verdict

  # Layers where bf16-fa2 missed exactly where the keys shared a large
  # component or the rows tied; jax_mha everywhere.
  points = {
    "bfloat16": {
      f"l{i}": {"key_offset_ratio": o, "near_tied_share": t, "max_logit": 9.0}
      for i, (o, t) in enumerate(
        [(0.5, 0.0), (1.0, 0.01), (8.0, 0.0), (60.0, 0.02), (1.2, 0.6)]
      )
    }
  }
  misses = {
    "pallas bf16-fa2": {"l0": False, "l1": False, "l2": True, "l3": True,
                        "l4": True},
    "jax_mha bf16": {f"l{i}": True for i in range(5)},
    "xla bf16": {f"l{i}": False for i in range(5)},
  }  # fmt: skip
  fitted = map_check.fit_captured(points, misses)
  assert all(e["errors"] == 0 for e in fitted.values()), fitted
  assert 1.0 < fitted["pallas bf16-fa2"]["key_offset_ratio"] <= 8.0
  assert fitted["jax_mha bf16"]["key_offset_ratio"] == 0.0
  assert fitted["xla bf16"]["key_offset_ratio"] == float("inf")
  confusion = map_check.captured_confusion(points, misses, fitted)
  assert confusion["pallas bf16-fa2"]["recall"] == 1.0
  # Stored and read back (infinity as null), the verdict names the run's
  # own kernel where a head's keys share a component.
  from stableattn.auditing import thresholds

  data = {**thresholds.load(), "captured": {"kernels": {
    name: {k: (None if v == float("inf") else v) for k, v in e.items()}
    for name, e in fitted.items()
  }}}  # fmt: skip
  records = [
    {
      "step": step,
      "layer": 1,
      "max_logit_per_head": np.array([20.0, 15.0]),
      "near_tied_share_per_head": np.array([0.0, 0.0]),
      "key_offset_ratio_per_head": np.array([offset, 0.3]),
    }
    for step, offset in ((10, 0.4), (20, 90.0), (30, 50.0))
  ]
  found = monitor_verdict.verdict(records, data, kernel="pallas bf16-fa2")
  assert found["own_kernel_misses"] is True
  assert found["lines"][0].startswith("The run's own kernel, `pallas bf16-fa2`")
  assert "first at step 20" in found["lines"][0]
  assert "key offset 90" in found["lines"][0]
  quiet = monitor_verdict.verdict(records[:1], data, kernel="pallas bf16-fa2")
  assert quiet["own_kernel_misses"] is False
  assert "predicted to pass" in quiet["lines"][0]


def test_the_captured_calibration_is_fitted_from_stored_captures_as_stored():
  """The monitor's captured calibration is what `fit_captured` gives on
  the stored calibration layers and audits, and the docs' held-out table
  is what it gives on the held-out ones."""
  from helpers import results_page, stored_run

  from stableattn.auditing import map_check, thresholds

  root = stored_run("key-offset-2026-11-28")

  def points_and_misses(part):
    points = map_check.layer_points(root / part / "captures")
    misses = {}
    for audit in sorted((root / part).glob("audit_*")):
      if audit.is_dir():
        misses.update(map_check.audit_misses(audit))
    return points, misses

  fitted = map_check.fit_captured(*points_and_misses("calibration"))
  stored = map_check.captured_entries(thresholds.load())
  assert {
    n: {a: e[a] for a in map_check.CAPTURED_AXES} for n, e in fitted.items()
  } == {
    n: {a: e[a] for a in map_check.CAPTURED_AXES} for n, e in stored.items()
  }
  held = map_check.captured_confusion(*points_and_misses("held-out"), stored)
  assert len(held["pallas bf16-fa2"]["layers"]) == 25
  assert map_check.confusion_table(held) in results_page(folded=False)
