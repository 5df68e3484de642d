"""Flash vs Baseline at the same format (Golden et al. 2024, Fig. 3)."""

from __future__ import annotations

import math

from stableattn.experiments.engine import Case
from stableattn.experiments.forward.study import (
  Claim,
  Section,
  Study,
  range_text,
  require,
  same_policy,
  verdict,
)
from stableattn.harness.plotting import Series, line_plot
from stableattn.harness.reporting import num, select, table
from stableattn.numerics.formats import MANTISSA_BITS
from stableattn.numerics.precision import natural_policy


def fig3(rows) -> dict:
  """Deviation falls as mantissa bits grow, for every family of policies."""
  rows = require(
    select(rows, comparison="flash_vs_baseline"), "fig3", "format_sweep"
  )
  holds, fails = [], []
  for family in sorted({r["family"] for r in rows}):
    by_bits = sorted(
      (MANTISSA_BITS[r["format"]], r["max_abs_mean"])
      for r in rows
      if r["family"] == family
    )
    if len(by_bits) < 2:
      continue  # one format: nothing to compare within this family
    values = [v for _, v in by_bits]
    falling = all(a > b for a, b in zip(values, values[1:]))
    (holds if falling else fails).append(family)
  if not holds and not fails:
    raise ValueError("fig3: no policy family was measured at two formats.")
  return {
    "verdict": verdict(len(holds), len(holds) + len(fails)),
    "holds_for": holds,
    "fails_for": fails,
  }


def fig3_evidence(claim: dict) -> str:
  return (
    f"falls with every added bit for the "
    f"{', '.join(claim['holds_for']) or 'no'} policies; not for "
    f"{', '.join(claim['fails_for']) or 'any other'}"
  )


class FormatSweep(Study):
  name = "format_sweep"
  title = "Flash vs Baseline at the same format (paper Fig. 3)"
  claims = {
    "fig3": Claim("deviation falls as mantissa bits grow", fig3, fig3_evidence)
  }

  def points(self, s, c):
    points = []
    for fmt in s.formats:
      families = (
        ["all-stage"] if fmt in ("fp64", "fp32") else ["all-stage", "fa2"]
      )
      for family in families:
        policy = fmt if family == "all-stage" else natural_policy(fmt, "flash")
        points.append(
          {
            "format": fmt,
            "family": family,
            "policy": policy,
            "distribution": s.distributions[0],
          }
        )
    return points

  def measure(self, engine, s, c, p, seed):
    case = Case(p["distribution"], s.shape(), p["format"], seed)
    return same_policy(engine, s, p["policy"], case)

  def ran(self, s, c):
    return (
      f"length {s.seq_len}, tiles {s.block_q}x{s.block_k}, "
      f"{s.shape_text()}, {s.distributions[0]} inputs, {s.seeds_text()}."
    )

  def report(self, ctx):
    rows = select(ctx.rows, comparison="flash_vs_baseline")
    if not rows:
      return None
    rows.sort(key=lambda r: (r["family"], -MANTISSA_BITS[r["format"]]))
    body = table(
      [
        "family",
        "policy",
        "mantissa bits",
        "max |flash - baseline|",
        "mean |diff|",
        "flash vs golden",
        "baseline vs golden",
      ],
      [
        [
          r["family"],
          r["policy"],
          MANTISSA_BITS[r["format"]],
          range_text(r, "max_abs"),
          num(r["mean_abs_mean"]),
          num(ctx.metric(r, "flash_vs_golden")),
          num(ctx.metric(r, "baseline_vs_golden")),
        ]
        for r in rows
      ],
    )
    findings, series = [], []
    for family in sorted({r["family"] for r in rows}):
      fam = [
        r
        for r in rows
        if r["family"] == family
        or (family == "fa2" and r["format"] in ("fp32", "fp64"))
      ]
      fam.sort(key=lambda r: MANTISSA_BITS[r["format"]])
      values = [r["max_abs_mean"] for r in fam]
      monotone = all(a >= b for a, b in zip(values, values[1:]))
      findings.append(
        f"{family} policies: Flash-vs-Baseline max deviation "
        + ", ".join(f"{r['format']} {num(r['max_abs_mean'])}" for r in fam)
        + (
          " — NaN/Inf appeared (see 'Non-finite values'), so there is no "
          "trend to read."
          if not all(math.isfinite(v) for v in values)
          else " — it falls with every added mantissa bit, as in the "
          "paper's Fig. 3."
          if monotone
          else " — not monotone in mantissa bits, unlike the paper's Fig. 3."
        )
      )
      series.append(
        Series(family, [MANTISSA_BITS[r["format"]] for r in fam], values)
      )
      ctx.headline[f"format_sweep_{family}_monotone"] = monotone
    plot = line_plot(
      ctx.out_dir / "format_sweep.png",
      series,
      title="Flash vs Baseline, same format (Fig. 3)",
      xlabel="mantissa bits",
      ylabel="max |flash - baseline|",
      logx=False,
    )
    return Section(body, findings, [plot.name])


STUDY = FormatSweep()
