"""`attention`: one entry point, one validation, every implementation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from stableattn.contract import features as features_lib
from stableattn.contract import options as options_lib
from stableattn.contract.features import Features
from stableattn.contract.masking import (
  MaskSpec,
  keys_of_some_query,
  without_unattended_keys,
)
from stableattn.contract.options import ARITHMETIC_OPTIONS, Options
from stableattn.contract.shapes import check_shapes
from stableattn.contract.tiling import (
  check_block_size,
  check_flag,
  resolve_interpret,
)
from stableattn.kernels import centring, quantization
from stableattn.kernels.flash_attention import (
  flash_attention,
  flash_attention_and_lse,
  flash_attention_with_lse,
  flash_attention_with_statistics,
  quantized_flash_attention,
)
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.reference import reference_attention, xla_attention
from stableattn.numerics.precision import Precision, require_x64_if_needed
from stableattn.numerics.quant_options import MICRO_GROUPS
from stableattn.ops.flash_choice import flash_path, record_taken
from stableattn.ops.triton_limits import (
  gpu_unsupported_reason,
  shared_memory_reason,
)

IMPLEMENTATIONS = ("pallas", "reference", "xla", "mosaic_gpu", "flash")
# Our flash kernels: Pallas Triton, and Pallas Mosaic GPU for Hopper;
# "flash" picks one of the two per call (`flash_choice.flash_path`).
FLASH_IMPLEMENTATIONS = ("pallas", "mosaic_gpu", "flash")


def _check_choice(name: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"Unknown {name} {value!r}; valid: {list(valid)}.")


def validate_inputs(q, k, v) -> tuple:
  """Shape and dtype checks shared by every implementation; the inputs as
  JAX arrays."""
  check_shapes(q, k, v)
  return tuple(jnp.asarray(x) for x in (q, k, v))


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


def kernel_config(
  options: Options,
  q_shape,
  kv_shape,
  mask: MaskSpec,
  head_dim_v=None,
  triton: bool = True,
) -> KernelConfig:
  """`options` resolved against the shapes: the kernel's static
  configuration (tiles clamped to the lengths and checked for a GPU).
  `head_dim_v`: v's head dim where it differs from q's and k's (MLA).
  `triton`: check the tiles against a Triton program's shared memory
  (the Hopper path plans its own, `mosaic_plan.plan_of`)."""
  interpret = resolve_interpret(options.interpret)
  for_gpu = not interpret
  q_len, kv_len = q_shape[1], kv_shape[1]

  def tile(name, value, length):
    # Fixed tiles are not clamped to a short sequence: a decode step's one
    # query then runs in the same tile, and the same arithmetic, as its
    # row of the prefill pass.
    if options.fixed_tiles:
      length = None
    return check_block_size(name, value, for_gpu=for_gpu, length=length)

  block_q = tile("block_q", options.block_q, q_len)
  block_k = tile("block_k", options.block_k, kv_len)
  bwd_q, bwd_k = options.bwd_block_q, options.bwd_block_k
  bwd_block_q = tile("bwd_block_q", block_q if bwd_q is None else bwd_q, q_len)
  bwd_block_k = tile("bwd_block_k", block_k if bwd_k is None else bwd_k, kv_len)
  policy = options.precision
  group = MICRO_GROUPS.get(policy.scaling)
  if group and block_k % group and kv_len > block_k:
    raise ValueError(
      f"scaling={policy.scaling} groups P by {group} keys, so block_k "
      f"must be a multiple of {group} (got {block_k}): a group may not "
      "straddle two key tiles."
    )
  if options.split_size is not None and options.split_size % block_k:
    raise ValueError(
      f"split_size={options.split_size} must be a multiple of block_k="
      f"{block_k}: a split is a run of whole key blocks."
    )
  if for_gpu:
    reason = gpu_unsupported_reason(policy)
    if triton and not reason:
      reason = shared_memory_reason(
        policy,
        max(q_shape[3], head_dim_v or 0),
        (block_q, block_k, bwd_block_q, bwd_block_k),
      )
    if reason:
      raise ValueError(reason)
  resolved = dataclasses.replace(
    options,
    block_q=block_q,
    block_k=block_k,
    bwd_block_q=bwd_block_q,
    bwd_block_k=bwd_block_k,
    interpret=interpret,
  )
  if head_dim_v == q_shape[3]:
    head_dim_v = None
  return KernelConfig(
    resolved, mask, q_len, kv_len, q_shape[3], head_dim_v=head_dim_v
  )


def split_keywords(options, features, keywords: dict):
  """`options` and `features` with the loose keywords (fields of either)
  applied: the one place where keyword sugar becomes the two values."""
  option_names = set(options_lib.field_names())
  feature_names = set(features_lib.names())
  unknown = sorted(set(keywords) - option_names - feature_names)
  if unknown:
    raise ValueError(
      f"Unknown attention arguments {unknown}; valid options: "
      f"{sorted(option_names)}; valid features: {sorted(feature_names)}."
    )
  option_kw = {k: v for k, v in keywords.items() if k in option_names}
  if options is None:
    options = Options(**option_kw)
  elif not isinstance(options, Options):
    raise ValueError(
      f"options must be a stableattn.Options, got {type(options).__name__}."
    )
  elif option_kw:
    options = options.replace(**option_kw)
  feature_kw = {k: v for k, v in keywords.items() if k in feature_names}
  return options, Features.of(features, **feature_kw)


def check_options_for(implementation: str, options: Options) -> None:
  """Raises a ValueError for options `implementation` refuses whatever
  the shapes: what a command checks before its first case."""
  _check_choice("implementation", implementation, IMPLEMENTATIONS)
  if implementation == "mosaic_gpu":
    _mosaic().check_tiles(options)
  hopper = ("mosaic_gpu", "flash")
  if options.hopper_form != "interpreter" and implementation not in hopper:
    raise ValueError(
      f"hopper_form={options.hopper_form!r} is the Hopper path's option "
      "(implementation='mosaic_gpu', or 'flash' where it takes that "
      f"path), not implementation={implementation!r}'s."
    )
  if options.center_kv and implementation not in FLASH_IMPLEMENTATIONS:
    raise ValueError(
      f"center_kv=True is an option of our flash kernels "
      f"{list(FLASH_IMPLEMENTATIONS)}, not of implementation="
      f"{implementation!r}."
    )


def _mosaic():
  """The Mosaic GPU path, imported on use: jax's Mosaic GPU modules add
  half a second to every process's import."""
  from stableattn.kernels import mosaic_attention

  return mosaic_attention


