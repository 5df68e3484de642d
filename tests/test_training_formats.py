"""A training step computes in the format it names: read from its traced
program (every matrix product's operands, the residual stream, the
logits and the loss), not from the dtypes the code asks for."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import stableattn as sa
from stableattn.harness.traced_program import dot_operand_formats
from stableattn.numerics.monitor import attention_statistics
from stableattn.ops import dispatch
from stableattn.training import compute_format
from stableattn.training.compute_format import ComputeFormat
from stableattn.training.model import AttentionSpec, ModelSpec
from stableattn.training.trainer import OptimizerSpec, RunSpec, Trainer

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = ModelSpec(vocab_size=32, width=16, depth=2, heads=2, max_len=8)
# Attention's own program (sa.attention's jit, our kernel included) computes
# under its precision policy; tests/test_exact_rounding*.py hold that.
ATTENTION = (dispatch._compute.__name__, "pallas_call")
BATCH = np.arange(4 * 9, dtype=np.int32).reshape(4, 9) % 32
FRAMEWORK = {"fp32": "fp32", "bf16": "bf16-framework", "fp16": "fp16-framework"}


def _trainer(precision, mixed="activations", kind="reference", policy=None):
  options = sa.Options(policy or FRAMEWORK[precision], 8, 8)
  run = RunSpec(
    AttentionSpec(kind, options), precision=precision, mixed_precision=mixed
  )
  return Trainer(TINY, run, OptimizerSpec(total_steps=2, warmup_steps=0), 4)


def traced_formats(trainer, skip=ATTENTION) -> dict:
  """What one training step computes in, from its jaxpr and shapes."""
  state = trainer.init_state()
  batch = trainer.shard_batch(BATCH)
  lr = jnp.float32(1.0)
  dots = dot_operand_formats(trainer._step_impl, state, batch, lr, skip=skip)
  inputs = batch[:, :-1]  # the step's own: tokens predicting the next
  stream, _ = jax.eval_shape(
    lambda p, t: trainer.model(p).residual_stream(t), state.params, inputs
  )
  logits, _ = jax.eval_shape(
    lambda p, t: trainer.model(p)(t), state.params, inputs
  )
  _, metrics = jax.eval_shape(trainer._step_impl, state, batch, lr)
  # q, k and v as every layer's attention receives them.
  layers = jax.eval_shape(trainer._capture_impl, state.params, batch)
  return {
    "dots": dots,
    "attention_inputs": {
      str(layer[name].dtype) for layer in layers for name in "qkv"
    },
    "residual_stream": {str(x.dtype) for x in stream},
    "logits": str(logits.dtype),
    "loss": str(metrics["loss"].dtype),
    "parameters": {str(p.dtype) for p in jax.tree.leaves(state.params)},
  }


# precision, convention -> (every product's operands outside attention,
# residual stream): docs/experiments.md's table.
TABLE = {
  ("fp32", "activations"): ("float32", "float32"),
  ("bf16", "activations"): ("bfloat16", "bfloat16"),
  ("fp16", "activations"): ("float16", "float16"),
  ("bf16", "autocast"): ("bfloat16", "float32"),
  ("fp16", "autocast"): ("float16", "float32"),
}


def mismatches(got: dict, precision: str, mixed: str) -> list[str]:
  """Where a traced step departs from TABLE's row, one line each."""
  operands, stream = TABLE[(precision, mixed)]
  wanted = {
    # Projections, MLP and head, forward and backward; attention's inputs.
    "products": ({(operands, operands)}, set(got["dots"])),
    "attention inputs": ({operands}, got["attention_inputs"]),
    "residual stream": ({stream}, got["residual_stream"]),
    # Master weights, logits for the loss and the loss itself stay FP32.
    "parameters": ({"float32"}, got["parameters"]),
    "logits": ("float32", got["logits"]),
    "loss": ("float32", got["loss"]),
  }
  return [f"{k}: {b} (want {a})" for k, (a, b) in wanted.items() if a != b]


@pytest.mark.parametrize("precision, mixed", list(TABLE))
def test_every_product_and_the_residual_stream_are_in_the_named_format(
  precision, mixed
):
  got = traced_formats(_trainer(precision, mixed))
  assert not mismatches(got, precision, mixed)
  # Six matmuls a layer and the head, each once forward and twice backward.
  assert sum(got["dots"].values()) == 3 * (6 * TINY.depth + 1)


