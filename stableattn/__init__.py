"""stableattn: how far does flash attention deviate from plain attention?

Public API:
  attention(q, k, v, *, implementation, options, features, **keywords):
    keywords are fields of Options (how) or Features (what), as sugar
  paged_attention(q, k_pages, v_pages, page_table, ...): the same over a
    paged KV cache; gather_pages(pages, page_table): its contiguous cache
  ring_attention(q, k, v, *, mesh, axis, ...): the same with the sequence
    sharded over a mesh axis (context parallelism), ring backward
  Options(precision, block_q, block_k, scheme, num_splits, split_size,
    ...): frozen, hashable
  Features(causal, local_window_size, segment_ids, softcap, sink, ...)
  golden_attention(q, k, v, causal) / golden_attention_vjp(...)
  compare(expected, actual) -> Deviation; error_ratio; passes_fa_rule
  round_to(x, format): x rounded to a format (FP8/FP4 casts saturate)
  Precision, preset_names; tiles_from_sram
  audit(fn, precision=..., shapes=..., features=...) -> AuditReport:
    fn(q, k, v, **features), output and gradients under four projects'
    rules, determinism, NaN/Inf
  check(fn, ...) -> CheckReport: the audit's forward output under
    FlashAttention's rule
  make_attention_fn(options, features) -> attention_fn for
    flax.nnx.MultiHeadAttention
  monitor_verdict(records) -> dict: the monitor's per-head statistics over
    logged steps placed on the calibrated 2-D map, with remedies
"""

import importlib.util as _importlib_util
import pathlib as _pathlib
import sys as _sys

from stableattn.auditing.check import CheckReport, check
from stableattn.auditing.kernel_audit import AuditReport, audit
from stableattn.auditing.monitor_verdict import verdict as monitor_verdict
from stableattn.contract.features import Features
from stableattn.contract.golden import golden_attention, golden_attention_vjp
from stableattn.contract.options import SCHEMES, Options
from stableattn.contract.tiling import tiles_from_sram
from stableattn.numerics.metrics import (
  Deviation,
  compare,
  error_ratio,
  rounding_floor,
)
from stableattn.numerics.precision import STAGES, Precision, preset_names
from stableattn.numerics.rounding import round_to
from stableattn.numerics.rules import passes_fa_rule
from stableattn.ops.dispatch import IMPLEMENTATIONS, attention
from stableattn.ops.flax_attention import make_attention_fn
from stableattn.ops.paged import gather_pages, paged_attention
from stableattn.ops.ring import ring_attention

__all__ = [
  "IMPLEMENTATIONS",
  "AuditReport",
  "SCHEMES",
  "STAGES",
  "CheckReport",
  "Deviation",
  "Features",
  "Options",
  "Precision",
  "attention",
  "audit",
  "check",
  "compare",
  "error_ratio",
  "gather_pages",
  "golden_attention",
  "golden_attention_vjp",
  "make_attention_fn",
  "monitor_verdict",
  "paged_attention",
  "passes_fa_rule",
  "preset_names",
  "ring_attention",
  "round_to",
  "rounding_floor",
  "tiles_from_sram",
]


def _configs_of_a_checkout() -> None:
  """`stableattn.configs` from `configs/` at a checkout's top.

  An install maps the folder to that name (pyproject.toml's
  `package-dir`); a checkout run from its root with PYTHONPATH alone (a
  GPU machine with the packages but not the project) has no such map.
  """
  if _importlib_util.find_spec(f"{__name__}.configs") is not None:
    return
  folder = _pathlib.Path(__file__).resolve().parent.parent / "configs"
  if not (folder / "__init__.py").exists():
    return
  spec = _importlib_util.spec_from_file_location(
    f"{__name__}.configs",
    folder / "__init__.py",
    submodule_search_locations=[str(folder)],
  )
  module = _importlib_util.module_from_spec(spec)
  _sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  _sys.modules[__name__].configs = module  # as an import would bind it


_configs_of_a_checkout()
