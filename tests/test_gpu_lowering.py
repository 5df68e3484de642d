"""Every GPU configuration lowers to Triton for CUDA, on a CPU-only machine.

Lowering for CUDA (`harness.cuda_lowering.lowered_for_cuda`) runs the
Pallas Triton lowering, which raises on what Triton cannot compile; the
GPU-marked test runs the same configurations compiled when a GPU is
present.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv, sampled, value_and_grads

import stableattn as sa
from stableattn.harness import cuda_lowering
from stableattn.harness.cuda_lowering import lowered_for_cuda
from stableattn.ops.ring_plan import context_mesh

GPU_PRESETS = [
  p
  for p in sa.preset_names()
  if p != "fp64" and not sa.Precision.from_name(p).quantizes
] + ["bf16-fa2+exp2=on", "bf16+exp2=on"]  # the softmax in base 2
# The tensor core's accumulator: one level, promoted every 4 tiles, and a
# 16-bit policy's chunked MMA.
ACCUMULATOR_POLICIES = [
  "fp8-fa3-hopper",
  "fp8-fa3-two-level+promote_every=4",
  "bf16-fa2+mma_chunk=16+matmul_accum=bf16+mma_rounding=truncate",
]
# Every preset except FP64 compiles: half-precision arithmetic runs in FP32
# and each result is rounded by a cast, a real rounding in a Triton kernel.
CONFIGS = [
  (precision, tiles, head_dim)
  for precision, tiles, head_dim in itertools.product(
    GPU_PRESETS, [(64, 64), (128, 64)], [64, 128]
  )
  # FP32 operands at head dim 128 fit a 64-row tile only (H100, measured).
  if not (
    sa.Precision.from_name(precision).matmul_operands == "fp32"
    and head_dim == 128
    and max(tiles) > 64
  )
]


def _loss_and_grads(precision, tiles, causal, interpret):
  def loss(q, k, v):
    out = sa.attention(
      q,
      k,
      v,
      precision=precision,
      block_q=tiles[0],
      block_k=tiles[1],
      causal=causal,
      interpret=interpret,
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize(
  "precision, tiles, head_dim", sampled(CONFIGS, 3, unpack=True)
)
def test_forward_and_backward_lower_for_cuda(precision, tiles, head_dim):
  dtype = sa.Precision.from_name(precision).dtype("inputs")
  q = jax.ShapeDtypeStruct((2, 200, 4, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((2, 200, 2, head_dim), dtype)
  for causal in (False, True):
    fn = _loss_and_grads(precision, tiles, causal, interpret=False)
    text = lowered_for_cuda(fn, q, kv, kv).as_text()
    # Forward, delta, dK/dV and dQ kernels all became Triton calls.
    assert text.count("__gpu$xla.gpu.triton") == 4


# Each stability option alone (the stable presets are in GPU_PRESETS).
STABILITY_POLICIES = [
  "bf16-fa2+delta_source=fp32",
  "bf16-fa2+delta_source=hi_lo",
  "bf16-fa2+delta_source=probs",
  "fp16-fa2+delta_product=matmul",
  "bf16-fa2+softmax_residuals=max_sum",
  "fp16-fa2+softmax_sum=rounded_probs",
  "bf16-fa2+ds_for_dq=hi_lo",
  "bf16-fa2-stable",
  "fp32-stable",
]


@pytest.mark.parametrize("precision", sampled(STABILITY_POLICIES, 2))
def test_stability_options_lower_for_cuda(precision):
  """The forward's extra residual outputs, the backward reading m and l,
  delta from two O parts or from P dP, and dQ from dS_hi and dS_lo all
  lower to Triton, causal and not."""
  dtype = sa.Precision.from_name(precision).dtype("inputs")
  q = jax.ShapeDtypeStruct((2, 200, 4, 64), dtype)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 64), dtype)
  for causal in (False, True):
    fn = _loss_and_grads(precision, (64, 64), causal, interpret=False)
    text = lowered_for_cuda(fn, q, kv, kv).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 4


def test_chunked_scores_lower_for_cuda():
  """score_chunk cuts Q's and K's head dim into static parts, which
  Triton splits only into equal power-of-two parts: head dim 72 pads to
  128, eight parts of 16, in the forward and the backward's recompute."""
  q = jax.ShapeDtypeStruct((2, 200, 4, 72), jnp.float32)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 72), jnp.float32)
  assert _causal_triton_calls("fp32-stable", q, kv, kv) == 4


