"""PyTorch attention kernels on the registry's contract, with gradients.

`torch_attention(kernel)` is a JAX function `fn(q, k, v, **features)`:
the inputs go to PyTorch without a copy (torch tensors are views of the
NumPy buffers `jax.pure_callback` hands over), the kernel runs there, and
the output comes back; under `jax.vjp` the
backward runs the kernel again under `torch.autograd` and returns dQ, dK
and dV. So the audit judges a PyTorch kernel exactly as it judges ours:
the four rules on output and gradients, determinism, NaN/Inf, the
invariance probes.

A kernel is a `TorchKernel`: a torch function with SDPA's signature,
`fn(query, key, value, attn_mask=None, is_causal=False, scale=None,
enable_gqa=False)` in torch's [batch, heads, length, head_dim] layout
(`layout="bhsd"`, or "bshd" for ours), plus what it can express. The
features map to it as follows:

  causal          `is_causal=True` when the mask is nothing else and the
                  alignment is top-left (SDPA's `is_causal` is top-left:
                  query i sees keys j <= i), else a boolean `attn_mask`
  window, lengths,
  segments, mask  one boolean `attn_mask` [B|1, H|1, T, S], built from
                  `stableattn.contract.masking` (the same pairs every
                  implementation here attends)
  bias            an additive float `attn_mask` (-inf where not allowed)
  scale           `scale`
  GQA             `enable_gqa=True` when kv_heads < heads
  softcap         only for a kernel that takes a score modification
                  (FlexAttention's `score_mod`)

A feature the kernel cannot express raises one line saying so. The
PyTorch runs are eager (`jax.pure_callback`): under `jax.jit` the
features' arrays must be concrete.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from stableattn.contract.features import Features
from stableattn.contract.masking import allowed_pairs
from stableattn.ops.registry import LAYOUTS

INSTALL = (
  "PyTorch is not installed: pip install 'stableattn[torch]' (on a CPU "
  "machine, pip install torch==2.13.0 first takes the CPU build) to audit "
  "PyTorch kernels"
)


def import_torch():
  """torch, or a ValueError saying how to install it."""
  try:
    return importlib.import_module("torch")
  except ImportError as e:
    raise ValueError(f"{INSTALL} ({e}).") from e


@dataclasses.dataclass(frozen=True)
class TorchKernel:
  """A PyTorch attention function and what it can express.

  fn: SDPA's signature (see the module docstring) in `layout`.
  score_mod: fn also takes `softcap=` (FlexAttention's score_mod).
  backward: the kernel has a backward on this machine; without one the
    bridge's gradients raise, saying so (FlexAttention on a CPU).
  """

  fn: Callable
  layout: str = "bhsd"
  name: str = "torch kernel"
  score_mod: bool = False
  backward: bool = True

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(
        f"layout must be one of {LAYOUTS} (torch's is 'bhsd'), got "
        f"{self.layout!r}."
      )


def to_torch(x: np.ndarray):
  """A torch tensor sharing `x`'s memory (BF16 through an int16 view,
  which NumPy and torch both hold)."""
  torch = import_torch()
  x = np.ascontiguousarray(x)
  with warnings.catch_warnings():
    # JAX hands callbacks read-only arrays; the bridge only reads them
    # (gradients are taken on clones), so sharing the memory is safe.
    warnings.filterwarnings("ignore", "The given NumPy array is not writable")
    if x.dtype == ml_dtypes.bfloat16:
      return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def to_numpy(t) -> np.ndarray:
  torch = import_torch()
  t = t.detach().contiguous()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


@dataclasses.dataclass(frozen=True)
class TorchCall:
  """The torch-side arguments of one call, from our features: NumPy
  arrays, built once and handed to every forward and backward."""

  attn_mask: np.ndarray | None
  is_causal: bool
  scale: float
  enable_gqa: bool
  softcap: float | None

  def kwargs(self) -> dict:
    out = {"is_causal": self.is_causal, "scale": self.scale}
    if self.attn_mask is not None:
      out["attn_mask"] = to_torch(self.attn_mask)
    if self.enable_gqa:
      out["enable_gqa"] = True
    if self.softcap is not None:
      out["softcap"] = self.softcap
    return out


def torch_call(kernel: TorchKernel, q_shape, k_shape, features: dict):
  """Our features as the kernel's arguments; one line for what it lacks."""
  if features.get("sink") is not None:
    raise ValueError(
      f"{kernel.name} cannot take the feature 'sink' (an extra logit in "
      "each row's softmax): SDPA has no such argument."
    )
  if features.get("softcap") is not None and not kernel.score_mod:
    raise ValueError(
      f"{kernel.name} cannot take the feature 'softcap': SDPA has no "
      "score modification (FlexAttention's score_mod has; use torch_flex)."
    )
  try:
    spec, ops = Features.of(features).split(q_shape, k_shape, xp=np)
  except jax.errors.TracerArrayConversionError as e:
    raise ValueError(
      f"{kernel.name} runs eagerly in PyTorch: its features' arrays must "
      "be concrete (call it outside jax.jit)."
    ) from e
  plain_causal = (
    spec.causal
    and spec.alignment == "top_left"
    and spec.window is None
    and not spec.token_ids
    and not spec.key_positions
    and spec.dense_mask is None
    and spec.bias is None
  )
  unmasked = not spec.causal and (
    spec.window is None
    and not spec.token_ids
    and not spec.key_positions
    and spec.dense_mask is None
    and spec.bias is None
  )
  attn_mask = None
  if not (plain_causal or unmasked):
    allowed = np.asarray(allowed_pairs(spec, ops, q_shape[1], k_shape[1], np))
    attn_mask = allowed
    if spec.bias is not None:
      bias = np.asarray(ops.bias, np.float32)
      attn_mask = np.where(allowed, bias, -np.inf).astype(np.float32)
  return TorchCall(
    attn_mask=attn_mask,
    is_causal=plain_causal,
    scale=float(spec.scale),
    enable_gqa=q_shape[2] != k_shape[2],
    softcap=spec.softcap,
  )


