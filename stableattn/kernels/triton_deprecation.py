"""jax 0.11 deprecated Pallas's Triton back end and warns at each Triton
lowering. Our Triton path stays (it is the full-featured GPU kernel and
the one the Hopper path is checked against), so its own lowerings drop
that one warning, matched by its exact text; every other kernel's
lowering, and every other warning, is left as jax issues it.
"""

from __future__ import annotations

import functools
import re
import warnings

from jax._src.interpreters import mlir
from jax._src.pallas.pallas_call import pallas_call_p

# jax 0.11.0, jax/_src/pallas/pallas_call.py (deprecation "jax-pallas-triton").
TRITON_DEPRECATION = (
  "The Pallas Triton backend is deprecated and will be removed in a future"
  " JAX version. To keep using Pallas on GPU, please migrate to the Mosaic"
  " GPU backend. To keep using Triton, switch to the official Triton"
  " bindings and jax_triton."
)
# Every pallas_call of ours is named with this prefix.
OUR_KERNELS = "stableattn_"


def kernel_name(params: dict) -> str:
  """The name a pallas_call was given (`name=`), from its lowering's
  parameters."""
  name = params.get("name")
  if name is None:
    debug_info = getattr(params.get("jaxpr"), "debug_info", None)
    name = getattr(debug_info, "func_name", "")
  return str(getattr(name, "name", name))


def quiet_for_our_kernels(rule):
  """`rule` (pallas_call's lowering), dropping the Triton deprecation
  warning where the kernel is one of ours."""

  @functools.wraps(rule)
  def lowering(ctx, *args, **params):
    if not kernel_name(params).startswith(OUR_KERNELS):
      return rule(ctx, *args, **params)
    with warnings.catch_warnings():
      warnings.filterwarnings(
        "ignore",
        message=re.escape(TRITON_DEPRECATION) + r"\Z",
        category=DeprecationWarning,
      )
      return rule(ctx, *args, **params)

  lowering.quiets_our_kernels = True
  return lowering


def install() -> None:
  """Wraps pallas_call's registered lowering once per process."""
  entry = mlir._lowerings[pallas_call_p]
  if getattr(entry.rule, "quiets_our_kernels", False):
    return
  mlir.register_lowering(
    pallas_call_p, quiet_for_our_kernels(entry.rule), inline=entry.inline
  )


install()
