"""The stability options and presets (docs/precision.md, "Stable
presets") run as documented: the kernel's forward and backward against
the emulator (`emulator_stability.py`), bit for bit where the rounding
is the policy's; and each option changes what it says it changes."""

import jax
import jax.numpy as jnp
import numpy as np
import policy_emulator as emu
import pytest
from emulator_checks import (
  SHAPES,
  check_against_emulator,
  emulator_inputs,
  ulps_at_largest,
)
from helpers import sampled
from jax.extend.core import jaxprs_in_params

import stableattn as sa
from stableattn.kernels.block_math import KEPT_SCALED_SCOPE
from stableattn.kernels.residuals import residual_bytes_per_row
from stableattn.numerics.quant_options import STABILITY_OPTIONS

STABILITY = STABILITY_OPTIONS
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
  # Exact inputs sum alike in any order: delta_product changes no bit
  # here (its test is the one-key rows below), so it is last, outside
  # the changed-gradient test's cases.
  "fp16-fa2+delta_product=matmul",
  "bf16-fa2+delta_source=hi_lo+delta_product=matmul",
]


def _options(policy):
  return {name: getattr(policy, name) for name in STABILITY}


def _run(preset, shape, q, k, v, d_out, sink=None):
  """The kernel's output and its gradients (dq, dk, dv, and d(sink) when
  a sink is passed) at the shape's tiles."""
  *_, block_q, block_k, causal = shape
  policy = sa.Precision.from_name(preset)
  sinks = () if sink is None else (jnp.asarray(sink, jnp.float32),)

  def fn(q, k, v, *sinks):
    return sa.attention(
      q, k, v, precision=preset, block_q=block_q, block_k=block_k,
      causal=causal, **dict(zip(("sink",), sinks)),
    )  # fmt: skip

  out, vjp = jax.vjp(fn, *(jnp.asarray(x) for x in (q, k, v)), *sinks)
  return out, vjp(jnp.asarray(d_out).astype(policy.dtype("output")))


def _emulator_tiles(shape) -> dict:
  """The emulator's keywords for the kernel's tiles at `shape`."""
  *_, block_q, block_k, causal = shape
  return dict(block_q=block_q, block_k=block_k, scheme="fa2", causal=causal)


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
  policy = sa.Precision.from_name(preset)
  out, grads = _run(preset, shape, q, k, v, d_out)
  base = preset.split("+")[0].removesuffix("-stable")
  kw = _emulator_tiles(shape)
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
    ("bf16-fa2+delta_source=probs+delta_product=matmul", "with no O"),
    ("fp16-fa2+delta_source=probs+sink_delta=probs", "already"),
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


FORWARD = "stableattn_flash_forward_fa2"


def _pallas_calls(precision, shape=(1, 128, 2, 64)):
  """{kernel name: (output bytes, dot_generals in its body)} of one
  forward and backward under `precision`."""
  dtype = sa.Precision.from_name(precision).dtype("inputs")
  q = jnp.zeros(shape, dtype)

  def loss(q, k, v):
    out = sa.attention(q, k, v, precision=precision, block_q=64, block_k=64)
    return out.astype(jnp.float32).sum()

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q)
  found = {}

  def count_dots(jaxpr):
    total = 0
    for eqn in jaxpr.eqns:
      total += eqn.primitive.name == "dot_general" and (
        KEPT_SCALED_SCOPE not in str(eqn.source_info.name_stack)
      )
      for sub in jaxprs_in_params(eqn.params):
        total += count_dots(sub)
    return total

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        name = str(eqn.params["name"])
        size = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.outvars)
        found[name] = (size, count_dots(eqn.params["jaxpr"]))
      for sub in jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize(
  "precision, extra_bytes_per_row, extra_dots",
  [
    # m and l beside the lse: two FP32 row vectors more; score_chunk=16
    # at head dim 64: Q K^T as four matmuls of 16 columns where one was,
    # in the forward and where the backward recomputes it.
    ("fp32-stable", 8, {FORWARD: 3, "dkdvdq": 3, "delta": 2}),
    # O_lo in BF16 (2 bytes x 64); dS_lo K in the dQ step.
    # delta_product=matmul: the selection and dO O^T per query tile, in
    # a delta kernel that interpret mode runs only for it.
    ("bf16-fa2-stable", 128, {"dkdvdq": 1, "delta": 2}),
    ("bf16-fa2+delta_source=fp32", 256, {}),
    # rowsum(P dP): Q K^T and dO V^T again, in a kernel of its own.
    ("bf16-fa2+delta_source=probs", 0, {"delta_probs": 2}),
    ("bf16-fa2+softmax_sum=rounded_probs", 0, {}),
  ],
)
def test_residual_bytes_and_matmuls_of_the_lowered_kernels(
  precision, extra_bytes_per_row, extra_dots
):
  """The costs docs/audit.md states, read off the traced kernels: bytes
  the forward writes beyond the base preset's, per query row and head,
  and matmuls per tile beyond the base kernels' (interpret mode fuses
  the dQ step into the dK/dV kernel)."""
  base = precision.split("+")[0].removesuffix("-stable")
  ours, theirs = _pallas_calls(precision), _pallas_calls(base)
  rows = 1 * 2 * 128
  assert ours[FORWARD][0] - theirs[FORWARD][0] == extra_bytes_per_row * rows
  stated = residual_bytes_per_row(sa.Precision.from_name(precision), 64)
  assert sum(stated.values()) == extra_bytes_per_row
  for name, (_, dots) in ours.items():
    short = name.removeprefix("stableattn_flash_backward_")
    base_dots = theirs.get(name, (0, 0))[1]
    assert dots - base_dots == extra_dots.get(short, 0), name


