"""The policy option exp2 (softmax in base 2) is what runs: kernel forward,
split-KV, Baseline and the backward from its lse, against the emulator.

CI runs this file twice, as test_exact_rounding.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import policy_emulator as emu
import pytest
from emulator_checks import (
  check_against_emulator,
  emulator_inputs,
  identical_share,
  on_grid,
  stages_of,
)

import stableattn as sa

# (preset, scheme, features, split-KV schedule): the features the base
# changes (softcap's constant, the bias, the sink) and both rescalings.
CASES = [
  ("bf16-fa2", "fa2", {}, {}),
  ("fp16-fa2", "fa1", {"softcap": 5.0}, {}),
  ("bf16-framework", "fa2", {"bias": True}, {}),
  ("fp32", "fa2", {"sink": True, "causal": True}, {}),
  ("bf16", "fa2", {"causal": True}, {"num_splits": 3}),
]
SHAPE = (70, 90, 2, 1, 16, 16, 32, False)


def _features(kw, seed):
  rng = np.random.default_rng(seed)
  q_len, kv_len, heads = SHAPE[:3]
  kw = dict(kw)
  if kw.pop("bias", False):
    kw["bias"] = on_grid(rng.standard_normal((1, heads, q_len, kv_len)))
  if kw.pop("sink", False):
    kw["sink"] = on_grid(rng.standard_normal(heads))
  return kw


def _ids(case):
  preset, scheme, kw, split = case
  return "-".join([preset, scheme, *kw, *split])


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_exp2_forward_and_baseline_match_emulator(case):
  preset, scheme, kw, split = case
  name = f"{preset}+exp2=on"
  options = sa.Precision.from_name(name).options()
  i = CASES.index(case)
  q, k, v = emulator_inputs(40 + i, SHAPE)
  kw = _features(kw, i)
  causal = kw.pop("causal", False)
  tiles = dict(block_q=16, block_k=32)
  out = sa.attention(
    q,
    k,
    v,
    precision=name,
    scheme=scheme,
    causal=causal,
    **tiles,
    **split,
    **kw,
  )
  want, _ = emu.forward(
    q,
    k,
    v,
    stages_of(preset),
    scheme=scheme,
    causal=causal,
    options=options,
    **tiles,
    **split,
    **kw,
  )
  got = np.asarray(out.astype(jnp.float64))
  check_against_emulator(want, got, preset, f"{name} output")
  base = sa.attention(
    q, k, v, implementation="reference", precision=name, causal=causal, **kw
  )
  want_base = emu.reference(
    q, k, v, stages_of(preset), causal=causal, options=options, **kw
  )
  check_against_emulator(
    want_base, np.asarray(base.astype(jnp.float64)), preset, f"{name} base"
  )


def test_exp2_backward_matches_emulator():
  """The backward recomputes P from the forward's lse, stored in natural
  log whatever the forward's base."""
  preset, name = "bf16-fa2", "bf16-fa2+exp2=on"
  q, k, v = emulator_inputs(50, SHAPE)
  d_out = on_grid(np.random.default_rng(5).standard_normal(q.shape))
  tiles = dict(block_q=16, block_k=32)

  def fn(q, k, v):
    return sa.attention(q, k, v, precision=name, causal=True, **tiles)

  _, vjp = jax.vjp(fn, *(jnp.asarray(x) for x in (q, k, v)))
  grads = vjp(jnp.asarray(d_out).astype(jnp.bfloat16))
  want = emu.backward(
    q,
    k,
    v,
    d_out,
    stages_of(preset),
    scheme="fa2",
    causal=True,
    options={"exp2": True},
    **tiles,
  )
  for what, g, w in zip(("dq", "dk", "dv"), grads, want):
    check_against_emulator(w, np.asarray(g, np.float64), preset, what)


def test_exp2_changes_roundings_and_is_refused_with_the_tie_fix():
  """Not a no-op: under all-BF16 every score, max and exp is rounded in the
  other base, so the outputs differ (the emulator's cases above would fail
  with the natural base); the tie fix, which shifts natural-log scores, is
  refused with it."""
  q, k, v = emulator_inputs(60, SHAPE)
  tiles = dict(block_q=16, block_k=32)
  natural = sa.attention(q, k, v, precision="bf16", **tiles)
  base2 = sa.attention(q, k, v, precision="bf16+exp2=on", **tiles)
  assert identical_share(natural, base2) < 0.9
  with pytest.raises(ValueError, match="tie_beta.*exp2=on"):
    sa.attention(q, k, v, precision="bf16-fa2+exp2=on", tie_beta=2.0)
