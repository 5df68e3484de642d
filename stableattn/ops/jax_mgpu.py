"""jax's Mosaic GPU flash attention (`pallas.ops.gpu.attention_mgpu`,
FlashAttention-3's design for Hopper) on the registry's contract, as
`jax_mgpu`.

The kernel takes no scale (it computes softmax(Q K^T)): q is multiplied
by 1/sqrt(head_dim) in its own format first, as for splash attention. Its
tiles are fixed at 64 (block_q, block_kv and the backward's), two stages
deep. What it cannot take is refused in one line (`restriction`), which
the audit reports as n/a. Off a GPU it runs in jax's GPU interpret mode
where the installed jax interprets it (`unavailable` says why not).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

BLOCK = 64


class _CudaRuntime:
  """What attention_mgpu reads of the CUDA runtime before it builds its
  kernel, off a GPU (a CPU jaxlib has none): a 12.9.1 runtime, past the
  ptxas versions it refuses causal masking on."""

  @staticmethod
  def cuda_runtime_get_version() -> int:
    return 12091


def _off_gpu() -> bool:
  return jax.default_backend() != "gpu"


@contextlib.contextmanager
def _interpreted(lib):
  """GPU interpret mode, and a CUDA runtime version, off a GPU."""
  if not _off_gpu():
    yield
    return
  from jax._src.pallas.mosaic_gpu.interpret import params

  saved = lib.cuda_versions
  lib.cuda_versions = lib.cuda_versions or _CudaRuntime
  try:
    with params.force_gpu_interpret_mode(params.InterpretGPUParams()):
      yield
  finally:
    lib.cuda_versions = saved


def restriction(q, k, causal: bool) -> str | None:
  """What attention_mgpu cannot take of these inputs, or None."""
  batch, q_len, heads, head_dim = q.shape
  kv_len = k.shape[1]
  if jnp.dtype(q.dtype) not in (
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.bfloat16),
  ):
    return f"takes FP16 or BF16 inputs only, not {jnp.dtype(q.dtype).name}"
  if head_dim % BLOCK:
    return f"needs a head dim divisible by {BLOCK}, not {head_dim}"
  if kv_len % BLOCK or q_len % (2 * BLOCK):
    return (
      f"needs kv_len divisible by {BLOCK} and q_len by {2 * BLOCK} (two "
      f"compute warpgroups), not {kv_len} and {q_len}"
    )
  if causal and q_len != kv_len:
    return "masks causal with top-left alignment on equal lengths only"
  return None


def jax_mgpu(q, k, v, *, causal: bool = False):
  """jax's attention_mgpu: forward, and backward without causal masking
  (its backward raises for causal)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as lib

  reason = restriction(q, k, causal)
  if reason is not None:
    raise ValueError(f"jax_mgpu (attention_mgpu) {reason}.")
  config = lib.TuningConfig(
    block_q=BLOCK, block_kv=BLOCK, max_concurrent_steps=2, causal=causal,
    block_q_dkv=BLOCK, block_kv_dkv=BLOCK, block_q_dq=BLOCK, block_kv_dq=BLOCK,
  )  # fmt: skip
  scaled = (q * q.shape[-1] ** -0.5).astype(q.dtype)

  @jax.custom_vjp
  def attend(q, k, v):
    with _interpreted(lib):
      return lib.attention(q, k, v, config)

  def forward(q, k, v):
    with _interpreted(lib):
      return jax.vjp(functools.partial(lib.attention, config=config), q, k, v)

  def backward(vjp, d_out):
    with _interpreted(lib):
      return vjp(d_out)

  attend.defvjp(forward, backward)
  return attend(scaled, k, v)


@functools.cache
def unavailable() -> str | None:
  """Why jax_mgpu cannot run here (None: it can): off a GPU, whether the
  installed jax's GPU interpret mode runs one small case."""
  if not _off_gpu():
    return None
  q = jnp.zeros((1, 2 * BLOCK, 1, BLOCK), jnp.float16)
  try:
    jax.block_until_ready(jax_mgpu(q, q, q))
  except Exception as e:  # noqa: BLE001 - the reason is the answer
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.reset_gpu_interpret_mode_state()
    text = str(e).strip().splitlines()
    return (
      f"it needs an NVIDIA GPU: jax {jax.__version__}'s GPU interpret mode "
      f"fails on it ({type(e).__name__}: {text[0] if text else ''})"
    )
  return None
