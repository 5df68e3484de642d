"""The precision policy is what runs: bit for bit against an independent
NumPy + ml_dtypes emulator (`policy_emulator.py`), under any XLA flags.

CI runs this file and test_exact_rounding_low_precision.py twice: with
default flags and with `XLA_FLAGS=--xla_allow_excess_precision=false`.
"""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import policy_emulator as emu
import pytest
from emulator_checks import (
  PRESETS,
  SHAPES,
  check_against_emulator,
  emulator_inputs,
  identical_share,
  on_grid,
  options_of,
  stages_of,
  ulps_at_largest,
)
from helpers import random_qkv, sampled

import stableattn as sa
from stableattn.numerics.rounding import round_to

FORWARD_CASES = [
  (preset, scheme, SHAPES[i % len(SHAPES)])
  for i, (preset, scheme) in enumerate(
    itertools.product(PRESETS, ["fa2", "fa1"])
  )
]


def _case_id(case):
  preset, scheme, shape = case
  return f"{preset}-{scheme}-T{shape[0]}S{shape[1]}-{shape[5]}x{shape[6]}" + (
    "-causal" if shape[7] else ""
  )


@pytest.mark.parametrize("case", sampled(FORWARD_CASES, 4, ids=_case_id))
def test_pallas_forward_matches_emulator(case):
  preset, scheme, shape = case
  q, k, v = emulator_inputs(FORWARD_CASES.index(case), shape)
  *_, block_q, block_k, causal = shape
  out = sa.attention(
    q,
    k,
    v,
    precision=preset,
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    causal=causal,
  )
  want, _ = emu.forward(
    q,
    k,
    v,
    stages_of(preset),
    options=options_of(preset),
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    causal=causal,
  )
  check_against_emulator(
    want, np.asarray(out.astype(jnp.float64)), preset, "output"
  )


@pytest.mark.parametrize("preset", sampled(PRESETS, 3))
def test_reference_matches_emulator(preset):
  shape = SHAPES[PRESETS.index(preset) % len(SHAPES)]
  q, k, v = emulator_inputs(7, shape)
  causal = shape[7]
  out = sa.attention(
    q, k, v, implementation="reference", precision=preset, causal=causal
  )
  want = emu.reference(q, k, v, stages_of(preset), causal=causal)
  check_against_emulator(
    want, np.asarray(out.astype(jnp.float64)), preset, "output"
  )


# Split-KV: (preset, partials format or None for the preset's, schedule).
SPLIT_CASES = [
  ("bf16-fa2", None, {"num_splits": 3}),
  ("bf16-fa2", "bf16", {"split_size": 32}),
  ("fp16-fa2", "fp16", {"num_splits": 2}),
  ("bf16", None, {"split_size": 16}),
  ("fp32", None, {"num_splits": 4}),
]


@pytest.mark.parametrize(
  "preset, partials, schedule",
  sampled(
    SPLIT_CASES,
    2,
    ids=lambda c: f"{c[0]}-{c[1]}-{next(iter(c[2]))}",
    unpack=True,
  ),
)
def test_split_kv_matches_emulator(preset, partials, schedule):
  """Each split's partial output is rounded to `partials`, the merge's
  exps, logs and lse to `softmax_stats`, its weighted sum to `out_accum`."""
  shape = SHAPES[SPLIT_CASES.index((preset, partials, schedule)) % 4]
  q, k, v = emulator_inputs(13, shape)
  *_, block_q, block_k, causal = shape
  policy = sa.Precision.from_name(preset)
  if partials is not None:
    policy = policy.with_stage(partials=partials)
  if "split_size" in schedule:
    schedule = {"split_size": max(schedule["split_size"], block_k)}
  out, lse = sa.attention(
    q,
    k,
    v,
    precision=policy,
    block_q=block_q,
    block_k=block_k,
    causal=causal,
    return_lse=True,
    **schedule,
  )
  want, want_lse = emu.forward(
    q,
    k,
    v,
    policy.stages(),
    options=policy.options(),
    block_q=block_q,
    block_k=block_k,
    scheme="fa2",
    causal=causal,
    **schedule,
  )
  check_against_emulator(
    want, np.asarray(out.astype(jnp.float64)), preset, "output"
  )
  # The lse is FP32 in most policies, where every exp, log and sum-order
  # difference shows: a few ulps of its value.
  want_lse = want_lse[..., : shape[0]]
  ulp = np.spacing(np.abs(want_lse).astype(policy.dtype("softmax_stats")))
  gap = np.abs(np.asarray(lse, np.float64) - want_lse)
  assert np.max(gap / ulp.astype(np.float64)) <= 4.0


BACKWARD_CASES = [
  (preset, scheme, SHAPES[i % len(SHAPES)])
  for i, (preset, scheme) in enumerate(
    itertools.product(["bf16", "bf16-fa2", "fp16", "fp16-framework"], ["fa2"])
  )
] + [("bf16", "fa1", SHAPES[2])]


