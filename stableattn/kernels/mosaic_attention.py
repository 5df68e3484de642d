"""`implementation="mosaic_gpu"`: our flash attention on Pallas Mosaic GPU
(Hopper), forward and backward, under the precision policy it can honour.

What the path honours of a policy: 16-bit inputs and matmul operands
(BF16 or FP16, one format), or FP8 operands with scales, forward only
(`mosaic_plan.quantized`: per tensor, per tile, per token or per
channel, after the Hadamard rotation or K's smoothing where the policy
asks), FP32 products (wgmma's accumulator); the
scores, softmax statistics, output accumulator, delta and gradient
accumulators in FP32, BF16 or FP16, each rounded where the Triton path
rounds it (`mosaic_block_math`); P rounded to the operand format before
P V (wgmma takes one format); O normalized once, at the end; the softmax
in base 2 (`exp2`); an FP8 KV cache (read before the kernel, as on the
Triton path); and the stable presets' options: l summing the rounded P
(`softmax_sum=rounded_probs`), delta from O_hi + O_lo and by matmul (its
diagonal by wgmma, `mosaic_delta`), m and l kept apart, dS as dS_hi +
dS_lo for dQ, d(sink) from the softmax's own P (`sink_delta=probs`: the
dQ kernel sums rowsum(P dP) and rowsum(P)), and Qiu & Yao's fix for
tied maxima (`tie_beta`). The output is stored in the inputs' format
or FP32. Features: causal (top-left, or bottom-right with array lengths
or each example's own), GQA, key lengths and segments, a
local window, a softcap, a sink and a bias (each with its gradient), a
dense mask, split-KV decoding, and head dims from 16 to absorbed MLA's
576/512, with gradients (a head dim over 256 in column parts,
`mosaic_plan.value_parts`; the backward's split,
`mosaic_backward_layout`).
Everything else is refused in one line naming the stage,
feature or option (`refusals`, `tile_refusals`). On a CPU the kernels
run in jax's GPU interpret mode; FlashAttention-3's form of the forward
is behind `Options.hopper_form`'s switches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stableattn.contract.masking import (
  MaskOperands,
  keys_of_some_query,
  keys_some_query_attends,
  without_unattended_keys,
)
from stableattn.contract.options import (
  SEQUENTIAL_SCHEDULE_FLAG,
  hopper_switches,
  sequential_schedule_set,
)
from stableattn.kernels.backward_delta import delta_operands
from stableattn.kernels.flash_attention import (
  bias_gradient,
  pad_operands,
  pad_to,
  sink_gradient,
  zero_cotangent,
)
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.mosaic_backward import mosaic_backward
from stableattn.kernels.mosaic_backward_layout import backward_layout
from stableattn.kernels.mosaic_delta import mosaic_delta
from stableattn.kernels.mosaic_forward import mosaic_forward
from stableattn.kernels.mosaic_forward_block import (
  input_names,
  output_names,
  shared_bytes,
)
from stableattn.kernels.mosaic_plan import (
  padded,
  plan_of,
  range_rows,
  tiled_config,
)
from stableattn.kernels.mosaic_support import ROWS, SHARED_MEMORY_BYTES
from stableattn.kernels.residuals import check_split_residuals, residual_names
from stableattn.kernels.split_merge import merge_splits
from stableattn.numerics.rounding import PolicyArithmetic

OPERAND_FORMATS = ("bf16", "fp16")
# wgmma accumulates its products in FP32 and nothing else.
PRODUCT_STAGES = ("matmul_accum",)
# Formats the kernels round their FP32 values to, stage by stage
# (`mosaic_block_math`): a cast round trip on a GPU.
ROUNDED_FORMATS = ("fp32", "bf16", "fp16")
ROUNDED_STAGES = (
  "scores",
  "softmax_stats",
  "out_accum",
  "delta",
  "grad_accum",
)
# Policy options at these values only (the stable presets' options and
# the emulations of other hardware are the Triton path's).
OPTION_VALUES = {
  "key_order": "forward",
  "scaling": "none",
  "hadamard": False,
  "smooth_k": False,
  "mma_chunk": 0,
  "score_chunk": 0,
  "promote_every": 1,
}
# FP8 operands wgmma multiplies (scaled as `quantization.py` says), and
# the options that prepare them before the kernel.
FP8_OPERANDS = ("fp8_e4m3", "fp8_e5m2")
SCALED_OPTIONS = {
  "scaling": ("tensor", "block", "token"),
  "hadamard": (False, True),
  "smooth_k": (False, True),
}
# The stable presets' options this path runs (`precision.STABLE_OPTIONS`;
# sink_delta's both values).
STABILITY_VALUES = {
  "delta_source": ("output", "hi_lo"),
  "delta_product": ("rowsum", "matmul"),
  "softmax_residuals": ("lse", "max_sum"),
  "ds_for_dq": ("rounded", "hi_lo"),
}


def interpreter_lacks() -> dict[str, str]:
  """{switch: what the installed jax's GPU interpreter lacks} for each of
  FlashAttention-3's switches (`Options.hopper_form`) it cannot run; all
  of them lower for sm_90. Measured: jax 0.10.2's interpreter has no
  rule for a transposed shared-memory view ("'TransposeTransform' object
  has no attribute 'indices'"), jax 0.11.2's runs it (bit for bit with
  K^T from global memory); more than one warpgroup deadlocks it under
  XLA:CPU's default schedule (`SEQUENTIAL_SCHEDULE_FLAG`); neither takes
  wgmma's A from registers ("Expected shape (5,) but got (64, 64)") or
  accumulates in place (0.10: "Higher-order primitive run_state"; 0.11:
  no CPU rule for 'wgmma')."""
  lacks = {
    "p_in_registers": "wgmma's A operand from registers",
    "accumulate_in_place": "wgmma accumulating into a running accumulator "
    "(pl.run_state)",
  }
  if not sequential_schedule_set():
    for switch in ("warp_specialized", "two_consumers"):
      lacks[switch] = (
        "two or three warpgroups without deadlocking under XLA:CPU's "
        f"default schedule (set XLA_FLAGS={SEQUENTIAL_SCHEDULE_FLAG} "
        "before jax starts; docs/findings.md)"
      )
  if jax.__version_info__ < (0, 11):
    lacks["k_as_stored"] = "a transposed shared-memory view as wgmma's B"
  return lacks


def refusals(cfg: KernelConfig) -> list[str]:
  """Why the Mosaic GPU path cannot run `cfg`, one line per reason."""
  return _policy_refusals(cfg.policy) + _call_refusals(cfg)


def _operands_refused(policy) -> bool:
  if policy.inputs not in OPERAND_FORMATS:
    return True
  if policy.quantizes:
    return policy.matmul_operands not in FP8_OPERANDS
  return policy.matmul_operands != policy.inputs


def _policy_refusals(policy) -> list[str]:
  """What of the precision policy alone this path cannot honour."""
  why = []
  if _operands_refused(policy):
    why.append(
      f"inputs={policy.inputs}, matmul_operands={policy.matmul_operands}: "
      "wgmma multiplies BF16 or FP16 operands of the inputs' format, or "
      "FP8 ones with scales, here (FP32 operands would be TF32; INT8 and "
      "FP4 have no such form)"
    )
  if policy.probs != policy.matmul_operands:
    why.append(
      f"probs={policy.probs}: P enters P V as a wgmma operand, in "
      f"matmul_operands' format ({policy.matmul_operands})"
    )
  why += [
    f"{stage}={getattr(policy, stage)}: this path's products are wgmma's "
    "own FP32 accumulator, which no other format can be emulated inside "
    "(the Triton path, implementation='pallas', emulates it)"
    for stage in PRODUCT_STAGES
    if getattr(policy, stage) != "fp32"
  ]
  why += [
    f"{stage}={getattr(policy, stage)}: one of {list(ROUNDED_FORMATS)} on "
    "this path (FP32 values rounded to the stage's format)"
    for stage in ROUNDED_STAGES
    if getattr(policy, stage) not in ROUNDED_FORMATS
  ]
  if policy.output not in (policy.inputs, "fp32"):
    why.append(f"output={policy.output}: stored in the inputs' format or fp32")
  scaled_options = SCALED_OPTIONS if policy.quantizes else {}
  why += [
    f"{name}={getattr(policy, name)!r}: only "
    f"{scaled_options.get(name, (value,))!r} on this path (the Triton "
    "path, implementation='pallas', runs it)"
    for name, value in OPTION_VALUES.items()
    if getattr(policy, name) not in scaled_options.get(name, (value,))
  ]
  why += [
    f"{name}={getattr(policy, name)!r}: one of {list(values)} on this path"
    for name, values in STABILITY_VALUES.items()
    if getattr(policy, name) not in values
  ]
  return why


def _call_refusals(cfg: KernelConfig) -> list[str]:
  """What of the call's features and options, under its policy, this
  path cannot run."""
  policy, options = cfg.policy, cfg.options
  why = []
  features = {
    # paged_attention gathers the pages for this path.
    "pages read in place (a paged KV cache)": cfg.page_size is not None,
    "scheme=fa1": options.scheme != "fa2",
  }
  why += [
    f"{name}: not built on this path" for name, on in features.items() if on
  ]
  if cfg.interpret:
    lacks = interpreter_lacks()
    why += [
      f"hopper_form={cfg.options.hopper_form!r}: jax {jax.__version__}'s "
      f"GPU interpreter cannot run {lacks[switch]} ({switch}); the form is "
      "lowered and timed on a GPU"
      for switch in hopper_switches(cfg.options.hopper_form)
      if switch in lacks
    ]
  if "p_in_registers" in hopper_switches(options.hopper_form) and (
    policy.quantizes
  ):
    why.append(
      "hopper_form switch p_in_registers with FP8 operands: Mosaic GPU "
      "cannot move P from the scores' register layout to wgmma's 8-bit A "
      'layout ("Cannot convert from TiledLayout"); P goes through '
      "shared memory"
    )
  if (
    "accumulate_in_place" in hopper_switches(options.hopper_form)
    and policy.out_accum != "fp32"
  ):
    why.append(
      f"hopper_form switch accumulate_in_place with out_accum="
      f"{policy.out_accum}: wgmma adds P V into O unrounded, the policy "
      "rounds P V first"
    )
  plan = plan_of(cfg, 1)
  split_size = cfg.options.split_size
  if split_size is not None and split_size % plan.block_k:
    why.append(
      f"split_size={split_size}: a multiple of this path's key block "
      f"({plan.block_k})"
    )
  needs = shared_bytes(plan)
  if needs > SHARED_MEMORY_BYTES:
    why.append(
      f"head dims {cfg.head_dim}/{cfg.value_dim} with these features: the "
      f"forward needs {needs:,} bytes of shared memory at 64-key blocks "
      f"and one ring slot; an H100's block has {SHARED_MEMORY_BYTES:,}"
    )
  return why


# The tiles this path runs: 64 query rows (one warpgroup's wgmma), key
# blocks of 64 or 128; the backward's tiles are its own.
BLOCK_KS = (64, 128)


def tile_refusals(options) -> list[str]:
  """Why the caller's (unclamped) tile and compiler options do not fit
  this path, one line per option."""
  why = []
  if options.block_q != ROWS:
    why.append(f"block_q={options.block_q}: one warpgroup's {ROWS} rows")
  if options.block_k not in BLOCK_KS:
    why.append(f"block_k={options.block_k}: one of {list(BLOCK_KS)}")
  why += [
    f"{name}={getattr(options, name)}: a Triton path option ('pallas')"
    for name in ("bwd_block_q", "bwd_block_k", "num_warps", "num_stages")
    if getattr(options, name) is not None
  ]
  return why


def check_tiles(options) -> None:
  why = tile_refusals(options)
  if why:
    raise ValueError(
      "implementation='mosaic_gpu' cannot take these options: "
      f"{'; '.join(why)}."
    )


def check_supported(cfg: KernelConfig) -> None:
  why = refusals(cfg)
  if why:
    raise ValueError(
      f"implementation='mosaic_gpu' cannot run precision {cfg.policy.name!r} "
      f"with these options: {'; '.join(why)}."
    )


def _forward(q, k, v, ops, cfg: KernelConfig, scales=None):
  plan = plan_of(cfg, q.shape[2] // k.shape[2])
  if plan.token_ids:
    # P is 0 at keys no query attends, but 0 x NaN is NaN.
    k, v = without_unattended_keys(keys_of_some_query(ops), k, v)
  if ops.mask is not None:
    k, v = without_unattended_keys(keys_some_query_attends(ops.mask != 0), k, v)
  q_p, k_p, v_p, features = padded(q, k, v, ops, cfg, plan, scales)
  k_read = k_p if plan.k_as_stored else jnp.transpose(k_p, (0, 2, 3, 1))
  inputs = tuple(features[name] for name in input_names(plan))
  out_p, lse, *kept = mosaic_forward(q_p, k_read, v_p, inputs, plan)
  extra = dict(zip(output_names(plan)[2:], kept))
  if plan.blocks_per_split is not None:
    out_p, lse = merge_splits(out_p, lse, cfg)
  out = out_p[:, : cfg.q_len, :, : cfg.value_dim]
  return out, (q_p, k_p, v_p, features, out_p, lse, extra)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def mosaic_flash_attention(q, k, v, ops: MaskOperands, cfg: KernelConfig):
  """Flash attention of q [B, T, H, D], k [B, S, Hkv, D], v [B, S, Hkv,
  Dv] on Mosaic GPU; `check_supported(cfg)` first."""
  return _forward(q, k, v, ops, cfg)[0]


def mosaic_flash_attention_with_lse(q, k, v, ops, cfg, scales=None):
  out, residuals = _forward(q, k, v, ops, cfg, scales)
  return out, residuals[-2][:, :, : cfg.q_len]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def mosaic_quantized_attention(q, k, v, ops, scales, cfg: KernelConfig):
  """Attention with FP8 operands (`scales` from `quantization.prepare`)
  on Mosaic GPU: the forward only (`_check_differentiable`)."""
  return _forward(q, k, v, ops, cfg, scales)[0]


def _no_fp8_gradient(cfg: KernelConfig, *_):
  """Both rules of `mosaic_quantized_attention`'s VJP: the refusal."""
  _check_differentiable(cfg)  # raises for FP8 operands


mosaic_quantized_attention.defvjp(
  lambda *args: _no_fp8_gradient(args[-1]), _no_fp8_gradient
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def mosaic_flash_attention_and_lse(q, k, v, ops, cfg: KernelConfig):
  """`mosaic_flash_attention` that also returns the log-sum-exp [B, H, T]
  beside the output; the lse's cotangent is dropped (read it under
  stop_gradient)."""
  return mosaic_flash_attention_with_lse(q, k, v, ops, cfg)


def _and_lse_fwd(q, k, v, ops, cfg):
  _check_differentiable(cfg)
  out, residuals = _forward(q, k, v, ops, cfg)
  return (out, residuals[-2][:, :, : cfg.q_len]), (residuals, ops)


def _and_lse_bwd(cfg: KernelConfig, saved, cotangents):
  return _bwd(cfg, saved, cotangents[0])


def _check_differentiable(cfg: KernelConfig) -> None:
  """What this path's backward cannot take, refused in the forward rule
  (the forward alone runs): a stable preset's residuals under split-KV,
  as on the Triton path (`residuals.check_split_residuals`), and FP8
  operands. Every backward kernel fits where the forward does
  (`mosaic_backward_layout`, tested over head dims and features)."""
  if cfg.policy.quantizes:
    raise ValueError(
      f"implementation='mosaic_gpu' has no gradient under precision "
      f"{cfg.policy.name!r}: FP8 operands' straight-through backward "
      "multiplies FP32 operands, which wgmma takes only as TF32 "
      "(FlashAttention-3's FP8 kernel has no backward either); "
      "differentiate with implementation='pallas'"
    )
  check_split_residuals(cfg, residual_names(cfg.policy))


def _fwd(q, k, v, ops, cfg):
  _check_differentiable(cfg)
  out, residuals = _forward(q, k, v, ops, cfg)
  return out, (residuals, ops)


def _bwd(cfg: KernelConfig, saved, d_out):
  (q_p, k_p, v_p, features, out_p, lse, extra), ops = saved
  plan = plan_of(cfg, q_p.shape[2] // k_p.shape[2])
  d_out_p = pad_to(
    d_out.astype(out_p.dtype), plan.q_len_padded, plan.padded_value_dim
  )
  delta = mosaic_delta(delta_operands(out_p, extra), d_out_p, plan)
  stats = (extra["m"], extra["l"]) if plan.max_sum else (lse,)
  block_k = backward_layout(plan).block_k
  if "ranges" in features and block_k != plan.block_k:
    # dQ walks key blocks of its own width.
    ops_p = pad_operands(ops, tiled_config(cfg, plan))
    ranges = range_rows(ops_p, cfg, plan, q_p.shape[0], block_k)[0]
    features = features | {"ranges": ranges}
  dq, dk, dv, dbias, sink_sums = mosaic_backward(
    q_p, k_p, v_p, d_out_p.astype(q_p.dtype), stats, delta, features, plan
  )
  ar = PolicyArithmetic(cfg.policy)
  batch, kv_len, kv_heads = k_p.shape[:3]

  def sum_groups(g):
    if plan.group == 1:
      return g
    g = g.reshape(batch, kv_len, kv_heads, plan.group, g.shape[-1])
    return ar.sum(g, "grad_accum", axis=3)

  dq = dq[:, : cfg.q_len, :, : cfg.head_dim]
  dk = sum_groups(dk)[:, : cfg.kv_len, :, : cfg.head_dim]
  dv = sum_groups(dv)[:, : cfg.kv_len, :, : cfg.value_dim]
  grads = tuple(ar.stored(g, "inputs") for g in (dq, dk, dv))
  d_ops = jax.tree_util.tree_map(zero_cotangent, ops)
  if dbias is not None:
    d_ops = d_ops._replace(bias=bias_gradient(dbias, ops.bias, cfg))
  if plan.sink:
    # The sink's value is 0: it reaches dQ, dK and dV only through the
    # lse; its own gradient is the Triton path's (`sink_gradient`), from
    # delta, or under sink_delta=probs from the dQ kernel's sums.
    terms = (delta, None) if sink_sums is None else sink_sums
    d_ops = d_ops._replace(sink=sink_gradient(ops.sink, lse, terms, cfg))
  return (*grads, d_ops)


mosaic_flash_attention.defvjp(_fwd, _bwd)
mosaic_flash_attention_and_lse.defvjp(_and_lse_fwd, _and_lse_bwd)
