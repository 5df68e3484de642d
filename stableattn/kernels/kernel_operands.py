"""The feature operands of the Pallas kernels: BlockSpecs and tile reads.

The kernels run on two kinds of grid. Query-major (forward, dQ): program
(i, b, h) owns query block i and loops over key blocks. Key-major (dK/dV):
program (j, b, h) owns key block j and loops over query blocks. Each
feature operand (see `masking.py`) is given to a program as the slice its
loop reads: the owned block's rows or columns, and the whole other axis.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from stableattn.contract.masking import MaskOperands, MaskSpec, tile_mask
from stableattn.kernels.quantization import v_per_channel

# Operand names in the order the kernels receive them.
ORDER = (
  "ranges",
  "q_ids",
  "kv_ids",
  "kv_pos",
  "bias",
  "mask",
  "sink_rows",
  "q_scale",
  "k_scale",
  "v_scale",
)


def _select(per_item: bool, index):
  return index if per_item else 0


def _operand_arrays(spec: MaskSpec, ops, ranges, with_sink, scales) -> dict:
  """The operands one kernel reads, by name."""
  arrays = {}
  if ranges is not None:
    arrays["ranges"] = ranges
  if spec.token_ids:
    arrays["q_ids"], arrays["kv_ids"] = ops.q_ids, ops.kv_ids
  if spec.key_positions:
    arrays["kv_pos"] = ops.kv_pos
  if spec.bias is not None:
    arrays["bias"] = ops.bias
  if spec.dense_mask is not None:
    arrays["mask"] = ops.mask
  if with_sink and spec.sink:
    arrays["sink_rows"] = ops.sink
  if scales is not None:
    arrays["q_scale"], arrays["k_scale"] = scales.q, scales.k
    arrays["v_scale"] = scales.v
  return arrays


def operand_specs(
  spec: MaskSpec,
  ops: MaskOperands,
  ranges,
  *,
  query_major: bool,
  block_q: int,
  block_k: int,
  q_len_padded: int,
  kv_len_padded: int,
  with_sink: bool,
  scales=None,
  group: int = 1,
  policy=None,
):
  """(names, arrays, BlockSpecs) of the feature operands of one kernel.

  `ranges` is the kernel's block-range array from `masking.block_ranges`
  (or None when no block can be skipped by structure); `ops` are padded,
  and so are `scales` (`quantization.QuantScales` or None, with the
  `policy` that made them); `group` is the number of query heads per
  key/value head.
  """
  arrays = _operand_arrays(spec, ops, ranges, with_sink, scales)
  names = tuple(n for n in ORDER if n in arrays)

  def scale_spec(name):
    query_side = name == "q_scale"
    owned = query_side == query_major

    def head(h):
      return h if query_side else h // group

    if name == "v_scale" and v_per_channel(policy):
      channels = scales.v.shape[-1]
      return pl.BlockSpec(
        (None, None, channels), lambda o, b, h: (b, head(h), 0)
      )

    if owned:
      block = block_q if query_side else block_k
      return pl.BlockSpec((None, None, block), lambda o, b, h: (b, head(h), o))
    whole = q_len_padded if query_side else kv_len_padded
    return pl.BlockSpec((None, None, whole), lambda o, b, h: (b, head(h), 0))

  def block_spec(name, x):
    if name.endswith("_scale"):
      return scale_spec(name)
    per_example = x.shape[0] > 1
    if name == "ranges":
      return pl.BlockSpec(
        (None, None, 2), lambda o, b, h: (_select(per_example, b), o, 0)
      )
    if name == "sink_rows":
      return pl.BlockSpec((None, block_q), lambda o, b, h: (h, o))
    query_side = name == "q_ids"
    if name in ("q_ids", "kv_ids", "kv_pos"):
      owned = query_side == query_major
      block = (block_q if query_side else block_k) if owned else None
      if owned:
        return pl.BlockSpec((None, block), lambda o, b, h: (b, o))
      whole = q_len_padded if query_side else kv_len_padded
      return pl.BlockSpec((None, whole), lambda o, b, h: (b, 0))
    per_head = x.shape[1] > 1
    if query_major:
      return pl.BlockSpec(
        (None, None, block_q, kv_len_padded),
        lambda o, b, h: (_select(per_example, b), _select(per_head, h), o, 0),
      )
    return pl.BlockSpec(
      (None, None, q_len_padded, block_k),
      lambda o, b, h: (_select(per_example, b), _select(per_head, h), 0, o),
    )

  return (
    names,
    [arrays[n] for n in names],
    [block_spec(n, arrays[n]) for n in names],
  )


@dataclasses.dataclass(frozen=True)
class TileReader:
  """Reads the feature operands of one tile inside a kernel."""

  refs: dict
  spec: MaskSpec
  query_major: bool
  kv_len: int  # true key length: keys at or beyond it are padding
  kv_len_padded: int
  v_per_channel: bool = False  # V's scales: one per column, not per row

  @classmethod
  def of(cls, cfg, names, feature_refs, *, query_major: bool):
    """The reader of one kernel's feature refs (`cfg`: a KernelConfig)."""
    return cls(
      dict(zip(names, feature_refs)),
      cfg.mask,
      query_major,
      cfg.kv_len,
      cfg.kv_len_padded,
      v_per_channel(cfg.policy),
    )

  def block_range(self, default_end):
    """(first, end) of the loop over the other axis's blocks."""
    if "ranges" not in self.refs:
      return 0, default_end
    ranges = self.refs["ranges"]
    return ranges[0], ranges[1]

  def _read(self, name, q_rows, k_cols):
    ref = self.refs[name]
    if name == "q_ids":
      return ref[...] if self.query_major else ref[q_rows]
    if name in ("kv_ids", "kv_pos"):
      return ref[k_cols] if self.query_major else ref[...]
    return ref[:, k_cols] if self.query_major else ref[q_rows, :]

  def mask(self, q_start, k_start, block_q, block_k):
    q_rows, k_cols = pl.ds(q_start, block_q), pl.ds(k_start, block_k)

    def read(name):
      return self._read(name, q_rows, k_cols) if name in self.refs else None

    return tile_mask(
      self.spec,
      q_start,
      k_start,
      block_q,
      block_k,
      kv_len=self.kv_len,
      kv_len_padded=self.kv_len_padded,
      q_ids=read("q_ids"),
      kv_ids=read("kv_ids"),
      kv_pos=read("kv_pos"),
      dense=read("mask"),
    )

  def scales(self, q_start, k_start, block_q, block_k):
    """(q, k, v) scales of the tile (V's per row, or per channel), or None
    without quantization."""
    if "q_scale" not in self.refs:
      return None
    q_rows, k_cols = pl.ds(q_start, block_q), pl.ds(k_start, block_k)
    q_ref, k_ref, v_ref = (self.refs[f"{n}_scale"] for n in "qkv")
    if self.query_major:
      v_scale = v_ref[...] if self.v_per_channel else v_ref[k_cols]
      return q_ref[...], k_ref[k_cols], v_scale
    return q_ref[q_rows], k_ref[...], v_ref[...]

  def bias(self, q_start, k_start, block_q, block_k):
    if "bias" not in self.refs:
      return None
    return self._read("bias", pl.ds(q_start, block_q), pl.ds(k_start, block_k))