@pytest.mark.parametrize("case", sampled(BACKWARD_CASES, 2, ids=_case_id))
def test_pallas_backward_matches_emulator(case):
  preset, scheme, shape = case
  q, k, v = emulator_inputs(11, shape)
  d_out = on_grid(np.random.default_rng(12).standard_normal(q.shape))
  *_, block_q, block_k, causal = shape
  policy = sa.Precision.from_name(preset)

  def fn(q, k, v):
    return sa.attention(
      q,
      k,
      v,
      precision=preset,
      block_q=block_q,
      block_k=block_k,
      scheme=scheme,
      causal=causal,
    )

  out, vjp = jax.vjp(fn, *(jnp.asarray(x) for x in (q, k, v)))
  grads = vjp(jnp.asarray(d_out).astype(policy.dtype("output")))
  want = emu.backward(
    q,
    k,
    v,
    d_out,
    stages_of(preset),
    options=options_of(preset),
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    causal=causal,
  )
  for name, g, w in zip(("dq", "dk", "dv"), grads, want):
    check_against_emulator(w, np.asarray(g, np.float64), preset, name)


def test_fused_bf16_chain_is_rounded_at_every_op():
  """The minimal case XLA used to get wrong: exp(bf16(x) - m) under jit."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.uniform(0.1, 3.0, (64, 64)), jnp.float32)
  m = jnp.asarray(rng.uniform(0.0, 1.0, (64, 1)), jnp.float32)

  @jax.jit
  def chain(x, m):
    d = round_to(round_to(x, "bf16") - round_to(m, "bf16"), "bf16")
    return round_to(jnp.exp(d), "bf16")

  bf16 = ml_dtypes.bfloat16
  xr = np.asarray(x).astype(bf16).astype(np.float32)
  mr = np.asarray(m).astype(bf16).astype(np.float32)
  want = np.exp((xr - mr).astype(bf16).astype(np.float32)).astype(bf16)
  assert identical_share(want, np.asarray(chain(x, m)).astype(bf16)) == 1.0


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("casts_round", [False, True])
def test_round_to_equals_a_true_cast_including_subnormals(fmt, casts_round):
  rng = np.random.default_rng(1)
  x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-12, 6, 20000)).astype(
    np.float32
  )
  x[:4] = [np.inf, -np.inf, 0.0, 7e4]
  got = np.asarray(
    jax.jit(lambda x: round_to(x, fmt, casts_round=casts_round))(x)
  )
  with np.errstate(over="ignore"):
    want = x.astype(emu.FORMATS[fmt]).astype(np.float32)
  np.testing.assert_array_equal(got, want)


TIE_CASES = [
  (preset, scheme, beta)
  for preset in ("bf16", "bf16-fa2+out_accum=bf16")
  for scheme, beta in (("fa2", 2.0), ("fa1", 2.0), ("fa2", 7.0))
]


@pytest.mark.parametrize(
  "preset, scheme, tie_beta",
  sampled(TIE_CASES, 2, ids=lambda c: "-".join(map(str, c)), unpack=True),
)
def test_tie_fix_matches_emulator(preset, scheme, tie_beta):
  """Qiu & Yao's fix, kernel and Baseline, on inputs with exact ties."""
  from stableattn.auditing.inputs import Shape, TiedMaximaSpec, make_inputs

  shape = Shape(1, 48, 96, 2, 1, 32)
  spec = TiedMaximaSpec(ties=3, block_k=32, margin=1e-4)
  q, k, v = (
    on_grid(x) for x in make_inputs("tied_maxima", 3, shape, tied=spec)
  )
  stages = sa.Precision.from_name(preset).stages()
  kwargs = dict(precision=preset, tie_beta=tie_beta)
  out = sa.attention(q, k, v, block_q=16, block_k=32, scheme=scheme, **kwargs)
  want, _ = emu.forward(
    q,
    k,
    v,
    stages,
    block_q=16,
    block_k=32,
    scheme=scheme,
    causal=False,
    tie_beta=tie_beta,
  )
  check_against_emulator(
    want, np.asarray(out.astype(jnp.float64)), "bf16", "output"
  )
  base = sa.attention(q, k, v, implementation="reference", **kwargs)
  want = emu.reference(q, k, v, stages, causal=False, tie_beta=tie_beta)
  check_against_emulator(
    want, np.asarray(base.astype(jnp.float64)), "bf16", "baseline"
  )


# Every attention feature, bit for bit against the emulator: batch 2, ragged
# tiles (72 keys in 32-wide blocks), GQA; presets cycle over the features.
FEATURE_SHAPE = (48, 72, 2, 1, 16)


def _feature_arguments(name):
  rng = np.random.default_rng(sorted(FEATURES).index(name))
  q_len, kv_len, heads = FEATURE_SHAPE[:3]
  if name == "segments":
    q_ids = np.repeat(np.array([0, 1, 2]), [10, 20, 18])
    kv_ids = np.repeat(np.array([0, 1, 2]), [30, 12, 30])
    return dict(
      segment_ids=(np.stack([q_ids, q_ids[::-1]]), np.stack([kv_ids] * 2))
    )
  if name == "bias":
    return dict(bias=on_grid(rng.standard_normal((1, heads, q_len, kv_len))))
  if name == "mask":
    return dict(mask=rng.random((2, heads, q_len, kv_len)) < 0.6)
  if name == "sink":
    return dict(sink=on_grid(rng.standard_normal(heads)), causal=True)
  return dict(FEATURES[name])


