"""delta = rowsum(dO O) for the Hopper path's backward, with no Triton
kernel (jax keeps Mosaic GPU and deprecates Pallas Triton).

Under the policy as `backward_delta` computes it: the row-sum form in
XLA (a multiply and a reduce, as the Triton path's interpret mode runs
it), and delta_product=matmul's diagonal of dO O_hi^T by wgmma, one
64-row tile per thread block, summed over the value head dim in the
chunks the backward's dP = dO V^T takes (`mosaic_backward_layout`), so
that where a row's probability sits on one key, O_hi is that key's V
and dP - delta is exactly 0, as on the Triton path; plus rowsum(dO (O -
O_hi)) in XLA, rounded to `delta` once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.kernels.backward_delta import row_delta
from stableattn.kernels.mosaic_backward_layout import Columns
from stableattn.kernels.mosaic_backward_steps import column_part, contraction
from stableattn.kernels.mosaic_support import ROWS, MosaicPlan, smem_tile
from stableattn.numerics.rounding import PolicyArithmetic


def _diagonal_kernel(do_ref, ot_ref, out_ref, *, columns: Columns, dtype):
  batch, head, block = (jax.lax.axis_index(n) for n in ("batch", "heads", "q"))
  rows = pl.ds(block * ROWS, ROWS)

  def program(do_smem, ot_smem, diagonal_smem, barrier):
    chunks = [
      (
        do_ref.at[batch, rows, head, column_part(c, columns)],
        ot_ref.at[batch, head, column_part(c, columns), rows],
      )
      for c in range(columns.parts)
    ]
    product = contraction(
      (ROWS, ROWS), chunks, (do_smem, ot_smem), barrier.at[0]
    )

    def iota(axis):
      return plgpu.broadcasted_iota(
        jnp.int32, (ROWS, ROWS), axis, layout=plgpu.Layout.WGMMA
      )

    # One nonzero term per row: the sum is exact.
    own = jnp.where(iota(0) == iota(1), product, 0.0)
    diagonal_smem[...] = jnp.sum(own, axis=1)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(diagonal_smem, out_ref.at[batch, head, rows])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(
    program,
    smem_tile((ROWS, columns.width), dtype),
    smem_tile((columns.width, ROWS), dtype),
    plgpu.SMEM((ROWS,), jnp.float32),
    plgpu.Barrier(num_barriers=1),
  )


def _diagonal(d_out, o_hi, plan: MosaicPlan):
  """The diagonal of dO O_hi^T per 64-row tile, [B, H, T] FP32, both in
  the operand format (O_hi is representable in it)."""
  batch, q_len, heads, _ = d_out.shape
  columns = Columns(plan.value_parts, plan.value_dim)
  o_t = jnp.transpose(o_hi, (0, 2, 3, 1))
  call = plgpu.kernel(
    functools.partial(
      _diagonal_kernel, columns=columns, dtype=plan.operand_dtype
    ),
    out_type=jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
    grid=(batch, heads, q_len // ROWS),
    grid_names=("batch", "heads", "q"),
    interpret=plan.interpret_params,
    kernel_name="stableattn_mosaic_backward_delta",
  )
  return call(d_out, o_t)


def mosaic_delta(o_parts, d_out, plan: MosaicPlan):
  """delta [B, H, T] in FP32 (exact from the policy's `delta` format) of
  padded d_out [B, T, H, Dv] and the O whose parts are `o_parts`
  (`backward_delta.delta_operands`): `backward_delta.row_delta`, with
  the matmul form's diagonal from `_diagonal`."""
  policy = plan.policy
  ar = PolicyArithmetic(policy)

  def diagonal(o_hi):  # [B, T, H]
    operands = (x.astype(plan.operand_dtype) for x in (d_out, o_hi))
    return _diagonal(*operands, plan).transpose(0, 2, 1)

  delta = row_delta(o_parts, d_out.astype(ar.carrier), ar, diagonal=diagonal)
  delta = delta.transpose(0, 2, 1).astype(policy.dtype("delta"))
  return delta.astype(jnp.float32)
