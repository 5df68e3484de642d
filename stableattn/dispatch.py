"""`attention`: one entry point, one validation, every implementation."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from stableattn import masking, quantization
from stableattn.flash_attention import (
  flash_attention,
  flash_attention_with_lse,
  padded_head_dim,
  quantized_flash_attention,
)
from stableattn.masking import MaskSpec
from stableattn.pallas_forward import SCHEMES, KernelConfig
from stableattn.precision import (
  MICRO_GROUPS,
  Precision,
  require_x64_if_needed,
  resolve,
)
from stableattn.reference import reference_attention, xla_attention
from stableattn.rounding import PolicyArithmetic
from stableattn.tiling import check_block_size, check_flag, resolve_interpret

IMPLEMENTATIONS = ("pallas", "reference", "xla")


def _check_choice(name: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"Unknown {name} {value!r}; valid: {list(valid)}.")


def validate_inputs(q, k, v) -> tuple:
  """Shape and dtype checks shared by every implementation; the inputs as
  JAX arrays."""
  check_shapes(q, k, v)
  return tuple(jnp.asarray(x) for x in (q, k, v))


def check_shapes(q, k, v) -> None:
  """Raises a ValueError saying what is wrong with q, k, v (any arrays)."""
  arrays = {"q": q, "k": k, "v": v}
  for name, x in arrays.items():
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 4:
      raise ValueError(
        f"{name} must be a rank-4 array [batch, seq, heads, head_dim], got "
        f"shape {shape}."
      )
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(
        f"{name} must have a floating dtype (float16, bfloat16, float32, "
        f"float64), got {x.dtype}."
      )
    if min(shape) <= 0:
      raise ValueError(f"{name} has an empty dimension: shape {shape}.")
  if k.shape != v.shape:
    raise ValueError(
      f"k and v must have the same shape [batch, kv_len, kv_heads, "
      f"head_dim], got k {k.shape} and v {v.shape}."
    )
  if q.shape[0] != k.shape[0]:
    raise ValueError(
      f"q and k/v batch sizes differ: q batch {q.shape[0]}, k/v batch "
      f"{k.shape[0]}."
    )
  if q.shape[3] != k.shape[3]:
    raise ValueError(
      f"q and k/v head dims differ: q head_dim {q.shape[3]}, k/v head_dim "
      f"{k.shape[3]}."
    )
  heads, kv_heads = q.shape[2], k.shape[2]
  if heads % kv_heads != 0:
    raise ValueError(
      f"kv_heads must divide heads (GQA/MQA): got {heads} query heads and "
      f"{kv_heads} key/value heads; valid kv_heads are "
      f"{[n for n in range(1, heads + 1) if heads % n == 0]}."
    )


def check_tie_beta(tie_beta) -> float | None:
  """Validates Qiu & Yao's beta: None, or a finite number > 1."""
  if tie_beta is None:
    return None
  if isinstance(tie_beta, bool) or not isinstance(
    tie_beta, (int, float, np.floating, np.integer)
  ):
    raise ValueError(
      f"tie_beta must be None or a number > 1 (Qiu & Yao use 2 to 8), got "
      f"{type(tie_beta).__name__} {tie_beta!r}."
    )
  beta = float(tie_beta)
  if not math.isfinite(beta) or beta <= 1.0:
    raise ValueError(
      f"tie_beta must be a finite number > 1 (Qiu & Yao use 2 to 8), got "
      f"{tie_beta!r}; None disables the fix."
    )
  return beta


def xla_unsupported_reason(policy: Precision) -> str | None:
  """Why implementation="xla" cannot run `policy` here, or None."""
  if policy.inputs == "fp16" and jax.default_backend() == "cpu":
    return (
      f"implementation='xla' (jax.nn.dot_product_attention) cannot run "
      f"FP16 inputs (precision {policy.name!r}) on the CPU: XLA:CPU has no "
      "FP16 x FP16 -> FP32 dot ('F16_F16_F32' is not supported by "
      "dot_general on CPU), so calling it directly fails the same way. On "
      "the CPU use implementation='reference' (or 'pallas') with this "
      "policy, or a policy with BF16/FP32 inputs; on a GPU 'xla' works."
    )
  return None