def _causal_triton_calls(precision, q, k, v) -> int:
  """Triton kernels in the CUDA lowering of a causal loss and its
  gradients at 64 x 64 tiles."""
  fn = _loss_and_grads(precision, (64, 64), True, interpret=False)
  text = lowered_for_cuda(fn, q, k, v).as_text()
  return text.count("__gpu$xla.gpu.triton")


@pytest.mark.parametrize(
  "schedule", [{"num_splits": 3}, {"split_size": 128}], ids=str
)
def test_split_kv_lowers_for_cuda(schedule):
  """The split kernel (forward; the backward reads the merged output) and
  its jnp merge lower, causal over a padded cache and not."""
  q = jax.ShapeDtypeStruct((2, 200, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
  for causal in (False, True):

    def loss(q, k, v, causal=causal):
      out = sa.attention(
        q,
        k,
        v,
        precision="bf16-fa2",
        interpret=False,
        causal=causal,
        **schedule,
      )
      return jnp.sum(out.astype(jnp.float32) ** 2)

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    text = lowered_for_cuda(fn, q, kv, kv).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 4


def test_paged_decode_lowers_for_cuda():
  """One query per sequence over a paged, padded cache, split by size."""
  q = jax.ShapeDtypeStruct((2, 1, 4, 64), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((10, 64, 2, 64), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((2, 4), jnp.int32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

  def decode(q, k_pages, v_pages, table, lengths):
    return sa.paged_attention(
      q,
      k_pages,
      v_pages,
      table,
      precision="bf16-fa2",
      interpret=False,
      split_size=128,
      causal=True,
      causal_alignment="bottom_right",
      key_value_seq_lengths=lengths,
    )

  text = lowered_for_cuda(decode, q, pool, pool, table, lengths).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1


def test_tiles_beyond_gpu_shared_memory_raise_clearly():
  q = jnp.zeros((1, 256, 2, 128), jnp.float32)
  with pytest.raises(ValueError, match="shared memory.*at most 64"):
    sa.attention(q, q, q, precision="fp32", block_q=128, interpret=False)
  # The same tiles run in interpret mode, and fit with BF16 operands.
  sa.attention(q, q, q, precision="fp32", block_q=128, interpret=True)
  text = lowered_for_cuda(
    lambda q: sa.attention(
      q, q, q, precision="bf16-fa2", block_q=128, interpret=False
    ),
    q.astype(jnp.bfloat16),
  ).as_text()
  assert "__gpu$xla.gpu.triton" in text


def test_tie_fix_lowers_for_cuda():
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = sa.attention(
      q, k, v, precision="bf16", tie_beta=2.0, causal=True, interpret=False
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
  text = lowered_for_cuda(fn, q, q, q).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 4


def test_odd_head_dim_lowers_padded_to_power_of_two():
  q = jax.ShapeDtypeStruct((1, 97, 2, 72), jnp.bfloat16)
  fn = _loss_and_grads("bf16-fa2", (64, 64), True, interpret=False)
  text = lowered_for_cuda(fn, q, q, q).as_text()
  assert "__gpu$xla.gpu.triton" in text


def test_mla_head_dims_lower_with_each_its_own_padding():
  """DeepSeek's 192/128: q and k padded to 256, v and the output to 128."""
  q = jax.ShapeDtypeStruct((1, 128, 4, 192), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 128, 2, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
  assert _causal_triton_calls("bf16-fa2", q, k, v) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("precision, tiles, head_dim", CONFIGS)
def test_compiled_kernel_passes_fa_rule_on_gpu(precision, tiles, head_dim):
  q, k, v = random_qkv(0, batch=2, q_len=256, head_dim=head_dim)
  d_out = np.random.default_rng(1).standard_normal(q.shape)
  fmt = sa.Precision.from_name(precision).output
  for causal in (False, True):
    golden = sa.golden_attention(q, k, v, causal)
    golden_grads = sa.golden_attention_vjp(q, k, v, d_out, causal)
    kwargs = dict(
      precision=precision, block_q=tiles[0], block_k=tiles[1], causal=causal
    )
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    out, grads = value_and_grads(*f32, d_out, **kwargs)
    base, base_grads = value_and_grads(
      *f32, d_out, implementation="reference", **kwargs
    )
    assert sa.passes_fa_rule(
      golden, out, base, factor=2.0, floor=sa.rounding_floor(golden, fmt)
    )
    for g, b, gg in zip(grads, base_grads, golden_grads):
      assert sa.passes_fa_rule(
        gg, g, b, factor=3.0, floor=sa.rounding_floor(gg, fmt)
      )


@pytest.mark.gpu
@pytest.mark.parametrize("precision", GPU_PRESETS + ACCUMULATOR_POLICIES)
def test_compiled_kernel_rounds_like_interpret_mode(precision):
  """Compiled (casts) and interpreted (reduce_precision) roundings agree."""
  q, k, v = (
    np.clip(np.round(x * 16) / 16, -4, 4).astype(np.float32)
    for x in random_qkv(2, batch=1, q_len=256, head_dim=64)
  )
  outs = [
    np.asarray(
      sa.attention(
        q,
        k,
        v,
        precision=precision,
        block_q=64,
        block_k=64,
        interpret=interpret,
      ).astype(jnp.float64)
    )
    for interpret in (False, True)
  ]
  same = float(np.mean(outs[0] == outs[1]))
  if sa.Precision.from_name(precision).output != "fp32":
    assert same >= 0.995, f"only {same:.4f} bit-identical"
    return
  # With no rounding below FP32 the order of FP32 sums shows: the Triton
  # dot and XLA's GPU dot (interpret mode) add in different orders, so
  # only 8-20% of FP32 outputs were bit-identical on an H100. They must
  # still agree to a few FP32 ulps of the output's scale.
  ulp = np.spacing(np.float32(np.abs(outs[1]).max()))
  apart = float(np.abs(outs[0] - outs[1]).max() / ulp)
  assert apart <= 16, f"{apart:.1f} ulps of the largest output apart"


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [{"num_splits": 4}, {"split_size": 128}])
def test_compiled_split_kv_and_paged_cache_round_like_interpret_mode(schedule):
  """Split-KV decode, contiguous and paged, compiled against interpreted."""
  q, k, v = (
    np.clip(np.round(x * 16) / 16, -4, 4).astype(np.float32)
    for x in random_qkv(3, batch=2, q_len=4, kv_len=512, head_dim=64)
  )
  table = np.arange(16, dtype=np.int32).reshape(2, 8)[:, ::-1].copy()
  pages = lambda x: x.reshape(16, 64, *x.shape[2:])[np.argsort(table.ravel())]  # noqa: E731
  kwargs = dict(
    precision="bf16-fa2",
    block_q=16,
    block_k=64,
    causal=True,
    causal_alignment="bottom_right",
    key_value_seq_lengths=np.array([512, 300], np.int32),
    **schedule,
  )
  for run in (
    lambda i: sa.attention(q, k, v, interpret=i, **kwargs),
    lambda i: sa.paged_attention(
      q, pages(k), pages(v), table, interpret=i, **kwargs
    ),
  ):
    compiled, interpreted = (
      np.asarray(run(i).astype(jnp.float32)) for i in (False, True)
    )
    assert float(np.mean(compiled == interpreted)) >= 0.995


FEATURE_LOWERINGS = {
  "window": dict(local_window_size=(32, 0)),
  "lengths_bottom_right": dict(
    causal=True,
    causal_alignment="bottom_right",
    query_seq_lengths=np.array([150, 200], np.int32),
    key_value_seq_lengths=np.array([200, 120], np.int32),
  ),
  "segments": dict(segment_ids=np.repeat(np.eye(2, dtype=np.int32), 100, 1)),
  "softcap_scale": dict(softcap=30.0, scale=0.1),
  "mask": dict(mask=np.tril(np.ones((1, 1, 200, 200), bool))),
}


@pytest.mark.parametrize(
  "name", sampled([*FEATURE_LOWERINGS, "bias", "sink"], 3)
)
def test_every_feature_lowers_for_cuda(name):
  """Forward, delta, dK/dV and dQ kernels lower to Triton with each
  feature; the bias and sink with their gradients."""
  q = jax.ShapeDtypeStruct((2, 200, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
  extra = {
    "bias": jax.ShapeDtypeStruct((1, 4, 200, 200), jnp.float32),
    "sink": jax.ShapeDtypeStruct((4,), jnp.float32),
  }.get(name)
  kwargs = FEATURE_LOWERINGS.get(name, {})

  def loss(q, k, v, *differentiable):
    features = dict(kwargs)
    if differentiable:
      features[name] = differentiable[0]
    out = sa.attention(
      q, k, v, precision="bf16-fa2", interpret=False, **features
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  args = (q, kv, kv) + (() if extra is None else (extra,))
  fn = jax.value_and_grad(loss, argnums=tuple(range(len(args))))
  text = lowered_for_cuda(fn, *args).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 4


# Between them: tile, per-token, per-channel and micro scales, the
# rotation, smoothing, the fp22 accumulator, e4m3 and e2m1 (fp8-baseline's
# tensor scales take fp8-fa3's code path with one scale).
LOW_POLICIES = [
  "fp8-fa3",
  "fp8-sage+matmul_accum=fp22",
  "fp8-fa3+scaling=mx",
  "fp4-nvfp4",
]


@pytest.mark.parametrize("precision", ACCUMULATOR_POLICIES)
def test_mma_accumulator_presets_lower_for_cuda(precision):
  """Chunked dots, the truncating accumulator (bit operations) and the
  promotion's select lower to Triton, forward and backward."""
  q = jax.ShapeDtypeStruct((1, 320, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = sa.attention(
      q, k, v, precision=precision, block_k=32, interpret=False
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  text = lowered_for_cuda(fn, q, q, q).as_text()
  assert "stableattn_flash_forward_fa2" in text


@pytest.mark.parametrize("precision", sampled(LOW_POLICIES, 2))
def test_low_precision_forward_and_backward_lower_for_cuda(precision):
  """Policies below 16 bits (scales per tile, token or channel, rotation,
  smoothing, microscaling, saturating casts) lower to Triton, forward and
  the straight-through backward."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float16)

  def loss(q, k, v):
    out = sa.attention(q, k, v, precision=precision, interpret=False)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  text = lowered_for_cuda(fn, q, q, q).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 4


@pytest.mark.parametrize("devices, balanced", [(2, True), (4, False)])
def test_ring_attention_lowers_for_cuda(devices, balanced):
  """Every ring step's kernel, forward and backward, inside shard_map."""
  mesh = context_mesh(devices)
  if cuda_lowering.needs_abstract_gpu():
    # jax 0.11 names the GPU through the mesh the ring shards over.
    mesh = cuda_lowering.abstract_gpu_mesh(mesh)
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)

  def forward(q, k, v):
    return sa.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis="context",
      precision="bf16-fa2",
      interpret=False,
      causal=True,
      balanced=balanced,
    )

  def loss(q, k, v):
    return jnp.sum(forward(q, k, v).astype(jnp.float32) ** 2)

  def lowered(fn):
    return lowered_for_cuda(fn, q, kv, kv, mesh=mesh).as_text()

  steps = devices * (2 if balanced else 1)  # kernel calls per device
  assert lowered(forward).count("__gpu$xla.gpu.triton") == steps
  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  assert lowered(grad).count("__gpu$xla.gpu.triton") > 2 * steps