def attention(
  q,
  k,
  v,
  *,
  implementation: str = "pallas",
  options: Options | None = None,
  features: Features | None = None,
  return_lse: bool = False,
  return_statistics: bool = False,
  **keywords,
):
  """Scaled dot-product attention under a precision policy.

  Args:
    q: [batch, q_len, heads, head_dim].
    k: [batch, kv_len, kv_heads, head_dim]; kv_heads divides heads.
    v: [batch, kv_len, kv_heads, head_dim_v]: head_dim_v is head_dim, or
      another value head dim (MLA, DeepSeek-V2/V3's 128 beside 192) for
      "pallas" and "reference".
    implementation: "pallas" (our flash kernel, Pallas Triton),
      "mosaic_gpu" (our flash kernel on Pallas Mosaic GPU, Hopper; the
      policies and features `kernels.mosaic_attention` lists), "flash"
      (the Mosaic GPU kernel where it runs the request on a Hopper or
      later GPU, else the Triton kernel: `flash_path` says which),
      "reference" (materialized baseline in jnp) or "xla"
      (`jax.nn.dot_product_attention`).
    options: how to compute (`stableattn.Options`: precision, tiles,
      scheme, Qiu & Yao's tie fix, compiler parameters, interpret);
      default Options().
    features: what to compute (`stableattn.Features`: causal, window,
      lengths, segments, bias, mask, scale, softcap, sink); default none.
    return_lse: also return the log-sum-exp [batch, heads, q_len] (pallas
      mosaic_gpu and flash only; not differentiable; +inf for a row no key
      attends).
    return_statistics: also return {"lse", "row_max", "second"}, each
      [batch, heads, q_len]: the log-sum-exp and each row's largest and
      second largest score from the kernel's own pass, for the monitor
      (`stableattn.numerics.monitor.kernel_statistics`; pallas only,
      without split-KV; not differentiable).
    **keywords: any field of `Options` or `Features` by name (sugar:
      `precision="bf16-fa2", causal=True`), applied over the two values.

  A row that no key attends gives output 0 and zero gradient. See
  `stableattn.contract.masking` for the exact semantics of every feature.

  Returns:
    [batch, q_len, heads, head_dim_v] in the policy's `output` format (and
    the log-sum-exp if `return_lse`).

  Raises:
    ValueError: for malformed inputs or unknown names; the message says what
      was received and what is valid.
  """
  options, features = split_keywords(options, features, keywords)
  check_options_for(implementation, options)
  if implementation not in FLASH_IMPLEMENTATIONS:
    # Tiles are validated for every implementation, so a sweep with a bad
    # tile fails the same way whichever runs first; only the kernel is
    # bound by GPU constraints.
    options = dataclasses.replace(options, interpret=True)
  require_x64_if_needed(options.precision)
  q, k, v = validate_inputs(q, k, v)
  spec, ops = features.split(q.shape, k.shape)
  shapes = (q.shape, k.shape, spec, v.shape[3])
  cfg = kernel_config(options, *shapes, triton=implementation == "pallas")
  if implementation == "flash":
    implementation = flash_path(cfg, options)
    if return_statistics:  # the Triton path's alone
      implementation = "pallas"
    if implementation == "pallas":  # its tiles must fit a Triton program
      cfg = kernel_config(options, *shapes)
    record_taken(implementation)
  _check_implementation_options(implementation, cfg, return_lse)
  check_flag("return_statistics", return_statistics)
  if cfg.options.center_kv:
    _check_center_kv(cfg, return_lse or return_statistics)
  if return_statistics and (implementation != "pallas" or return_lse):
    raise ValueError(
      "return_statistics=True is only available for 'pallas', and holds "
      "the lse already (without return_lse)."
    )
  returns = "statistics" if return_statistics else "lse" if return_lse else ""
  return _compute(
    q, k, v, ops, implementation=implementation, cfg=cfg, returns=returns
  )