def gpu_unsupported_reason(policy: Precision) -> str | None:
  """Why the compiled GPU (Triton) kernel cannot run `policy`, or None.

  Half-precision arithmetic compiles: each op runs in FP32 and its result
  is rounded by a cast, which is a real rounding in a Triton kernel.
  """
  if policy.uses_fp64:
    return (
      f"Precision {policy.name!r} has FP64 stages, which the GPU (Triton) "
      "kernel does not support; use interpret=True for FP64."
    )
  return None


# Largest shared memory one Triton program may use on an H100/H200 (227 KiB).
GPU_SHARED_MEMORY_BYTES = 232448


def shared_memory_reason(policy: Precision, head_dim: int, tiles) -> str | None:
  """Why these tiles cannot fit in a GPU's shared memory, or None.

  The backward kernels hold about four tiles of the largest block size
  (rows of Q, dO, K, V at the padded head dim) in matmul-operand format.
  On an H100 this estimate matched Triton's request exactly where it
  failed (FP32 operands, head dim 128, a 128-row tile: 262144 bytes) and
  stayed below the limit for every configuration that compiled.
  """
  operand_bytes = policy.dtype("matmul_operands").itemsize
  head_dim_padded = padded_head_dim(head_dim, interpret=False)
  need = 4 * max(tiles) * head_dim_padded * operand_bytes
  if need <= GPU_SHARED_MEMORY_BYTES:
    return None
  return (
    f"Tiles {tuple(tiles)} at head dim {head_dim} with "
    f"{policy.matmul_operands} matmul operands need about {need} bytes of "
    f"GPU shared memory; a Triton program gets at most "
    f"{GPU_SHARED_MEMORY_BYTES} on an H100/H200. Use tiles of at most "
    f"{_largest_fitting_tile(head_dim_padded, operand_bytes)} (block_q, "
    "block_k, bwd_block_q, bwd_block_k), or interpret=True."
  )


def _largest_fitting_tile(head_dim_padded: int, operand_bytes: int) -> int:
  tile = 16
  while 4 * 2 * tile * head_dim_padded * operand_bytes <= (
    GPU_SHARED_MEMORY_BYTES
  ):
    tile *= 2
  return tile


def kernel_config(
  q_shape,
  kv_shape,
  *,
  policy: Precision,
  block_q,
  block_k,
  scheme: str,
  mask: MaskSpec,
  interpret: bool | None,
  num_warps=None,
  num_stages=None,
  bwd_block_q=None,
  bwd_block_k=None,
  tie_beta=None,
) -> KernelConfig:
  """Validated static configuration of the Pallas kernels."""
  _check_choice("scheme", scheme, SCHEMES)
  tie_beta = check_tie_beta(tie_beta)
  interpret = resolve_interpret(interpret)
  for_gpu = not interpret
  q_len, kv_len = q_shape[1], kv_shape[1]
  block_q = check_block_size("block_q", block_q, for_gpu=for_gpu, length=q_len)
  block_k = check_block_size("block_k", block_k, for_gpu=for_gpu, length=kv_len)
  bwd_block_q = check_block_size(
    "bwd_block_q",
    block_q if bwd_block_q is None else bwd_block_q,
    for_gpu=for_gpu,
    length=q_len,
  )
  bwd_block_k = check_block_size(
    "bwd_block_k",
    block_k if bwd_block_k is None else bwd_block_k,
    for_gpu=for_gpu,
    length=kv_len,
  )
  group = MICRO_GROUPS.get(policy.scaling)
  if group and block_k % group and kv_len > block_k:
    raise ValueError(
      f"scaling={policy.scaling} groups P by {group} keys, so block_k "
      f"must be a multiple of {group} (got {block_k}): a group may not "
      "straddle two key tiles."
    )
  if for_gpu:
    reason = gpu_unsupported_reason(policy) or shared_memory_reason(
      policy, q_shape[3], (block_q, block_k, bwd_block_q, bwd_block_k)
    )
    if reason:
      raise ValueError(reason)
  return KernelConfig(
    policy=policy,
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    mask=mask,
    q_len=q_len,
    kv_len=kv_len,
    head_dim=q_shape[3],
    interpret=interpret,
    num_warps=num_warps,
    num_stages=num_stages,
    bwd_block_q=bwd_block_q,
    bwd_block_k=bwd_block_k,
    tie_beta=tie_beta,
  )


