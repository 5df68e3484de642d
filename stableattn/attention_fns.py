"""Every attention by name, behind one calling contract.

The model's layers, the benchmark and kernel checks all resolve attention
here, so a name is defined once:

* our implementations of `stableattn.attention` (`IMPLEMENTATIONS`:
  "pallas", "reference", "xla"), each under a precision policy;
* the kernels users compare against (`PEERS`): "cudnn"
  (`jax.nn.dot_product_attention(implementation="cudnn")`, GPU only) and
  "jax_mha" (jax's Pallas Triton `mha` with its own tile sizes; interpret
  mode off the GPU);
* any importable function, named "package.module:function".

The contract: `fn(q, k, v, *, causal: bool) -> out`, with q of shape
[batch, q_len, heads, head_dim], k and v [batch, kv_len, kv_heads,
head_dim] (kv_heads dividing heads) and out shaped like q; causal masking
is top-left aligned (query i sees keys 0..i), the scale 1/sqrt(head_dim).
A kernel with another layout is wrapped to this one by its caller, e.g.
`lambda q, k, v, *, causal: my_bhtd(q.swapaxes(1, 2), ...).swapaxes(1, 2)`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable

import jax
from jax.experimental.pallas.ops.gpu import attention as jax_gpu_attention

from stableattn.dispatch import IMPLEMENTATIONS, attention

PEERS = ("cudnn", "jax_mha")
NAMES = IMPLEMENTATIONS + PEERS

AttentionFn = Callable[..., jax.Array]


def needs_gpu(name: str) -> bool:
  """True for kernels that run on an NVIDIA GPU only (cuDNN); jax's
  Pallas `mha` runs anywhere, in interpret mode off the GPU."""
  return name == "cudnn"


def check_name(name: str) -> None:
  """Raises a ValueError naming the valid choices for an unknown name."""
  if name in NAMES or (isinstance(name, str) and ":" in name):
    return
  raise ValueError(
    f"Unknown attention {name!r}; valid: {list(NAMES)} or an import path "
    "'package.module:function'."
  )


def resolve(
  name: str,
  *,
  precision: str = "fp32",
  block_q: int = 64,
  block_k: int = 64,
  scheme: str = "fa2",
  tie_beta: float | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
) -> AttentionFn:
  """fn(q, k, v, *, causal) for one attention name.

  Args:
    name: one of `NAMES` or "package.module:function".
    precision, block_q, block_k, scheme, tie_beta, num_warps, num_stages:
      passed to `stableattn.attention` for our implementations (the tile
      and Triton arguments only where they apply); peers and imported
      functions ignore them.

  Raises:
    ValueError: for an unknown name, an import path that does not resolve,
      or an imported object that is not callable as the contract says.
  """
  check_name(name)
  if name in IMPLEMENTATIONS:
    options = dict(implementation=name, precision=precision)
    if name != "xla":
      options.update(block_q=block_q, block_k=block_k, scheme=scheme)
      options.update(tie_beta=tie_beta)
    if name == "pallas":
      options.update(num_warps=num_warps, num_stages=num_stages)
    return functools.partial(attention, **options)
  if name == "cudnn":
    return _cudnn
  if name == "jax_mha":
    return _jax_mha
  return import_attention(name)


def _cudnn(q, k, v, *, causal: bool = False):
  return jax.nn.dot_product_attention(
    q, k, v, is_causal=causal, implementation="cudnn"
  )


def _jax_mha(q, k, v, *, causal: bool = False):
  return jax_gpu_attention.mha(
    q,
    k,
    v,
    segment_ids=None,
    sm_scale=q.shape[-1] ** -0.5,
    causal=causal,
    interpret=jax.default_backend() != "gpu",
  )


def import_attention(path: str) -> AttentionFn:
  """The function at "package.module:function", checked against the
  contract's signature."""
  module_name, _, attribute = path.partition(":")
  if not module_name or not attribute:
    raise ValueError(
      f"Attention import path {path!r} must look like "
      "'package.module:function'."
    )
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"Cannot import module {module_name!r} ({e}).") from e
  fn = module
  for part in attribute.split("."):
    fn = getattr(fn, part, None)
    if fn is None:
      raise ValueError(f"Module {module_name!r} has no {attribute!r}.")
  if not callable(fn):
    raise ValueError(f"{path!r} is a {type(fn).__name__}, not a function.")
  try:
    inspect.signature(fn).bind(None, None, None, causal=False)
  except TypeError as e:
    raise ValueError(
      f"{path!r} does not take (q, k, v, *, causal): {e}. Wrap it to the "
      "contract in stableattn/attention_fns.py."
    ) from e
  except ValueError:  # no signature to read (a builtin): trust the caller
    pass
  return fn
