"""Every attention by name, behind one calling contract: the one registry.

The model's layers, the audit, the benchmark and the experiments resolve
attention here, so a name is defined once:

* our implementations of `stableattn.attention` (`IMPLEMENTATIONS`:
  "pallas", "reference", "xla", "mosaic_gpu"), each under an `Options`;
* the kernels users compare against (`PEERS`): "cudnn"
  (`jax.nn.dot_product_attention(implementation="cudnn")`, GPU only),
  "jax_mha" (jax's Pallas Triton `mha` with its own tile sizes; interpret
  mode off the GPU), "jax_mgpu" (jax's Mosaic GPU `attention_mgpu`,
  Hopper; n/a off a GPU while jax's GPU interpret mode cannot run it),
  jax's TPU kernels, and tokamax's implementations ("tokamax_xla",
  "tokamax_xla_chunked", "tokamax_triton", "tokamax_mosaic"; the optional
  `[peers]` extra), and PyTorch's (`TORCH_KERNELS`: SDPA's backends and
  FlexAttention, through `torch_bridge`; the optional `[torch]` extra);
* any importable function, named "package.module:function", and any
  PyTorch function with SDPA's signature, "torch:package.module:function".

The contract: `fn(q, k, v, **features) -> out`, with q of shape [batch,
q_len, heads, head_dim], k and v [batch, kv_len, kv_heads, head_dim]
(kv_heads dividing heads) and out shaped like q; `features` are the set
fields of a `stableattn.Features` under jax's names (`causal`,
`local_window_size`, `segment_ids`, `softcap`, ...), and only those are
passed, so a kernel takes the features it supports. A kernel with another
layout is wrapped to this one by its caller, e.g.
`lambda q, k, v, **f: my_bhtd(q.swapaxes(1, 2), ...).swapaxes(1, 2)`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable

import jax
from absl import flags

from stableattn.contract.options import Options
from stableattn.ops import jax_kernels, jax_mgpu
from stableattn.ops.dispatch import IMPLEMENTATIONS, attention, split_keywords

# PyTorch's kernels (the optional `[torch]` extra; `torch_kernels`): SDPA
# under one backend each, FlexAttention compiled.
TORCH_KERNELS = (
  "torch_sdpa_math",
  "torch_sdpa_flash",
  "torch_flex",
  "torch_sdpa_efficient",
  "torch_sdpa_cudnn",
)
TORCH_CUDA_ONLY = ("torch_sdpa_efficient", "torch_sdpa_cudnn")
TORCH_PREFIX = "torch:"
TOKAMAX = {
  "tokamax_xla": "xla",
  "tokamax_xla_chunked": "xla_chunked",
  "tokamax_triton": "triton",
  "tokamax_mosaic": "mosaic",
}

AttentionFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One name of the registry: how to build its fn from our `Options`
  (which the peers ignore), and whether it runs on an NVIDIA GPU only."""

  build: Callable[[Options], AttentionFn]
  gpu_only: bool = False
  # Why it has no gradients on this machine (a function: it may import
  # the kernel's library to tell), or None: it always has them.
  forward_only: Callable[[], str | None] | None = None
  # Why it cannot run on this machine at all (a function, as above), or
  # None: it runs here.
  unavailable: Callable[[], str | None] | None = None


def needs_gpu(name: str) -> bool:
  """True for kernels that run on an NVIDIA GPU only (cuDNN, tokamax's
  Pallas kernels); jax's Pallas `mha` runs anywhere, in interpret mode
  off the GPU."""
  return name in REGISTRY and REGISTRY[name].gpu_only


def unavailable(name: str) -> str | None:
  """Why `name` cannot run on this machine, or None where it can."""
  if needs_gpu(name) and jax.default_backend() != "gpu":
    return "it needs an NVIDIA GPU"
  entry = REGISTRY.get(name)
  return (
    None if entry is None or entry.unavailable is None else entry.unavailable()
  )


def check_name(name: str) -> None:
  """Raises a ValueError naming the valid choices for an unknown name."""
  if name in NAMES or (isinstance(name, str) and ":" in name):
    return
  raise ValueError(
    f"Unknown attention {name!r}; valid: {list(NAMES)}, an import path "
    "'package.module:function', or 'torch:package.module:function' for a "
    "PyTorch function with SDPA's signature."
  )


