"""A model's own attention tensors: captured in training, saved, audited."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import REPO, results_page, stored_run

import stableattn as sa
from stableattn.auditing import captures
from stableattn.configs import training_drift as drift_config
from stableattn.experiments.training_drift.settings import settings_from_config
from stableattn.training.trainer import Trainer


def unshifted_softmax(q, k, v, *, causal=False):
  """Attention whose softmax subtracts no maximum: exact until a logit
  passes FP32's exp range (about 88), then Inf / Inf = NaN."""
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  groups = q.shape[2] // k.shape[2]
  k32, v32 = (jnp.repeat(x, groups, axis=2) for x in (k32, v32))
  s = jnp.einsum("bthd,bshd->bhts", q32, k32) * q.shape[-1] ** -0.5
  if causal:
    t, n = s.shape[-2:]
    s = jnp.where(jnp.tril(jnp.ones((t, n), bool), n - t), s, -jnp.inf)
  p = jnp.exp(s)
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  return jnp.einsum("bhts,bshd->bthd", p, v32).astype(q.dtype)


def _layer(rng, scale):
  q = scale * rng.standard_normal((1, 32, 2, 16))
  k = scale * rng.standard_normal((1, 32, 2, 16))
  v = rng.standard_normal((1, 32, 2, 16))
  d_out = 1e-3 * rng.standard_normal((1, 32, 2, 16))
  return {"q": q, "k": k, "v": v, "d_out": d_out}


def _saved(tmp_path):
  """Step 10 with ordinary logits, step 20 whose layer 1 has logits of
  several hundred (as a run at a learning rate of 0.3 reaches)."""
  rng = np.random.default_rng(0)
  root = tmp_path / "captures"
  for step, scales in ((10, (1.0, 1.0)), (20, (1.0, 9.0))):
    captures.save(
      root,
      step,
      {i: _layer(rng, s) for i, s in enumerate(scales)},
      dtype="bfloat16",
      features={"causal": True},
      metadata={"run": "flash"},
    )
  return root


def test_a_capture_reads_back_as_saved(tmp_path):
  root = _saved(tmp_path)
  layers = captures.load(root)
  assert [x.label for x in layers] == [
    "step 10, layer 0",
    "step 10, layer 1",
    "step 20, layer 0",
    "step 20, layer 1",
  ]
  saved = np.asarray(_layer(np.random.default_rng(0), 1.0)["q"], np.float32)
  assert np.array_equal(layers[0].tensors["q"], saved)
  assert captures.load(root, steps=(20,), layers=(1,))[0].label == (
    "step 20, layer 1"
  )
  stats = captures.statistics(layers[3])
  assert stats["max_logit"] > 100 > captures.statistics(layers[0])["max_logit"]