@pytest.mark.parametrize(
  "base, implementation",
  [
    ("bf16-fa2", "pallas"),
    ("fp16-fa2", "pallas"),
    # The fast tier lowers the Hopper path's delta kernel for every
    # stable preset (tests/test_mosaic_gpu.py).
    pytest.param("bf16-fa2", "mosaic_gpu", marks=pytest.mark.slow),
    pytest.param("fp16-fa2", "mosaic_gpu", marks=pytest.mark.slow),
  ],
)
def test_delta_by_matmul_gives_one_key_rows_no_gradient(base, implementation):
  """Causal with one query over 37 keys (top-left): each row attends one
  key, P is exactly 1 there, and dQ and dK are exactly 0 in FP64 and in
  eager attention. delta = rowsum(dO * O) summed in another order than
  dP = dO V^T leaves their difference, an ulp of |dO||V|, in dS; with
  delta_product=matmul both come from one matmul shape and cancel. At
  FP16, XLA:CPU sums a 16 x 16 and a 16 x 64 matmul in different
  orders, so the shape of dP's tile is what is tested; on the Hopper
  path delta's diagonal is a wgmma of dP's shape (`mosaic_delta`)."""
  rng = np.random.default_rng(5)
  dtype = sa.Precision.from_name(base).dtype("inputs")
  # The interpreter runs a Mosaic GPU thread block per (example, head):
  # fewer of them, each still showing the order.
  batch, heads = (8, 4) if implementation == "pallas" else (2, 4)
  q, k, v, d_out = (
    jnp.asarray(rng.standard_normal((batch, length, heads, 32)), dtype)
    for length in (1, 37, 37, 1)
  )

  def grads(precision):
    def loss(q, k):
      out = sa.attention(
        q, k, v, precision=precision, causal=True,
        implementation=implementation,
      )  # fmt: skip
      return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    return [np.asarray(g, np.float64) for g in jax.grad(loss, (0, 1))(q, k)]

  summed = grads(f"{base}+delta_source=hi_lo")
  assert max(np.max(np.abs(g)) for g in summed) > 0  # the order shows
  for g in grads(f"{base}-stable"):
    assert np.max(np.abs(g)) == 0


def test_sink_delta_from_probs_matches_emulator():
  """sink_delta=probs: d(sink) from rowsum(P * dP) and rowsum(P) of the
  unrounded P, as the emulator computes it, within 4 ulps."""
  shape = SHAPES[3]
  q, k, v = emulator_inputs(25, shape)
  d_out = np.round(np.random.default_rng(26).standard_normal(q.shape) * 16)
  d_out /= 16
  sink = np.array([0.5, -1.0])
  preset = "fp16-fa2-stable"
  policy = sa.Precision.from_name(preset)
  got = _run(preset, shape, q, k, v, d_out, sink=sink)[1][3]
  want = emu.backward(
    q, k, v, d_out, policy.stages(), options=_options(policy), sink=sink,
    **_emulator_tiles(shape),
  )[3]  # fmt: skip
  assert ulps_at_largest(want, np.asarray(got, np.float64), "fp32") <= 4.0