def attention(
  q,
  k,
  v,
  *,
  implementation: str = "pallas",
  precision: str | Precision = "bf16",
  block_q: int = 64,
  block_k: int = 64,
  scheme: str = "fa2",
  causal: bool = False,
  causal_alignment: str = "top_left",
  local_window_size=None,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  segment_ids=None,
  bias=None,
  mask=None,
  scale: float | None = None,
  softcap: float | None = None,
  sink=None,
  interpret: bool | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
  bwd_block_q: int | None = None,
  bwd_block_k: int | None = None,
  tie_beta: float | None = None,
  return_lse: bool = False,
):
  """Scaled dot-product attention under a precision policy.

  Args:
    q: [batch, q_len, heads, head_dim].
    k, v: [batch, kv_len, kv_heads, head_dim]; kv_heads divides heads.
    implementation: "pallas" (our flash kernel), "reference" (materialized
      baseline in jnp) or "xla" (`jax.nn.dot_product_attention`).
    precision: a preset name (see `stableattn.preset_names()`) or a
      `stableattn.Precision`. Inputs are first cast to its `inputs` format.
    block_q, block_k: tile sizes B_r and B_c of the Pallas kernel (any
      positive size in interpret mode; powers of two >= 16 on a GPU).
    scheme: "fa2" (normalize once at the end) or "fa1" (renormalize after
      every key block).
    causal: causal mask; query i sees keys up to its own position.
    causal_alignment: "top_left" (query i sees keys 0..i; jax's) or
      "bottom_right" (the last query sees the last key, FlashAttention's
      and a KV cache's), per example when lengths are given. Also places
      the local window. The same when q_len == kv_len.
    local_window_size: None, w (the window (w, w)) or (left, right): query
      i sees keys at positions i - left .. i + right; None or -1 leaves a
      side unbounded (jax's argument; FlashAttention's `window_size`).
    query_seq_lengths, key_value_seq_lengths: int [batch]: valid (leading)
      queries and keys per example; padded query rows give 0.
    segment_ids: int [batch, seq] (self-attention) or a pair (q ids
      [batch, q_len], kv ids [batch, kv_len]): a query sees only keys of
      its own segment (packed sequences).
    bias: additive score bias [batch|1, heads|1, q_len, kv_len] (ALiBi,
      relative positions); it gets a gradient.
    mask: boolean [batch|1, heads|1, q_len, kv_len], True where a pair
      attends: the general fallback, combined with every other mask.
    scale: the score scale; None means 1/sqrt(head_dim).
    softcap: logits become softcap * tanh(logits / softcap) (Gemma 2; 30
      or 50 are typical), before the bias; None for none.
    sink: float [heads]: a learnable sink logit per head that joins each
      row's softmax denominator with a zero value (gpt-oss); it gets a
      gradient.
    interpret: run the Pallas kernel in interpret mode; None means "iff the
      default backend is the CPU".
    num_warps, num_stages: Triton compiler parameters (GPU only).
    bwd_block_q, bwd_block_k: backward tile sizes; default to the forward's.
    tie_beta: None for the standard safe softmax, or beta > 1 for Qiu &
      Yao's fix (arXiv 2510.04212, Alg. 1): where scores tie at a row's
      maximum r_m, subtract beta * r_m (or 0 if r_m < 0) instead of r_m, so
      no probability is exactly 1. The kernel applies it per tile, the
      reference per row; "xla" does not support it. The gradient is exact
      (the backward uses the log-sum-exp).
    return_lse: also return the log-sum-exp [batch, heads, q_len] (pallas
      only; not differentiable; +inf for a row no key attends).

  A row that no key attends gives output 0 and zero gradient. See
  `stableattn.masking` for the exact semantics of every feature.

  Returns:
    [batch, q_len, heads, head_dim] in the policy's `output` format (and
    the log-sum-exp if `return_lse`).

  Raises:
    ValueError: for malformed inputs or unknown names; the message says what
      was received and what is valid.
  """
  _check_choice("implementation", implementation, IMPLEMENTATIONS)
  policy = resolve(precision)
  require_x64_if_needed(policy)
  q, k, v = validate_inputs(q, k, v)
  spec, ops = masking.build(
    q.shape,
    k.shape,
    causal=causal,
    causal_alignment=causal_alignment,
    local_window_size=local_window_size,
    query_seq_lengths=query_seq_lengths,
    key_value_seq_lengths=key_value_seq_lengths,
    segment_ids=segment_ids,
    bias=bias,
    mask=mask,
    sink=sink,
    softcap=softcap,
    scale=scale,
  )
  # Tile and scheme arguments are validated for every implementation, so a
  # sweep with a bad tile fails the same way whichever implementation runs
  # first; only the kernel is bound by GPU constraints.
  cfg = kernel_config(
    q.shape,
    k.shape,
    policy=policy,
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    mask=spec,
    interpret=interpret if implementation == "pallas" else True,
    num_warps=num_warps,
    num_stages=num_stages,
    bwd_block_q=bwd_block_q,
    bwd_block_k=bwd_block_k,
    tie_beta=tie_beta,
  )
  _check_implementation_options(implementation, cfg, return_lse)
  return _compute(
    q, k, v, ops, implementation=implementation, cfg=cfg, return_lse=return_lse
  )