def _check_implementation_options(
  implementation: str, cfg: KernelConfig, return_lse: bool
) -> None:
  """Raises for options the chosen implementation does not have."""
  if implementation == "xla":
    _check_xla(cfg)
  if implementation == "mosaic_gpu":
    _mosaic().check_supported(cfg)
  changed = [
    text
    for text, used in (
      ("exp2=on", cfg.policy.exp2 and implementation == "xla"),
      (f"mma_chunk={cfg.policy.mma_chunk}", cfg.policy.mma_chunk),
    )
    if used
  ]
  if changed and implementation != "pallas":
    raise ValueError(
      f"{', '.join(changed)} in precision {cfg.policy.name!r} describes "
      f"how a flash kernel computes; implementation={implementation!r} "
      "cannot: use 'pallas' (the Baseline follows exp2, not the MMA "
      "accumulator; it ignores the stability options, having no "
      "unnormalized P to sum and differentiating its own P)."
    )
  if cfg.policy.smooth_k and cfg.mask.softcap is not None:
    raise ValueError(
      "smooth_k=on subtracts K's mean, which moves each score row by a "
      "constant: softmax removes it, a softcap's tanh does not. Use "
      "smooth_k=off with softcap."
    )
  check_flag("return_lse", return_lse)
  if return_lse and implementation not in FLASH_IMPLEMENTATIONS:
    raise ValueError(
      "return_lse=True is only available for 'pallas', 'mosaic_gpu' and "
      "'flash'."
    )


