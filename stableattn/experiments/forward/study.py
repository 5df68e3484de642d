"""What every forward study shares: the common settings, the study
interface, and the measurements several studies make.

A study is one module in this package: its config section's dataclass, its
points, its measurement, its report section (with its figure) and the paper
claims it answers. It measures one point for one seed and returns rows
`{"labels": {...}, "values": {...}}`: labels say what was compared, values
are the numbers the summary averages over seeds.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

from stableattn.auditing.inputs import DISTRIBUTIONS, Shape
from stableattn.contract.options import SCHEMES, Options
from stableattn.experiments.engine import Case, Engine, Kernel
from stableattn.harness.config_values import as_tuple, spec
from stableattn.harness.reporting import num, one
from stableattn.numerics.formats import format_name
from stableattn.numerics.metrics import compare, safe_ratio
from stableattn.numerics.precision import Precision
from stableattn.numerics.quant_options import WIDE_FORMATS


def formats(raw, name: str) -> tuple[str, ...]:
  """Format names (fp64, fp32, fp16, bf16 and their aliases), canonical."""
  try:
    names = tuple(format_name(f) for f in as_tuple(raw))
  except ValueError as e:
    raise ValueError(f"config.{name}: {e}") from None
  narrow = [f for f in names if f not in WIDE_FORMATS]
  if narrow:
    raise ValueError(
      f"config.{name}: {narrow} have no presets of their own; valid formats "
      f"are {list(WIDE_FORMATS)} (FP8/FP4 run through policies such as "
      "fp8-fa3 in the fa3_table3 study)."
    )
  if not names:
    raise ValueError(f"config.{name} is empty; give at least one format.")
  return names


def policies(raw, name: str) -> tuple[str, ...]:
  """Policy names (presets with optional '+stage=fmt'), each checked."""
  names = as_tuple(raw)
  if not names:
    raise ValueError(f"config.{name} is empty; give at least one policy.")
  for policy in names:
    try:
      Precision.from_name(policy)
    except ValueError as e:
      raise ValueError(f"config.{name}: {e}") from None
  return names


@dataclasses.dataclass(frozen=True)
class Common:
  """Settings every study reads: the `common` config section."""

  # Every point is repeated over this many input seeds.
  seeds: int = spec(minimum=1)
  # Attention shape of most studies: [batch, seq_len, heads, head_dim].
  batch: int = spec(minimum=1)
  heads: int = spec(minimum=1)
  kv_heads: int = spec(minimum=1)
  head_dim: int = spec(minimum=1)
  seq_len: int = spec(minimum=1)
  # Tiles B_r x B_c of every study but `tiles`.
  block_q: int = spec(minimum=1)
  block_k: int = spec(minimum=1)
  formats: tuple[str, ...] = spec(parse=formats)
  # The first distribution is used by single-distribution studies.
  distributions: tuple[str, ...] = spec(choices=DISTRIBUTIONS)
  schemes: tuple[str, ...] = spec(choices=SCHEMES)
  # Multiplier of the `scaled` input distribution.
  scale: float = spec()

  def shape(self, seq_len: int | None = None) -> Shape:
    length = self.seq_len if seq_len is None else seq_len
    return Shape(
      self.batch, length, length, self.heads, self.kv_heads, self.head_dim
    )

  def shape_text(self) -> str:
    return (
      f"batch {self.batch}, {self.heads} heads over {self.kv_heads} kv "
      f"heads, head dim {self.head_dim}"
    )

  def seeds_text(self, seeds: int | None = None) -> str:
    n = self.seeds if seeds is None else seeds
    return f"{n} seed(s); inputs rounded to the point's format first"

  def context(self) -> dict:
    """The settings outside a point that change what it measures."""
    return {
      "batch": self.batch,
      "heads": self.heads,
      "kv_heads": self.kv_heads,
      "head_dim": self.head_dim,
      "seq_len": self.seq_len,
      "block_q": self.block_q,
      "block_k": self.block_k,
      "scale": self.scale,
    }


@dataclasses.dataclass(frozen=True)
class NoConfig:
  """The config of a study that reads only the common section."""


@dataclasses.dataclass
class ReportContext:
  """What a study's report section gets: its own summary rows and the
  whole summary (claims of one study may read another's), the settings,
  where to write figures, and the headline dict to add numbers to."""

  rows: list[dict]
  common: Common
  config: object
  out_dir: pathlib.Path
  headline: dict
  claims: dict

  def metric(self, row, comparison, metric="max_abs_mean", **filters):
    """A metric of the same point as `row`, from another comparison row."""
    match = one(
      self.rows,
      point_key=row["point_key"],
      comparison=comparison,
      **filters,
    )
    return match[metric] if match else None


@dataclasses.dataclass
class Section:
  """A study's part of report.md."""

  body: str
  findings: list[str]
  plots: list[str]


@dataclasses.dataclass(frozen=True)
class Claim:
  """A paper claim a study answers.

  compute: the study's summary rows -> a dict with a "verdict" and the
  numbers behind it; it raises when the rows cannot decide (no verdict from
  no rows). evidence: that dict -> one sentence for the claims table.
  """

  text: str
  compute: Callable[[list[dict]], dict]
  evidence: Callable[[dict], str]


def verdict(holds: int, total: int) -> str:
  """ "reproduced" (holds in every measured setting), "reproduced in part"
  (in some) or "not reproduced" (in none)."""
  if total == 0:
    raise ValueError("a verdict needs at least one measured setting")
  if holds == total:
    return "reproduced"
  return "reproduced in part" if holds else "not reproduced"


def require(rows, claim: str, study: str) -> list[dict]:
  if not rows:
    raise ValueError(
      f"{claim}: no rows of study {study!r}; run it to get a verdict."
    )
  return rows


class Study:
  """One forward study. Subclasses set the class attributes and override
  `points`, `measure`, `ran` and `report`; `claims` maps a paper claim's
  id ("fig4") to its `Claim`."""

  name = ""
  title = ""
  Config = NoConfig
  claims: dict = {}
  # Config fields whose change only adds measurements (e.g. more seeds):
  # a rerun with a larger value extends the run directory.
  extendable: tuple[str, ...] = ()

  def seeds(self, common: Common, config) -> int:
    return common.seeds

  def points(self, common: Common, config) -> list[dict]:
    raise NotImplementedError

  def measure(
    self, engine: Engine, common: Common, config, point: dict, seed: int
  ) -> list[dict]:
    raise NotImplementedError

  def ran(self, common: Common, config) -> str:
    raise NotImplementedError

  def report(self, ctx: ReportContext) -> Section | None:
    raise NotImplementedError


def claim_findings(claims: dict, ctx: ReportContext) -> list[str]:
  """One finding per claim of a study that got a verdict."""
  findings = []
  for claim_id, claim in claims.items():
    found = ctx.claims.get(claim_id)
    if found is not None:
      findings.append(
        f"{claim.text}: {found['verdict']} ({claim.evidence(found)})."
      )
  return findings


def row(labels: dict, values: dict) -> dict:
  return {"labels": labels, "values": values}


def deviation_values(expected, actual) -> dict:
  """The numeric fields of `stableattn.compare` (argmax and the ULP format
  say where and how, not how much, so they are left out)."""
  d = compare(expected, actual).as_dict()
  return {
    k: v
    for k, v in d.items()
    if isinstance(v, (int, float)) and not isinstance(v, bool)
  }


def flash(policy, block_q, block_k, scheme="fa2") -> Kernel:
  return Kernel(
    "pallas", Options(policy, block_q=block_q, block_k=block_k, scheme=scheme)
  )


def baseline(policy) -> Kernel:
  return Kernel("reference", Options(policy))


def against_golden(
  engine: Engine, flash_kernel: Kernel, baseline_kernel: Kernel, case: Case
) -> list[dict]:
  """Rows flash_vs_golden (with the Flash/Baseline ratios) and
  baseline_vs_golden."""
  gold = engine.golden(case)
  flash_dev = deviation_values(gold, engine.output(flash_kernel, case))
  base_dev = deviation_values(gold, engine.output(baseline_kernel, case))
  ratios = {
    f"ratio_{m}": safe_ratio(flash_dev[m], base_dev[m])
    for m in ("max_abs", "rmse")
  }
  return [
    row({"comparison": "flash_vs_golden"}, {**flash_dev, **ratios}),
    row({"comparison": "baseline_vs_golden"}, base_dev),
  ]


def pairwise(
  engine: Engine,
  flash_kernel: Kernel,
  baseline_kernel: Kernel,
  case: Case,
  with_baseline_vs_golden: bool = True,
) -> list[dict]:
  """Rows flash_vs_baseline, flash_vs_golden (and baseline_vs_golden)."""
  flash_out = engine.output(flash_kernel, case)
  base_out = engine.output(baseline_kernel, case)
  gold = engine.golden(case)
  rows = [
    row(
      {"comparison": "flash_vs_baseline"},
      deviation_values(base_out, flash_out),
    ),
    row({"comparison": "flash_vs_golden"}, deviation_values(gold, flash_out)),
  ]
  if with_baseline_vs_golden:
    rows.append(
      row(
        {"comparison": "baseline_vs_golden"},
        deviation_values(gold, base_out),
      )
    )
  return rows


def same_policy(engine: Engine, s: Common, policy: str, case: Case):
  """`pairwise` for Flash (at the common tiles) and Baseline under one
  policy."""
  return pairwise(
    engine, flash(policy, s.block_q, s.block_k), baseline(policy), case
  )


def range_text(row, metric) -> str:
  """'mean (min-max)' over seeds of a summary row's metric."""
  return (
    f"{num(row[metric + '_mean'])} "
    f"({num(row[metric + '_min'])}-{num(row[metric + '_max'])})"
  )


# Slopes (log-log) below this size count as flat, neither rising nor falling.
FLAT_SLOPE = 0.05


def trend_text(slope: float, falling: str, rising: str, flat: str) -> str:
  if slope < -FLAT_SLOPE:
    return falling
  return rising if slope > FLAT_SLOPE else flat