def _check_implementation_options(
  implementation: str, cfg: KernelConfig, return_lse: bool
) -> None:
  """Raises for options the chosen implementation does not have."""
  if implementation == "xla" and xla_unsupported_reason(cfg.policy):
    raise ValueError(xla_unsupported_reason(cfg.policy))
  if implementation == "xla" and cfg.policy.quantizes:
    raise ValueError(
      f"implementation='xla' cannot run precision {cfg.policy.name!r}: "
      "jax.nn.dot_product_attention has no FP8/FP4/INT8 operands with "
      "scaling; use 'pallas' or 'reference'."
    )
  if implementation == "xla":
    missing = [
      name
      for name, used in (
        ("tie_beta", cfg.tie_beta is not None),
        ("softcap", cfg.mask.softcap is not None),
        ("sink", cfg.mask.sink),
      )
      if used
    ]
    if missing:
      raise ValueError(
        f"{', '.join(missing)} not supported by implementation='xla' "
        "(jax.nn.dot_product_attention has no such option); use 'pallas' "
        "or 'reference'."
      )
  if cfg.policy.smooth_k and cfg.mask.softcap is not None:
    raise ValueError(
      "smooth_k=on subtracts K's mean, which moves each score row by a "
      "constant: softmax removes it, a softcap's tanh does not. Use "
      "smooth_k=off with softcap."
    )
  check_flag("return_lse", return_lse)
  if return_lse and implementation != "pallas":
    raise ValueError("return_lse=True is only available for 'pallas'.")


@functools.partial(
  jax.jit, static_argnames=("implementation", "cfg", "return_lse")
)
def _compute(
  q, k, v, ops, *, implementation: str, cfg: KernelConfig, return_lse: bool
):
  """One compiled program per (shapes, implementation, configuration)."""
  # Explicit rounding: a bare cast to a half type may be skipped by XLA when
  # the next op widens it again (see `rounding.py`).
  ar = PolicyArithmetic(cfg.policy)
  q, k, v = (ar.round_inputs(x) for x in (q, k, v))
  scales = None
  if cfg.policy.quantizes:
    q, k, v, scales = quantization.prepare(
      q, k, v, cfg.policy, cfg.block_q, cfg.block_k
    )
  if implementation == "pallas":
    if return_lse:
      return flash_attention_with_lse(q, k, v, ops, cfg, scales)
    if scales is not None:
      return quantized_flash_attention(q, k, v, ops, scales, cfg)
    return flash_attention(q, k, v, ops, cfg)
  if implementation == "reference":
    return reference_attention(
      q,
      k,
      v,
      ops,
      policy=cfg.policy,
      spec=cfg.mask,
      tie_beta=cfg.tie_beta,
      scales=scales,
    )
  return xla_attention(q, k, v, ops, policy=cfg.policy, spec=cfg.mask)