def _check_center_kv(cfg: KernelConfig, returns) -> None:
  """What center_kv refuses once the features are known (the
  implementation was checked by `check_options_for`)."""
  reason = centring.refusal(cfg)
  if reason:
    raise ValueError(reason + ".")
  if returns:
    raise ValueError(
      "center_kv=True with return_lse or return_statistics: the kernel's "
      "log-sum-exp and largest scores are those of the centred keys "
      "(each row moved by q.mean(K)); ask for them without center_kv."
    )


def _check_xla(cfg: KernelConfig) -> None:
  if xla_unsupported_reason(cfg.policy):
    raise ValueError(xla_unsupported_reason(cfg.policy))
  if cfg.head_dim_v is not None:
    raise ValueError(
      f"implementation='xla' refuses a value head dim ({cfg.head_dim_v}) "
      f"other than the query/key head dim ({cfg.head_dim}): "
      "jax.nn.dot_product_attention takes k and v of one shape, and "
      "padding V would compute in a wider head dim than the model's; use "
      "'pallas' or 'reference'."
    )
  if cfg.policy.quantizes:
    raise ValueError(
      f"implementation='xla' cannot run precision {cfg.policy.name!r}: "
      "jax.nn.dot_product_attention has no FP8/FP4/INT8 operands with "
      "scaling; use 'pallas' or 'reference'."
    )
  missing = [n for n in ARITHMETIC_OPTIONS if getattr(cfg.options, n)]
  missing += [
    name
    for name, used in (
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


@functools.partial(
  jax.jit, static_argnames=("implementation", "cfg", "returns")
)
def _compute(
  q, k, v, ops, *, implementation: str, cfg: KernelConfig, returns: str = ""
):
  """One compiled program per (shapes, implementation, configuration)."""
  # Explicit rounding: a bare cast to a half type may be skipped by XLA when
  # the next op widens it again (see `rounding.py`).
  if cfg.mask.token_ids and (
    cfg.policy.quantizes or cfg.policy.kv_cache != "none"
  ):
    # Scales span keys: padding must not set them (an Inf there would).
    k, v = without_unattended_keys(keys_of_some_query(ops), k, v)
  q, k, v = quantization.stored_inputs(q, k, v, cfg.policy)
  scales = None
  if cfg.policy.quantizes:
    q, k, v, scales = quantization.prepare(
      q, k, v, cfg.policy, cfg.block_q, cfg.block_k
    )
  if cfg.options.center_kv:
    kernel = (
      flash_attention_and_lse
      if implementation == "pallas"
      else _mosaic().mosaic_flash_attention_and_lse
    )
    return centring.centred_attention(kernel, q, k, v, ops, cfg)
  if implementation == "pallas":
    if returns == "lse":
      return flash_attention_with_lse(q, k, v, ops, cfg, scales)
    if returns == "statistics":
      return flash_attention_with_statistics(q, k, v, ops, cfg, scales)
    if scales is not None:
      return quantized_flash_attention(q, k, v, ops, scales, cfg)
    return flash_attention(q, k, v, ops, cfg)
  if implementation == "mosaic_gpu":
    mosaic = _mosaic()
    if returns == "lse":
      return mosaic.mosaic_flash_attention_with_lse(q, k, v, ops, cfg, scales)
    if scales is not None:
      return mosaic.mosaic_quantized_attention(q, k, v, ops, scales, cfg)
    return mosaic.mosaic_flash_attention(q, k, v, ops, cfg)
  if implementation == "reference":
    return reference_attention(
      q, k, v, ops, options=cfg.options, spec=cfg.mask, scales=scales
    )
  return xla_attention(q, k, v, ops, policy=cfg.policy, spec=cfg.mask)