def test_bad_capture_paths_are_refused_saying_what_is_valid(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    captures.load(tmp_path / "nowhere")
  with pytest.raises(ValueError, match="step_NNNNNN/capture.json"):
    captures.load(tmp_path)
  root = _saved(tmp_path)
  record = root / "step_000010" / "capture.json"
  record.write_text(json.dumps({**json.loads(record.read_text()), "format": 9}))
  with pytest.raises(ValueError, match="reads format 1"):
    captures.load(root)


@pytest.mark.slow  # a launcher process end to end (CI's slow tier)
def test_a_truncated_or_misshapen_capture_is_one_line_naming_the_file(
  tmp_path,
):
  """The audit command says which file is bad and exits 2, no traceback."""
  root = _saved(tmp_path / "truncated")
  file = root / "step_000010" / "layer_01.npz"
  file.write_bytes(file.read_bytes()[:200])
  other = _saved(tmp_path / "misshapen")
  bad = other / "step_000020" / "layer_00.npz"
  with np.load(bad) as data:
    arrays = {name: data[name] for name in data.files}
  np.savez(bad, **{**arrays, "k": arrays["k"][..., :-1]})
  for folder, named in ((root, file), (other, bad)):
    with pytest.raises(ValueError, match=str(named)):
      captures.load(folder)
    done = subprocess.run(
      [sys.executable, str(REPO / "launch" / "audit.py"),
       f"--workdir={tmp_path / 'audit'}", "--config=smoke",
       "--config.kernel=xla", f"--config.inputs={folder}"],
      cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(said) == 1 and str(named) in said[0], done.stderr[-2000:]
    assert not done.stdout.strip()
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # a model or a sweep end to end; CI's slow tier
def test_a_kernel_broken_at_large_logits_fails_on_the_layer_that_has_them(
  tmp_path,
):
  root = _saved(tmp_path)
  # Drawn inputs pass it: the grid's logits stay far below 88.
  drawn = sa.audit(unshifted_softmax, shapes=((1, 32, 2, 16),), repeats=2)
  assert drawn.passed, str(drawn)
  report = sa.audit(
    unshifted_softmax, shapes=((1, 32, 2, 16),), repeats=2, inputs=root
  )
  assert not report.passed
  failing = {
    r["detail"]
    for r in report.rows
    if r["regime"] == "captured" and r["nonfinite"]
  }
  assert failing == {"step 20, layer 1"}
  assert any("step 20, layer 1" in f for f in report.failures), report.failures
  assert sa.audit(
    jax.nn.dot_product_attention, shapes=((1, 32, 2, 16),), repeats=2,
    inputs=root,
  ).passed  # fmt: skip


@pytest.mark.slow  # a model or a sweep end to end; CI's slow tier
def test_the_trainer_captures_what_the_kernel_receives_and_its_cotangent():
  config = drift_config.get_config("smoke")
  s = settings_from_config(config)
  trainer = Trainer(s.model, s.runs["flash"], s.optimizer, s.batch_size)
  state = trainer.init_state(0)
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, 256, (2, s.seq_len + 1)), jnp.int32
  )
  layers = trainer.capture(state, tokens)
  assert len(layers) == s.model.depth
  shape = (2, s.seq_len, s.model.heads, s.model.width // s.model.heads)
  for layer in layers:
    assert {t: a.shape for t, a in layer.items()} == dict.fromkeys(
      captures.TENSORS, shape
    )
    # q, k, v as the kernel receives them and dO: the compute format.
    assert layer["q"].dtype == layer["k"].dtype == layer["v"].dtype
    assert layer["q"].dtype == layer["d_out"].dtype == trainer.compute_dtype
    assert float(jnp.max(jnp.abs(layer["d_out"].astype(jnp.float32)))) > 0
  # dO is the loss's gradient with respect to the attention output: the
  # deltas rowsum(dO * O) the trainer reports are built from the same dO.
  delta = trainer.deltas(state, tokens)[0][1]
  assert delta.shape == shape[:3]


@pytest.mark.slow
def test_a_training_run_captures_and_the_audit_launcher_passes_xla(tmp_path):
  run = tmp_path / "run"
  common = [sys.executable]
  subprocess.run(
    common
    + [
      "launch/training_drift.py",
      f"--workdir={run}",
      "--config=smoke",
      "--config.pairs=flash_vs_baseline",
      "--config.train.replicates=1",
      "--config.train.grad_error=False",
      "--config.attention.context_parallel=0",
      "--config.train.capture_steps=0,12",
    ],
    check=True,
    capture_output=True,
  )
  layers = captures.load(run / "captures")
  assert {x.step for x in layers} == {0, 12} and len(layers) == 4
  meta = json.loads(
    (run / "captures" / "step_000012" / "capture.json").read_text()
  )
  assert meta["run"] == "flash" and meta["policy"] == "bf16-fa2"
  # A BF16 run's tensors are BF16, and the record says the run's formats.
  assert meta["dtype"] == "bfloat16"
  assert meta["training_format"] == {
    "precision": "bf16",
    "mixed_precision": "activations",
    "compute": "bfloat16",
    "residual_stream": "bfloat16",
  }
  for layer in layers:
    for name in ("q", "k", "v", "d_out"):
      values = layer.tensors[name]
      as_bf16 = values.astype(ml_dtypes.bfloat16).astype(np.float64)
      assert np.array_equal(values, as_bf16), name
  done = subprocess.run(
    common
    + [
      "launch/audit.py",
      f"--workdir={tmp_path / 'audit'}",
      "--config=smoke",
      "--config.kernel=xla",
      f"--config.inputs={run}/captures",
    ],
    capture_output=True,
    text=True,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  rows = [
    json.loads(line)
    for line in (tmp_path / "audit" / "metrics.jsonl").read_text().splitlines()
  ]
  assert {r["detail"] for r in rows if r["regime"] == "captured"} == {
    f"step {s}, layer {i}" for s in (0, 12) for i in (0, 1)
  }
  # The report lists every captured step and layer with its statistics
  # and its verdict per rule, and every head.
  report = (tmp_path / "audit" / "report.md").read_text()
  section = report.split("## The model's own tensors, layer by layer")[1]
  for s in (0, 12):
    for i in (0, 1):
      lines = [
        x for x in section.splitlines() if f"| step {s}, layer {i} |" in x
      ]
      assert len(lines) == 2 + 2, lines  # two policies, two heads
      assert all("pass" in x for x in lines[:2]), lines
  headline = json.loads((tmp_path / "audit" / "headline.json").read_text())
  assert {"key_offset_ratio", "value_offset_ratio", "max_logit"} <= set(
    headline["captured"][0]
  )


@pytest.mark.slow
def test_the_stability_sweep_captures_where_the_largest_logit_passes(tmp_path):
  from stableattn.configs import stability as stability_config
  from stableattn.experiments import stability

  config = stability_config.get_config("smoke")
  config.variants = "flash"
  config.mitigations = "none"
  config.train.replicates = 1
  config.train.machine_pair = False
  config.train.capture_logit = 1e-3  # every cell's first logging step
  stability.run(config, tmp_path)
  layers = captures.load(tmp_path / "captures")
  sources = {x.source for x in layers}
  rates = [float(x) for x in str(config.train.learning_rates).split(",")]
  assert sources == {f"flash_bf16_none-lr{lr:g}" for lr in rates}, sources
  assert all("flash_" in x.label and "layer" in x.label for x in layers)


@pytest.mark.slow
def test_a_high_learning_rate_run_breaks_a_kernel_that_drawn_inputs_pass(
  tmp_path,
):
  """At learning rate 0.3 the smoke model's logits pass 88 by step 20 (on
  this corpus and seed, 198 and 263); a softmax without max subtraction
  passes the grid and fails those layers, named by step and layer."""
  from stableattn.experiments import training_drift

  config = drift_config.get_config("smoke")
  config.pairs = "flash_vs_baseline"
  config.train.replicates = 1
  config.train.grad_error = False
  config.attention.context_parallel = 0
  config.train.learning_rate = 0.3
  config.train.total_steps = 20
  config.train.log_every = 10
  config.train.checkpoint_every = 20
  config.train.capture_steps = "20"
  training_drift.run(config, tmp_path)
  layers = captures.load(tmp_path / "captures")
  assert max(captures.statistics(x)["max_logit"] for x in layers) > 88
  report = sa.audit(
    unshifted_softmax, shapes=((1, 32, 2, 16),), causal=True, repeats=2,
    inputs=tmp_path / "captures",
  )  # fmt: skip
  assert not report.passed
  grid = [r for r in report.rows if r["regime"] != "captured"]
  assert grid and all(r["nonfinite"] == 0 for r in grid)
  failing = {r["detail"] for r in report.rows if r["nonfinite"]}
  assert failing and all(d.startswith("step 20, layer ") for d in failing)


def test_capture_layers_beyond_the_model_are_refused_before_training():
  config = drift_config.get_config("smoke")
  config.train.capture_layers = "0,5"
  with pytest.raises(ValueError, match=r"capture_layers \[5\] do not exist"):
    settings_from_config(config)


def test_the_docs_quote_the_stored_bf16_capture_audit_as_its_rows_give_it():
  """docs/results.md's rerun on BF16 captures, from the stored audit rows."""
  stored = stored_run("captured-audit-2026-11-27")
  docs = results_page(folded=True)

  def captured_rows(audit):
    lines = (stored / audit / "metrics.jsonl").read_text().splitlines()
    rows = (json.loads(line) for line in lines)
    return [
      r
      for r in rows
      if r.get("regime") == "captured" and r.get("policy") == "bf16-framework"
    ]

  def worst(rows, rule, tensor=None):
    return max(
      r[f"{rule}_value"] / r[f"{rule}_limit"]
      for r in rows
      if r.get(f"{rule}_applies") and tensor in (None, r["tensor"])
    )

  for audit, fa, flex in (
    ("audit_pallas", "**1.98**", "**95.7**"),
    ("audit_stable", "0.178", "0.645"),
    ("audit_jax_mha", "**4.09**", "**182**"),
    ("audit_xla", "0.325", "0.779"),
  ):
    quoted = f"{fa} / {flex}"
    assert quoted in docs, quoted
    rows = captured_rows(audit)
    got = (worst(rows, "flashattention"), worst(rows, "flexattention"))
    assert [f"{v:.3g}" for v in got] == [x.strip("*") for x in (fa, flex)]
  assert worst(captured_rows("audit_pallas"), "flexattention", "dq") > 70
  records = sorted(stored.glob("captures/*/step_*/capture.json"))
  assert len(records) == 2
  for record in records:
    meta = json.loads(record.read_text())
    assert meta["dtype"] == "bfloat16"
    assert meta["training_format"]["residual_stream"] == "bfloat16"
