"""Which rounding stage causes Flash's deviation (beyond the paper): from
each -fa2 preset one stage rounded to the format, and from the all-format
preset one stage lifted back to FP32."""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.contract.options import Options
from stableattn.experiments.engine import Case, Kernel
from stableattn.experiments.forward.study import (
  Section,
  Study,
  against_golden,
  formats,
)
from stableattn.harness.config_values import spec
from stableattn.harness.plotting import bar_plot
from stableattn.harness.reporting import num, select, table
from stableattn.numerics.precision import Precision

# Stages that the all-format presets round and the -fa2 presets keep in FP32.
ATTRIBUTION_STAGES = ("scores", "softmax_stats", "out_accum")


@dataclasses.dataclass(frozen=True)
class Config:
  formats: tuple[str, ...] = spec(parse=formats)


def attribution_variants(fmt: str) -> dict[str, Precision]:
  """Policies between `{fmt}-fa2` and the all-`fmt` preset, one stage apart."""
  base = Precision.from_name(f"{fmt}-fa2")
  every = Precision.from_name(fmt)
  variants = {"fa2 preset": base, f"all {fmt}": every}
  for stage in ATTRIBUTION_STAGES:
    variants[f"only {stage}"] = base.with_stage(**{stage: fmt})
    variants[f"all but {stage}"] = every.with_stage(**{stage: "fp32"})
  return variants


def _explained(variant: str, value: float, low: float, high: float):
  """(stage, share of the gap low..high it explains), or (None, None)."""
  gap = high - low
  if gap <= 0:
    return None, None
  if variant.startswith("only "):
    return variant[5:], (value - low) / gap
  if variant.startswith("all but "):
    return variant[8:], (high - value) / gap
  return None, None


class StageAttribution(Study):
  name = "stage_attribution"
  title = "Which rounding stage causes the deviation (beyond the paper)"
  Config = Config

  def points(self, s, c):
    return [
      {
        "format": fmt,
        "variant": variant,
        "scheme": scheme,
        "distribution": dist,
      }
      for fmt in c.formats
      for variant in attribution_variants(fmt)
      for scheme in s.schemes
      for dist in s.distributions
    ]

  def measure(self, engine, s, c, p, seed):
    policy = attribution_variants(p["format"])[p["variant"]]
    case = Case(p["distribution"], s.shape(), p["format"], seed)
    options = Options(
      policy, block_q=s.block_q, block_k=s.block_k, scheme=p["scheme"]
    )
    kernel = Kernel("pallas", options)
    return against_golden(
      engine, kernel, Kernel("reference", Options(policy)), case
    )

  def ran(self, s, c):
    return (
      f"length {s.seq_len}, tiles {s.block_q}x{s.block_k}, "
      f"{s.shape_text()}; from each -fa2 preset one of "
      f"{list(ATTRIBUTION_STAGES)} rounded to the format ('only'), and from "
      "the all-format preset one lifted back to FP32 ('all but'); the "
      f"Baseline runs under the same policy; {s.seeds_text()}."
    )

  def report(self, ctx):
    s = ctx.common
    rows = select(ctx.rows, comparison="flash_vs_golden")
    if not rows:
      return None
    table_rows, findings, labels, values = [], [], [], []
    for fmt in ctx.config.formats:
      variants = list(attribution_variants(fmt))
      share: dict[str, list[float]] = {st: [] for st in ATTRIBUTION_STAGES}
      for scheme in s.schemes:
        for dist in s.distributions:
          group = {
            r["variant"]: r
            for r in select(rows, format=fmt, scheme=scheme, distribution=dist)
          }
          if len(group) != len(variants):
            continue
          low = group["fa2 preset"]["max_abs_mean"]
          high = group[f"all {fmt}"]["max_abs_mean"]
          for variant in variants:
            r = group[variant]
            stage, explained = _explained(variant, r["max_abs_mean"], low, high)
            if stage is not None:
              share[stage].append(explained)
            table_rows.append(
              [
                fmt,
                scheme,
                dist,
                variant,
                num(r["max_abs_mean"]),
                num(ctx.metric(r, "baseline_vs_golden")),
                num(r["ratio_max_abs_mean"]),
                "-" if explained is None else f"{100 * explained:.0f}%",
              ]
            )
            if scheme == s.schemes[0] and dist == s.distributions[0]:
              labels.append(f"{fmt} {variant}")
              values.append(r["ratio_max_abs_mean"])
      scored = {st: float(np.mean(v)) for st, v in share.items() if v}
      if scored:
        top = max(scored, key=scored.get)
        findings.append(
          f"At {fmt.upper()}, rounding `{top}` explains "
          f"{100 * scored[top]:.0f}% of the gap between the {fmt}-fa2 and "
          f"all-{fmt} Flash error (mean of one-stage-added and "
          "one-stage-removed estimates over schemes and inputs); "
          + ", ".join(f"`{st}` {100 * v:.0f}%" for st, v in scored.items())
          + "."
        )
        ctx.headline[f"attribution_top_stage_{fmt}"] = top
    body = table(
      [
        "format",
        "scheme",
        "inputs",
        "policy variant",
        "flash err (max)",
        "baseline err (max, same policy)",
        "flash/baseline",
        "share of gap",
      ],
      table_rows,
    )
    plot = bar_plot(
      ctx.out_dir / "stage_attribution.png",
      labels,
      {"Flash err / Baseline err": values},
      title="Stage attribution (fa2 scheme)",
      ylabel="ratio of max errors vs FP64",
      reference_line=1.0,
    )
    return Section(body, findings, [plot.name])


STUDY = StageAttribution()
