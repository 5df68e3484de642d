"""PyTorch kernels with SDPA's signature that are wrong on purpose: the
audit must fail each, naming the rule and the tensor."""

import torch
import torch.nn.functional as F


def wrong_scale(query, key, value, *, scale=None, **kwargs):
  """Scores scaled by 1.25x the asked scale."""
  scale = (query.shape[-1] ** -0.5 if scale is None else scale) * 1.25
  return F.scaled_dot_product_attention(
    query, key, value, scale=scale, **kwargs
  )


class _MaskBlindBackward(torch.autograd.Function):
  """The masked output, with the gradients of unmasked attention."""

  @staticmethod
  def forward(ctx, query, key, value, kwargs):
    ctx.save_for_backward(query, key, value)
    ctx.kwargs = kwargs
    return F.scaled_dot_product_attention(query, key, value, **kwargs)

  @staticmethod
  def backward(ctx, d_out):
    query, key, value = ctx.saved_tensors
    unmasked = {
      k: v for k, v in ctx.kwargs.items() if k not in ("attn_mask", "is_causal")
    }
    with torch.enable_grad():
      inputs = [x.detach().requires_grad_(True) for x in (query, key, value)]
      out = F.scaled_dot_product_attention(*inputs, **unmasked)
      grads = torch.autograd.grad(out, inputs, d_out)
    return (*grads, None)


def gradient_ignores_the_mask(query, key, value, **kwargs):
  return _MaskBlindBackward.apply(query, key, value, kwargs)