@pytest.mark.parametrize(
  "implementation",
  # The Hopper path's dQ kernel sums rowsum(P dP) and rowsum(P) as it
  # walks the key blocks (its lowering: tests/test_mosaic_gpu_backward.py).
  ["pallas", pytest.param("mosaic_gpu", marks=pytest.mark.slow)],
)
def test_sink_delta_from_probs_where_a_sink_holds_the_rows(implementation):
  """A sink of 20 over normal scores leaves every other P near 2e-9, in
  FP16's subnormals: O (rounded or not) is then built from P rounded to
  nothing, and rowsum(dO * O) is not delta. d(sink) from the unrounded P
  is FP64's to 1e-3; from O it was off by more than 10%."""
  rng = np.random.default_rng(7)
  q, k, v, d_out = (
    jnp.asarray(rng.standard_normal(shape), jnp.float16)
    for shape in ((4, 1, 2, 32), (4, 37, 2, 32), (4, 37, 2, 32), (4, 1, 2, 32))
  )
  sink = jnp.full((2,), 20.0, jnp.float32)

  def d_sink(precision):
    def loss(sink):
      out = sa.attention(
        q, k, v, sink=sink, precision=precision,
        implementation=implementation,
      )  # fmt: skip
      return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    return np.asarray(jax.grad(loss)(sink), np.float64)

  golden = sa.golden_attention_vjp(q, k, v, d_out, sink=sink)[3]
  scale = np.max(np.abs(golden))

  def error(precision):
    return np.max(np.abs(d_sink(precision) - golden)) / scale

  assert error("fp16-fa2-stable") <= 1e-3
  assert error("fp16-fa2-stable+sink_delta=shared") > 0.1


@pytest.mark.parametrize("precision", ["fp32", "fp32-stable"])
def test_backward_recomputes_the_forwards_scores(precision):
  """Scores of thousands, each row held by one key, so P is one-hot and
  dV = P^T dO is dO at that key exactly. The scale 1/sqrt(32) is not a
  power of two: had XLA contracted the forward's x * c - m into one
  multiply-add (`block_math.kept_scaled`), its softmax sum would hold
  exp(-rounding of x c), not 1, and dV would be off by up to an ulp of a
  score of thousands relative (5.1e-4 measured before the fix). XLA
  contracts at its default optimization level, where CI runs this file a
  second time, not at the tiers' level 0."""
  rng = np.random.default_rng(3)
  q = rng.standard_normal((4, 1, 2, 32)) * np.sqrt(3000.0)
  k = rng.standard_normal((4, 37, 2, 32)) * np.sqrt(3000.0)
  v = rng.standard_normal((4, 37, 2, 32))
  d_out = rng.standard_normal((4, 1, 2, 32))
  q, k, v, d_out = (jnp.asarray(x, jnp.float32) for x in (q, k, v, d_out))

  def loss(v):
    return jnp.sum(sa.attention(q, k, v, precision=precision) * d_out)

  dv = np.asarray(jax.grad(loss)(v), np.float64)
  golden = sa.golden_attention_vjp(q, k, v, d_out)[2]
  assert np.max(np.abs(dv - golden)) <= 1e-6 * np.max(np.abs(golden))


def test_score_chunks_sum_the_head_dim_sixteen_products_at_a_time():
  """q.k = 2^25 + sixteen 1s: products [2^25, 0 x 15] in the first
  chunk of 16 and [1 x 16] in the second, each chunk's sum exact in any
  order. Summed in chunks the logit is 2^25 + 16 exactly (an FP32
  number); a sum that adds a 1 at a time to 2^25 loses it (half an ulp
  or less), as XLA:CPU's one dot of 32 products does for most of them.
  With one key and scale 1 the log-sum-exp is the logit itself."""
  q = np.zeros((1, 1, 1, 32), np.float32)
  k = np.zeros_like(q)
  q[..., 0], k[..., 0] = 2.0**13, 2.0**12
  q[..., 16:] = k[..., 16:] = 1.0

  def logit(precision):
    _, lse = sa.attention(
      q, k, q, precision=precision, scale=1.0, return_lse=True
    )
    return float(lse.reshape(())) - 2.0**25

  assert logit("fp32-stable") == 16.0
  assert logit("fp32-stable+score_chunk=0") < 16.0
