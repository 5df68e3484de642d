"""A training step computes in the format it names: read from its traced
program (every matrix product's operands, the residual stream, the
logits and the loss), not from the dtypes the code asks for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stableattn as sa
from stableattn.harness.traced_program import dot_operand_formats
from stableattn.ops import dispatch
from stableattn.training.compute_format import ComputeFormat
from stableattn.training.model import AttentionSpec, ModelSpec
from stableattn.training.trainer import OptimizerSpec, RunSpec, Trainer

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
