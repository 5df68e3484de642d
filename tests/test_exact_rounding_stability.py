"""The stability options and presets (docs/precision.md, "Stable
presets") run as documented: the kernel's forward and backward against
the emulator (`emulator_stability.py`), bit for bit where the rounding
is the policy's; and each option changes what it says it changes."""

import jax
import jax.numpy as jnp
import numpy as np
import policy_emulator as emu
import pytest
from emulator_checks import SHAPES, check_against_emulator, emulator_inputs
from helpers import sampled

import stableattn as sa

STABILITY = ("delta_source", "softmax_residuals", "softmax_sum", "ds_for_dq")
# Each option alone on its base, and the stable presets (the cases the
# held-out audit runs).
CASES = [
  "bf16-fa2+delta_source=fp32",
  "bf16-fa2+delta_source=hi_lo",
  "bf16-fa2+delta_source=probs",
  "fp16-fa2+delta_source=hi_lo",
  "bf16-fa2+softmax_residuals=max_sum",
  "fp32+softmax_residuals=max_sum",
  "bf16-fa2+softmax_sum=rounded_probs",
  "bf16-fa2+ds_for_dq=hi_lo",
  "bf16-fa2-stable",
  "fp16-fa2-stable",
  "fp32-stable",
]


def _options(policy):
  return {name: getattr(policy, name) for name in STABILITY}


def _run(preset, shape, q, k, v, d_out):
  *_, block_q, block_k, causal = shape
  policy = sa.Precision.from_name(preset)

  def fn(q, k, v):
    return sa.attention(
      q, k, v, precision=preset, block_q=block_q, block_k=block_k,
      causal=causal,
    )  # fmt: skip

  out, vjp = jax.vjp(fn, *(jnp.asarray(x) for x in (q, k, v)))
  return out, vjp(jnp.asarray(d_out).astype(policy.dtype("output")))


@pytest.mark.parametrize(
  "preset, shape",
  sampled(
    [(p, SHAPES[i % len(SHAPES)]) for i, p in enumerate(CASES)],
    3,
    unpack=True,
    ids=lambda c: f"{c[0]}-{c[1][0]}x{c[1][1]}",
  ),
)
def test_stability_options_match_emulator(preset, shape):
  q, k, v = emulator_inputs(21, shape)
  d_out = np.random.default_rng(22).standard_normal(q.shape)
  d_out = np.round(d_out * 16) / 16
  *_, block_q, block_k, causal = shape
  policy = sa.Precision.from_name(preset)
  out, grads = _run(preset, shape, q, k, v, d_out)
  base = preset.split("+")[0].removesuffix("-stable")
  kw = dict(block_q=block_q, block_k=block_k, scheme="fa2", causal=causal)
  want_out, _ = emu.forward(
    q, k, v, policy.stages(), options=_options(policy), **kw
  )
  check_against_emulator(want_out, np.asarray(out, np.float64), base, "output")
  want = emu.backward(
    q, k, v, d_out, policy.stages(), options=_options(policy), **kw
  )
  for name, g, w in zip(("dq", "dk", "dv"), grads, want):
    check_against_emulator(w, np.asarray(g, np.float64), base, name)


def test_each_option_changes_the_backward_of_its_base():
  """An option the kernel ignored would pass the emulator test only if the
  emulator ignored it too: each must move some gradient bit."""
  shape = SHAPES[0]
  q, k, v = emulator_inputs(23, shape)
  d_out = np.random.default_rng(24).standard_normal(q.shape)
  _, base = _run("bf16-fa2", shape, q, k, v, d_out)
  for preset in CASES[:4] + CASES[6:8]:
    if not preset.startswith("bf16"):
      continue
    _, grads = _run(preset, shape, q, k, v, d_out)
    moved = any(
      not np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(grads, base)
    )
    assert moved, f"{preset} changed no gradient"


@pytest.mark.parametrize(
  "name, fragment",
  [
    ("fp32+delta_source=hi_lo", "stores O in fp32"),
    ("fp32+ds_for_dq=hi_lo", "narrower"),
    ("fp32+softmax_sum=rounded_probs", "changes nothing"),
    ("bf16-fa2+exp2=on+softmax_residuals=max_sum", "base 2"),
    ("fp8-fa3+delta_source=probs", "straight-through"),
    ("bf16-fa2+delta_source=o", "valid: ['output'"),
  ],
)
def test_meaningless_stability_options_are_refused(name, fragment):
  with pytest.raises(ValueError, match=fragment.replace("[", r"\[")):
    sa.Precision.from_name(name)


def test_split_kv_and_ring_refuse_stable_residuals():
  q = jnp.zeros((1, 64, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="split-KV"):
    jax.grad(
      lambda q: (
        sa.attention(q, q, q, precision="bf16-fa2-stable", num_splits=2)
        .astype(jnp.float32)
        .sum()
      )
    )(q)
