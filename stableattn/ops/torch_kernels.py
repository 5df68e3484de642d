"""PyTorch's attention kernels, each a `torch_bridge.TorchKernel`: SDPA
under one backend at a time (math, flash, and on a CUDA device
memory-efficient and cuDNN), FlexAttention compiled, and any torch
function with SDPA's signature by import path. PyTorch is imported on
first use (the optional `[torch]` extra)."""

from __future__ import annotations

import functools

from stableattn.ops.torch_bridge import TorchKernel, import_torch

# Registry name -> SDPA backend (torch.nn.attention.SDPBackend member).
SDPA_BACKENDS = {
  "torch_sdpa_math": "MATH",
  "torch_sdpa_flash": "FLASH_ATTENTION",
  "torch_sdpa_efficient": "EFFICIENT_ATTENTION",
  "torch_sdpa_cudnn": "CUDNN_ATTENTION",
}


# Backends that refuse `enable_gqa` ("No available kernel" from the
# memory-efficient one on an H200, torch 2.11).
WITHOUT_GQA = ("EFFICIENT_ATTENTION",)


def sdpa(backend: str, repeat_kv_heads: bool | None = None):
  """F.scaled_dot_product_attention restricted to one backend (it raises
  rather than fall back to another), on the GPU where PyTorch has one
  (there `torch_sdpa_flash` is FlashAttention-2), else on the CPU. With
  `repeat_kv_heads` (a backend in `WITHOUT_GQA` by default), grouped
  key/value heads are repeated to the query heads instead of passing
  `enable_gqa`, as a caller of such a backend does."""
  torch = import_torch()
  from torch.nn.attention import SDPBackend, sdpa_kernel

  chosen = getattr(SDPBackend, backend)
  on_cuda = torch.cuda.is_available()
  if repeat_kv_heads is None:
    repeat_kv_heads = backend in WITHOUT_GQA

  def attention(query, key, value, **kwargs):
    if repeat_kv_heads and kwargs.pop("enable_gqa", False):
      group = query.shape[1] // key.shape[1]
      key, value = (x.repeat_interleave(group, dim=1) for x in (key, value))
    if on_cuda:
      query, key, value = (x.cuda() for x in (query, key, value))
      if "attn_mask" in kwargs:
        kwargs["attn_mask"] = kwargs["attn_mask"].cuda()
    with sdpa_kernel(chosen):
      out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, **kwargs
      )
    return out.cpu() if on_cuda else out

  return attention


@functools.cache
def _compiled_flex():
  import_torch()
  import torch
  from torch.nn.attention.flex_attention import flex_attention

  # Static shapes: with dynamic ones, inductor 2.13 on a CPU emits C++ that
  # does not compile for a block mask after a score_mod (cur_qSplitSize8).
  return torch.compile(flex_attention, dynamic=False)


def flex(
  query,
  key,
  value,
  attn_mask=None,
  is_causal=False,
  scale=None,
  enable_gqa=False,
  softcap=None,
):
  """FlexAttention with SDPA's arguments: the boolean mask (or causal) as
  a block mask, an additive mask and a softcap as the score_mod."""
  torch = import_torch()
  from torch.nn.attention.flex_attention import create_block_mask

  if query.device.type == "cpu" and torch.cuda.is_available():
    # FlexAttention's backward exists on a GPU only: run it there.
    moved = [x.cuda() for x in (query, key, value)]
    mask = None if attn_mask is None else attn_mask.cuda()
    out = flex(*moved, mask, is_causal, scale, enable_gqa, softcap)
    return out.cpu()
  q_len, kv_len = query.shape[2], key.shape[2]
  allowed = bias = None
  if attn_mask is not None and attn_mask.dtype == torch.bool:
    allowed = attn_mask
  elif attn_mask is not None:
    allowed, bias = attn_mask > -torch.inf, attn_mask

  def pick(tensor, b, h, qi, ki):
    return tensor[
      b if tensor.shape[0] > 1 else 0, h if tensor.shape[1] > 1 else 0, qi, ki
    ]

  block_mask = None
  if is_causal or allowed is not None:

    def mask_mod(b, h, qi, ki):
      return qi >= ki if allowed is None else pick(allowed, b, h, qi, ki)

    batch = None if allowed is None or allowed.shape[0] == 1 else query.shape[0]
    heads = None if allowed is None or allowed.shape[1] == 1 else query.shape[1]
    block_mask = create_block_mask(
      mask_mod, batch, heads, q_len, kv_len, device=str(query.device)
    )

  def score_mod(score, b, h, qi, ki):
    if softcap is not None:
      score = softcap * torch.tanh(score / softcap)
    if bias is not None:
      score = score + pick(bias, b, h, qi, ki).to(score.dtype)
    return score

  modified = softcap is not None or bias is not None
  return _compiled_flex()(
    query,
    key,
    value,
    score_mod=score_mod if modified else None,
    block_mask=block_mask,
    scale=scale,
    enable_gqa=enable_gqa,
  )


def kernel(name: str) -> TorchKernel:
  """The TorchKernel of a registry name or "torch:package.module:function"."""
  torch = import_torch()  # the install line first, before any import path
  if name in SDPA_BACKENDS:
    return TorchKernel(sdpa(SDPA_BACKENDS[name]), name=name)
  if name == "torch_flex":
    has_backward = torch.cuda.is_available()
    return TorchKernel(flex, name=name, score_mod=True, backward=has_backward)
  from stableattn.ops.registry import TORCH_PREFIX, import_object

  path = name.removeprefix(TORCH_PREFIX)
  return TorchKernel(import_object(path), name=path)