def resolve(
  name: str, options: Options | None = None, **option_keywords
) -> AttentionFn:
  """fn(q, k, v, **features) for one attention name.

  Args:
    name: one of `NAMES` or "package.module:function".
    options: how our implementations compute (`stableattn.Options`); the
      peers and imported functions compute their own way and ignore it.
    **option_keywords: fields of `Options`, applied over `options`.

  Raises:
    ValueError: for an unknown name, an import path that does not resolve,
      or an imported object that is not callable as the contract says.
  """
  check_name(name)
  options, _ = split_keywords(options, None, option_keywords)
  if name in REGISTRY:
    return REGISTRY[name].build(options)
  return import_attention(name)


# A kernel's tensor layout: ours (and jax.nn's) or torch's and the TPU
# kernels' with heads before length.
LAYOUTS = ("bshd", "bhsd")


def in_layout(fn: AttentionFn, layout: str) -> AttentionFn:
  """fn on the contract's [batch, length, heads, head_dim] layout, for a
  kernel written in `layout`: "bshd" is fn itself; "bhsd" transposes q,
  k and v in and the output out. The wrapper keeps fn's signature, so
  the features it takes are read as before."""
  if layout not in LAYOUTS:
    raise ValueError(
      f"layout must be one of {LAYOUTS} ('bshd': [batch, length, heads, "
      f"head_dim], ours; 'bhsd': heads before length, torch's), got "
      f"{layout!r}."
    )
  if layout == "bshd":
    return fn

  @functools.wraps(fn)
  def transposed(q, k, v, **features):
    out = fn(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), **features)
    return out.swapaxes(1, 2)

  return transposed


def unaccepted_features(fn, features: dict) -> list[str]:
  """The names in `features` that fn's signature cannot take."""
  try:
    parameters = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # no signature to read: trust the caller
    return []
  if any(p.kind is p.VAR_KEYWORD for p in parameters):
    return []
  taken = {
    p.name
    for p in parameters
    if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
  }
  return [name for name in features if name not in taken]


def _refuse(kernel: str, features: dict, supported) -> None:
  extra = sorted(set(features) - set(supported))
  if extra:
    raise ValueError(
      f"{kernel} does not support the features {extra}; it takes "
      f"{sorted(supported)}."
    )


_JAX_NN_FEATURES = (
  "causal",
  "local_window_size",
  "query_seq_lengths",
  "key_value_seq_lengths",
  "bias",
  "mask",
  "scale",
)


def _jax_nn(q, k, v, *, implementation: str, **features):
  """`jax.nn.dot_product_attention` with the contract's feature names."""
  _refuse(
    f"jax.nn.dot_product_attention ({implementation})",
    features,
    _JAX_NN_FEATURES,
  )
  is_causal = features.pop("causal", False)
  return jax.nn.dot_product_attention(
    q, k, v, is_causal=is_causal, implementation=implementation, **features
  )


def _jax_mha(q, k, v, *, causal: bool = False, segment_ids=None):
  # Imported on use: jax marks its Pallas GPU kernels as deprecated, and
  # importing the registry should not warn for a kernel nobody asked for.
  from jax.experimental.pallas.ops.gpu import attention as jax_gpu_attention

  return jax_gpu_attention.mha(
    q,
    k,
    v,
    segment_ids=segment_ids,
    sm_scale=q.shape[-1] ** -0.5,
    causal=causal,
    interpret=jax.default_backend() != "gpu",
  )


def _tokamax(q, k, v, *, implementation: str, **features):
  """tokamax's `dot_product_attention` (an optional peer: `pip install
  'stableattn[peers]'`), with the contract's feature names."""
  try:
    import tokamax
  except ImportError as e:
    raise ValueError(
      "tokamax is not installed: pip install 'stableattn[peers]' (or pip "
      f"install tokamax) to audit its kernels ({e})."
    ) from e
  _refuse(
    f"tokamax ({implementation})", features, (*_JAX_NN_FEATURES, "softcap")
  )
  # tokamax reads its absl flags on first use and parses sys.argv when no
  # one has, which fails under any other program's arguments (pytest's,
  # a notebook's); outside an absl app its flags keep their defaults.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  is_causal = features.pop("causal", False)
  if "softcap" in features:
    features["logits_soft_cap"] = features.pop("softcap")
  return tokamax.dot_product_attention(
    q, k, v, is_causal=is_causal, implementation=implementation, **features
  )


