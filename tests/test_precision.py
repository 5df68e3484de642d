import jax
import jax.numpy as jnp
import pytest

import stableattn as sa
from stableattn.numerics.formats import format_name
from stableattn.numerics.precision import STAGES


def test_every_preset_resolves_and_has_every_stage():
  for name in sa.preset_names():
    policy = sa.Precision.from_name(name)
    assert policy.name == name
    assert set(policy.stages()) == set(STAGES)


def test_all_format_presets_round_everything_but_accumulation():
  bf16 = sa.Precision.from_name("bf16")
  assert bf16.matmul_accum == "fp32"
  others = {s: f for s, f in bf16.stages().items() if s != "matmul_accum"}
  assert set(others.values()) == {"bf16"}
  assert set(sa.Precision.from_name("fp64").stages().values()) == {"fp64"}


def test_fa2_preset_keeps_statistics_and_accumulators_in_fp32():
  p = sa.Precision.from_name("fp16-fa2")
  low = {s for s, f in p.stages().items() if f == "fp16"}
  assert low == {"inputs", "matmul_operands", "probs", "output"}


def test_framework_preset_stores_scores_and_probs_in_format():
  p = sa.Precision.from_name("bf16-framework")
  assert (p.scores, p.probs, p.softmax_stats, p.matmul_accum) == (
    "bf16",
    "bf16",
    "fp32",
    "fp32",
  )


def test_unknown_preset_lists_valid_names():
  with pytest.raises(ValueError, match="bf16-fa2") as info:
    sa.Precision.from_name("bf17")
  assert "bf17" in str(info.value)


def test_non_string_precision_is_rejected():
  with pytest.raises(ValueError, match="preset name"):
    sa.Precision.from_name(16)


def test_with_stage_changes_one_stage_and_labels_it():
  base = sa.Precision.from_name("bf16-fa2")
  changed = base.with_stage(probs="fp32", scores=jnp.bfloat16)
  assert changed.probs == "fp32" and changed.scores == "bf16"
  assert changed.inputs == base.inputs
  assert changed.name == "bf16-fa2+probs=fp32+scores=bf16"
  # A change to the format a stage already has is not part of the label.
  assert base.with_stage(inputs="bf16").name == "bf16-fa2"


def test_with_stage_rejects_unknown_stage_and_format():
  base = sa.Precision.from_name("fp32")
  with pytest.raises(ValueError, match="valid stages"):
    base.with_stage(softmax="fp16")
  with pytest.raises(ValueError, match="valid formats"):
    base.with_stage(scores="fp12")


def test_str_names_preset_and_every_stage():
  text = str(sa.Precision.from_name("fp16-framework"))
  assert text.startswith("fp16-framework")
  for stage in STAGES:
    assert f"{stage}=" in text


def test_format_aliases():
  assert format_name("bfloat16") == "bf16"
  assert format_name(jnp.float16) == "fp16"
  assert format_name("FP32") == "fp32"


def test_fp64_policy_without_x64_raises_clear_error():
  q = jnp.ones((1, 4, 1, 8), jnp.float32)
  jax.config.update("jax_enable_x64", False)
  try:
    with pytest.raises(ValueError, match="jax_enable_x64"):
      sa.attention(q, q, q, precision="fp64", implementation="reference")
  finally:
    jax.config.update("jax_enable_x64", True)


def test_a_policy_name_with_stage_changes_reads_back():
  changed = sa.Precision.from_name("bf16-fa2").with_stage(
    out_accum="bf16", scores="bf16"
  )
  again = sa.Precision.from_name(changed.name)
  assert again == changed
  assert again.out_accum == "bf16" and again.softmax_stats == "fp32"


@pytest.mark.parametrize(
  "name, message",
  [
    ("bf16-fa2+out_accum", "stage=format"),
    ("bf16-fa2+accumulator=bf16", "valid stages"),
    ("bf16-fa2+out_accum=bf8", "valid formats"),
    ("bf17+out_accum=bf16", "valid presets"),
    ("fp32+score_chunk=8", "power of two >= 16"),
    ("fp32+score_chunk=48", "power of two >= 16"),
    ("fp32+score_chunk=x", "integer"),
    ("bf16-fa2+score_chunk=16+mma_chunk=16", "Use one of them"),
  ],
)
def test_bad_stage_changes_in_a_name_say_what_is_valid(name, message):
  with pytest.raises(ValueError, match=message):
    sa.Precision.from_name(name)


def test_natural_policy_of_each_kernel():
  from stableattn.numerics.precision import natural_policy

  assert natural_policy("bf16", "flash") == "bf16-fa2"
  assert natural_policy("float16", "baseline") == "fp16-framework"
  assert natural_policy("fp32", "flash") == natural_policy("fp32", "baseline")
  with pytest.raises(ValueError, match="kernel must be one of"):
    natural_policy("bf16", "cudnn")