def _to_layout(t, layout: str):
  return t.transpose(1, 2) if layout == "bhsd" else t


def _forward(kernel: TorchKernel, call: TorchCall, q, k, v, grad_of=None):
  """out (and, given `grad_of` = d_out, (dq, dk, dv)) as NumPy arrays."""
  torch = import_torch()
  tensors = [to_torch(x) for x in (q, k, v)]
  if grad_of is not None:
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
  inputs = [_to_layout(t, kernel.layout) for t in tensors]
  with torch.set_grad_enabled(grad_of is not None):
    out = kernel.fn(*inputs, **call.kwargs())
    out = _to_layout(out, kernel.layout)
  if grad_of is None:
    return to_numpy(out)
  grads = torch.autograd.grad(out, tensors, to_torch(grad_of))
  return tuple(to_numpy(g) for g in grads)


def torch_attention(kernel: TorchKernel) -> Callable:
  """fn(q, k, v, **features) on our contract that runs `kernel` in
  PyTorch, differentiable through `torch.autograd`."""

  def fn(q, k, v, **features):
    call = torch_call(kernel, q.shape, k.shape, features)
    out_type = jax.ShapeDtypeStruct((*q.shape[:3], v.shape[3]), q.dtype)

    def forward(q, k, v):
      return jax.pure_callback(
        lambda *a: _forward(kernel, call, *a), out_type, q, k, v
      )

    @jax.custom_vjp
    def attend(q, k, v):
      return forward(q, k, v)

    def attend_fwd(q, k, v):
      return forward(q, k, v), (q, k, v)

    def attend_bwd(saved, d_out):
      if not kernel.backward:
        raise NotImplementedError(
          f"{kernel.name} has no backward on this machine (n/a on CPU): "
          "audit it with tensors=('out',)."
        )
      types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in saved)
      return jax.pure_callback(
        lambda q, k, v, d: _forward(kernel, call, q, k, v, grad_of=d),
        types,
        *saved,
        d_out.astype(saved[0].dtype),
      )

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))

  fn.__name__ = kernel.name
  fn.__signature__ = _contract_signature(kernel)
  return fn


# The contract's features a kernel can take, by what it can express.
SDPA_FEATURES = (
  "causal",
  "causal_alignment",
  "local_window_size",
  "query_seq_lengths",
  "key_value_seq_lengths",
  "segment_ids",
  "bias",
  "mask",
  "scale",
)


def _contract_signature(kernel: TorchKernel) -> inspect.Signature:
  """fn(q, k, v, *, <features it can express>): the audit reads it to say
  in one line which asked feature the kernel lacks."""
  names = (*SDPA_FEATURES, *(("softcap",) if kernel.score_mod else ()))
  parameters = [
    inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for n in ("q", "k", "v")
  ] + [
    inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
    for n in names
  ]
  return inspect.Signature(parameters)