FEATURES = {
  "lengths_bottom_right": dict(
    causal=True,
    causal_alignment="bottom_right",
    query_seq_lengths=np.array([48, 30], np.int32),
    key_value_seq_lengths=np.array([61, 72], np.int32),
  ),
  "segments": None,
  "window": dict(local_window_size=(9, 4)),
  "softcap": dict(softcap=5.0),
  "scale": dict(scale=0.3),
  "bias": None,
  "mask": None,
  "sink": None,
}
FEATURE_NAMES = sorted(FEATURES)


def _feature_inputs(seed):
  q_len, kv_len, heads, kv_heads, head_dim = FEATURE_SHAPE
  q, k, v = random_qkv(
    seed,
    batch=2,
    q_len=q_len,
    kv_len=kv_len,
    heads=heads,
    kv_heads=kv_heads,
    head_dim=head_dim,
  )
  return [on_grid(x) for x in (q, k, v)]


@pytest.mark.parametrize("name", sampled(FEATURE_NAMES, 2))
def test_features_forward_match_emulator(name):
  """Kernel (fa2 or fa1) and Baseline, each under a different preset."""
  i = FEATURE_NAMES.index(name)
  q, k, v = _feature_inputs(i)
  kw = _feature_arguments(name)
  causal = kw.pop("causal", False)
  # Offsets chosen so softcap and scale run where `scores` is coarser than
  # `softmax_stats` (a "framework" preset), which shows their rounding.
  preset, scheme = PRESETS[(i + 1) % len(PRESETS)], ("fa2", "fa1")[i % 2]
  out = sa.attention(
    q,
    k,
    v,
    precision=preset,
    block_q=16,
    block_k=32,
    scheme=scheme,
    causal=causal,
    **kw,
  )
  want, _ = emu.forward(
    q,
    k,
    v,
    stages_of(preset),
    options=options_of(preset),
    block_q=16,
    block_k=32,
    scheme=scheme,
    causal=causal,
    **kw,
  )
  check_against_emulator(
    want, np.asarray(out.astype(jnp.float64)), preset, f"{name} output"
  )
  preset = PRESETS[(i + 6) % len(PRESETS)]
  base = sa.attention(
    q,
    k,
    v,
    implementation="reference",
    precision=preset,
    causal=causal,
    **kw,
  )
  want = emu.reference(q, k, v, stages_of(preset), causal=causal, **kw)
  check_against_emulator(
    want, np.asarray(base.astype(jnp.float64)), preset, f"{name} base"
  )


@pytest.mark.parametrize("name", sampled(FEATURE_NAMES, 2, seed=1))
def test_features_backward_match_emulator(name):
  """dq, dk, dv (and the bias and sink gradients) of the kernel."""
  i = FEATURE_NAMES.index(name)
  q, k, v = _feature_inputs(i + 20)
  d_out = on_grid(np.random.default_rng(i).standard_normal(q.shape))
  kw = _feature_arguments(name)
  causal = kw.pop("causal", False)
  preset = ("bf16", "bf16-fa2", "fp16", "fp16-framework")[i % 4]
  policy = sa.Precision.from_name(preset)
  extra = {n: jnp.asarray(kw.pop(n)) for n in ("bias", "sink") if n in kw}

  def fn(q, k, v, extra):
    return sa.attention(
      q,
      k,
      v,
      precision=preset,
      block_q=16,
      block_k=32,
      causal=causal,
      **kw,
      **extra,
    )

  _, vjp = jax.vjp(fn, *(jnp.asarray(x) for x in (q, k, v)), extra)
  *grads, d_extra = vjp(jnp.asarray(d_out).astype(policy.dtype("output")))
  want = emu.backward(
    q,
    k,
    v,
    d_out,
    stages_of(preset),
    options=options_of(preset),
    block_q=16,
    block_k=32,
    scheme="fa2",
    causal=causal,
    **kw,
    **{n: np.asarray(x) for n, x in extra.items()},
  )
  for what, g, w in zip(("dq", "dk", "dv"), grads, want):
    check_against_emulator(
      w, np.asarray(g, np.float64), preset, f"{name} {what}"
    )
  if "bias" in extra:
    # The bias is shared by the batch: its gradient sums the examples.
    d_bias = policy_sum(want[3], preset)
    check_against_emulator(
      d_bias, np.asarray(d_extra["bias"], np.float64), preset, "dbias"
    )
  if "sink" in extra:
    fmt = policy.grad_accum
    got = np.asarray(d_extra["sink"], np.float64)
    assert ulps_at_largest(want[3], got, fmt) <= 4.0


def policy_sum(d_bias, preset):
  """The per-example bias gradient summed over the batch, rounded once to
  `grad_accum` as the kernel's wrapper does."""
  fmt = emu.FORMATS[sa.Precision.from_name(preset).grad_accum]
  total = np.sum(d_bias, axis=0, keepdims=True).astype(np.float32)
  return total.astype(fmt).astype(np.float64)