def test_a_model_whose_embedding_promotes_to_fp32_fails_the_check(monkeypatch):
  """nnx.Embed's own default (its table's FP32), the regression the check
  exists for, built on purpose: every layer after it follows to FP32."""
  monkeypatch.setattr(
    ComputeFormat,
    "activation_dtype",
    property(lambda self: jnp.dtype(jnp.float32)),
  )
  found = mismatches(traced_formats(_trainer("bf16")), "bf16", "activations")
  assert found == ["residual stream: {'float32'} (want {'bfloat16'})"]


def test_our_kernel_computes_in_the_format_outside_its_own_policy():
  got = traced_formats(_trainer("bf16", kind="pallas", policy="bf16-fa2"))
  assert not mismatches(got, "bf16", "activations")


def test_an_unknown_convention_is_named():
  with pytest.raises(ValueError, match="mixed_precision 'amp'.*autocast"):
    RunSpec(AttentionSpec(), precision="bf16", mixed_precision="amp")


def test_a_run_record_names_its_residual_stream_by_convention():
  record = RunSpec(AttentionSpec(), "bf16", "autocast").compute_format.record()
  # Autocast casts only the matmuls' operands: q, k and v arrive in BF16,
  # the residual stream stays FP32 (docs/experiments.md's table).
  assert record == {
    "precision": "bf16",
    "mixed_precision": "autocast",
    "compute": "bfloat16",
    "residual_stream": "float32",
  }


# Tensor class -> products (forward and two backward each) that move to
# FP32 operands when it is kept in FP32; attention's own are skipped.
FP32_PRODUCTS = {
  "embedding": 0,  # a lookup and an add, no product
  "residual_stream": 0,
  "attention_projections": 3 * 4 * TINY.depth,
  "attention": 0,
  "mlp": 3 * 2 * TINY.depth,
  "head": 3,
}


def _kept(classes, precision="bf16", policy=None):
  run = RunSpec(
    AttentionSpec("reference", sa.Options(policy or "bf16-framework", 8, 8)),
    precision=precision,
    fp32_classes=tuple(classes),
  )
  return Trainer(TINY, run, OptimizerSpec(total_steps=2, warmup_steps=0), 4)


@pytest.mark.parametrize("tensor_class", list(FP32_PRODUCTS))
def test_a_class_kept_in_fp32_computes_in_fp32_and_nothing_else_does(
  tensor_class,
):
  got = traced_formats(_kept([tensor_class]))
  fp32 = FP32_PRODUCTS[tensor_class]
  total = 3 * (6 * TINY.depth + 1)
  want = {("float32", "float32"): fp32, ("bfloat16", "bfloat16"): total - fp32}
  assert got["dots"] == {pair: n for pair, n in want.items() if n}
  stream = "float32" if tensor_class == "residual_stream" else "bfloat16"
  assert got["residual_stream"] == {stream}
  projections = tensor_class == "attention_projections"
  assert got["attention_inputs"] == {"float32" if projections else "bfloat16"}
  assert got["parameters"] == {"float32"}