def import_object(path: str):
  """The callable at "package.module:function"."""
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
  return fn


def import_attention(path: str) -> AttentionFn:
  """The function at "package.module:function", checked against the
  contract's signature; "torch:package.module:function" is a PyTorch
  function with SDPA's signature, run through `torch_bridge`."""
  if path.startswith(TORCH_PREFIX):
    return _torch_entry(path).build(None)
  fn = import_object(path)
  try:
    inspect.signature(fn).bind(None, None, None)
  except TypeError as e:
    raise ValueError(
      f"{path!r} does not take (q, k, v, **features): {e}. Wrap it to the "
      "contract in stableattn/ops/registry.py."
    ) from e
  except ValueError:  # no signature to read (a builtin): trust the caller
    pass
  return fn


def forward_only(name: str) -> str | None:
  """Why `name` has no gradients on this machine, or None when it has."""
  if name in REGISTRY and REGISTRY[name].forward_only is not None:
    return REGISTRY[name].forward_only()
  return None


def _torch_entry(name: str) -> Entry:
  """A PyTorch kernel (`torch_kernels`), imported when first resolved."""

  def build(_):
    from stableattn.ops import torch_bridge, torch_kernels

    return torch_bridge.torch_attention(torch_kernels.kernel(name))

  def no_backward():
    from stableattn.ops import torch_kernels

    if torch_kernels.kernel(name).backward:
      return None
    return "FlexAttention has no backward on a CPU: gradients n/a on CPU"

  return Entry(
    build,
    gpu_only=name in TORCH_CUDA_ONLY,
    forward_only=no_backward if name == "torch_flex" else None,
  )


def _ours(name: str) -> Entry:
  return Entry(
    lambda options: functools.partial(
      attention, implementation=name, options=options
    )
  )


def _tokamax_entry(implementation: str) -> Entry:
  return Entry(
    lambda _: functools.partial(_tokamax, implementation=implementation),
    gpu_only=implementation in ("triton", "mosaic"),
  )


def _jax_kernel(name: str, forward_only: str | None = None, **entry) -> Entry:
  """One of the JAX ecosystem's kernels (`jax_kernels`), by function."""
  return Entry(
    lambda _: getattr(jax_kernels, name),
    forward_only=None if forward_only is None else lambda: forward_only,
    **entry,
  )


# The one table of names: ours first, then the peers users compare with.
REGISTRY: dict[str, Entry] = {
  **{name: _ours(name) for name in IMPLEMENTATIONS},
  "cudnn": Entry(
    lambda _: functools.partial(_jax_nn, implementation="cudnn"),
    gpu_only=True,
  ),
  # jax.nn as users call it, without the guards of our "xla" (which
  # zeroes keys no query attends, so NaN padding cannot leak).
  "jax_nn": Entry(lambda _: functools.partial(_jax_nn, implementation="xla")),
  "jax_mha": Entry(lambda _: _jax_mha),
  **{name: _tokamax_entry(impl) for name, impl in TOKAMAX.items()},
  **{name: _torch_entry(name) for name in TORCH_KERNELS},
  "jax_splash": _jax_kernel("splash"),
  "jax_tpu_flash": _jax_kernel("tpu_flash"),
  "jax_decode": _jax_kernel("decode", "jax's decode kernel has no VJP"),
  "jax_paged": _jax_kernel("paged", "jax's paged kernel has no VJP"),
  "jax_ragged_paged": _jax_kernel(
    "ragged_paged",
    "ragged paged attention has no VJP",
    unavailable=jax_kernels.ragged_paged_unavailable,
  ),
  "keras_dpa": _jax_kernel("keras_dpa"),
  # FlashAttention-3's design on Pallas Mosaic GPU (Hopper).
  "jax_mgpu": Entry(
    lambda _: jax_mgpu.jax_mgpu, unavailable=jax_mgpu.unavailable
  ),
}
NAMES = tuple(REGISTRY)
PEERS = tuple(name for name in REGISTRY if name not in IMPLEMENTATIONS)