def test_every_class_kept_in_fp32_is_the_fp32_run_bit_for_bit():
  """The classes cover the whole model: no rounding is left outside them."""
  every = _kept(compute_format.FP32_CLASSES, policy="fp32")
  fp32 = _trainer("fp32")
  batch = every.shard_batch(BATCH)
  one, _ = every.step(every.init_state(), batch)
  other, _ = fp32.step(fp32.init_state(), batch)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(other.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp32_classes_are_checked():
  with pytest.raises(ValueError, match="'norms'.*valid.*embedding"):
    ComputeFormat("bf16", fp32_classes=("norms",))
  with pytest.raises(ValueError, match="an fp32 run computes every class"):
    ComputeFormat("fp32", fp32_classes=("mlp",))
  assert ComputeFormat("bf16", fp32_classes=("attention",)).record() == {
    "precision": "bf16",
    "mixed_precision": "activations",
    "compute": "bfloat16",
    "residual_stream": "bfloat16",
    "fp32_classes": ["attention"],
  }


def test_the_ablation_runs_keep_attention_policy_in_fp32_only_where_named():
  from stableattn.configs import training_drift
  from stableattn.experiments.training_drift.settings import (
    settings_from_config,
  )

  s = settings_from_config(training_drift.get_config("ablation"))
  policies = {
    name: run.attention.options.precision.name
    for name, run in s.physical_runs.items()
  }
  assert policies["bf16_attention_in_fp32"] == "fp32"
  assert policies["bf16_only_attention"] == "bf16-framework"
  assert policies["bf16_mlp_in_fp32"] == "bf16-framework"
  assert s.physical_runs["bf16_only_mlp"].fp32_classes == tuple(
    c for c in compute_format.FP32_CLASSES if c != "mlp"
  )


def _docs_flax_model():
  """The Flax drop-in model of docs/monitor.md, as its page defines it."""
  page = (REPO / "docs" / "monitor.md").read_text()
  block = re.search(
    r"<!-- test: python -->\n```python\n(.*?)```", page, flags=re.DOTALL
  ).group(1)
  definitions = block.split("\nmodel = TinyLM(")[0]
  namespace = {}
  exec(compile(definitions, "docs/monitor.md", "exec"), namespace)
  return namespace


def _flax_step_formats(docs, dtype):
  """(products' operand formats, the step's outputs' shapes, the model) of
  one train_step of the docs' TinyLM computing in `dtype`."""
  model = docs["TinyLM"](nnx.Rngs(0), width=16, heads=2, vocab=32, dtype=dtype)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  tokens = jnp.asarray(BATCH)
  _, perturbations = nnx.capture(docs["loss_fn"], nnx.Perturbation)(
    model, tokens
  )
  args = (model, optimizer, perturbations, tokens)
  monitor = (attention_statistics.__name__,)  # FP32 by design: observes
  step = docs["train_step"]
  dots = dot_operand_formats(step, *args, skip=ATTENTION + monitor)
  return dots, jax.eval_shape(step, *args), model


def test_the_flax_drop_in_model_of_the_docs_computes_in_bf16():
  docs = _docs_flax_model()
  dots, (loss, sown, _), model = _flax_step_formats(docs, jnp.bfloat16)
  # q, k, v, out projections, the head: forward and two backward each.
  assert dots == {("bfloat16", "bfloat16"): 3 * 5}
  assert loss.dtype == jnp.float32
  q, _, _ = sown["attention_inputs"][0]
  assert q.dtype == jnp.bfloat16
  tokens = jnp.asarray(BATCH)
  stream = jax.eval_shape(lambda m, t: m.embed(t), model, tokens)
  assert stream.dtype == jnp.bfloat16
  assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
    jnp.dtype(jnp.float32)
  }
  # Without the dtype, nnx's defaults: the same check sees FP32 products.
  dots, _, _ = _flax_step_formats(docs, None)
  assert ("float32", "float32") in dots


def test_the_ablation_runs_only_when_asked_for():
  from stableattn.configs import training_drift
  from stableattn.experiments.training_drift.settings import (
    settings_from_config,
  )

  default = settings_from_config(training_drift.get_config())
  assert not [p for p in default.pairs if "in_fp32" in p or "only" in p]
  assert not [r for r in default.physical_runs if r.startswith("bf16_")]


def test_runs_that_differ_only_in_how_they_start_share_their_programs():
  from stableattn.configs import training_drift as drift_config
  from stableattn.experiments.training_drift import settings_from_config

  s = settings_from_config(drift_config.get_config("smoke"))
  runs = s.physical_runs
  trainers = {
    name: Trainer(s.model, runs[name], s.optimizer, s.batch_size)
    for name in ("base", "seed", "rerun", "fp32")
  }
  assert runs["seed"].init_seed != runs["base"].init_seed
  assert runs["rerun"].replica != runs["base"].replica
  for name in ("seed", "rerun"):
    assert trainers[name]._step is not trainers["base"]._step
    trainers[name].share_programs(trainers["base"])
    assert trainers[name]._step is trainers["base"]._step
    assert trainers[name]._eval is trainers["base"]._eval
  # Another compute format is another program.
  with pytest.raises(ValueError, match="more than its initialization"):
    trainers["fp32"].share_programs(trainers["base"])
