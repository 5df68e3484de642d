"""Gradient deviation: Flash's dQ, dK, dV against FP64 golden gradients,
next to Baseline's (autodiff of the materialized attention)."""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.experiments.engine import Case
from stableattn.experiments.forward.study import (
  Section,
  Study,
  baseline,
  deviation_values,
  flash,
  policies,
  range_text,
  row,
)
from stableattn.harness.config_values import spec
from stableattn.harness.plotting import Series, line_plot
from stableattn.harness.reporting import num, select, table
from stableattn.numerics.metrics import safe_ratio
from stableattn.numerics.precision import Precision

GRADS = ("dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Config:
  precisions: tuple[str, ...] = spec(parse=policies)
  seq_lens: tuple[int, ...] = spec(minimum=1)


class BackwardDeviation(Study):
  name = "backward"
  title = "Gradient deviation: dQ, dK, dV vs golden gradients"
  Config = Config

  def points(self, s, c):
    return [
      {"policy": policy, "seq_len": n, "distribution": s.distributions[0]}
      for policy in c.precisions
      for n in c.seq_lens
    ]

  def measure(self, engine, s, c, p, seed):
    fmt = Precision.from_name(p["policy"]).inputs
    case = Case(p["distribution"], s.shape(p["seq_len"]), fmt, seed)
    golden = engine.golden_grads(case)
    flash_grads = engine.grads(flash(p["policy"], s.block_q, s.block_k), case)
    base_grads = engine.grads(baseline(p["policy"]), case)
    rows = []
    for grad, gold, f, b in zip(GRADS, golden, flash_grads, base_grads):
      flash_dev = deviation_values(gold, f)
      base_dev = deviation_values(gold, b)
      ratios = {
        f"ratio_{m}": safe_ratio(flash_dev[m], base_dev[m])
        for m in ("max_abs", "rmse")
      }
      rows.append(
        row(
          {"comparison": "flash_vs_golden", "grad": grad},
          {**flash_dev, **ratios},
        )
      )
      rows.append(
        row({"comparison": "baseline_vs_golden", "grad": grad}, base_dev)
      )
    return rows

  def ran(self, s, c):
    return (
      f"lengths {list(c.seq_lens)}, tiles {s.block_q}x{s.block_k}, "
      f"{s.shape_text()}, policies {list(c.precisions)}, standard-normal dO; "
      f"Baseline gradients by autodiff; {s.seeds_text()}."
    )

  def report(self, ctx):
    rows = select(ctx.rows, comparison="flash_vs_golden")
    if not rows:
      return None
    rows.sort(key=lambda r: (r["policy"], r["seq_len"], r["grad"]))
    body = table(
      [
        "policy",
        "length",
        "grad",
        "flash err (max)",
        "baseline err (max)",
        "ratio max (range)",
        "ratio RMSE",
      ],
      [
        [
          r["policy"],
          r["seq_len"],
          r["grad"],
          num(r["max_abs_mean"]),
          num(ctx.metric(r, "baseline_vs_golden", grad=r["grad"])),
          range_text(r, "ratio_max_abs"),
          num(r["ratio_rmse_mean"]),
        ]
        for r in rows
      ],
    )
    findings, series = [], []
    for policy in sorted({r["policy"] for r in rows}):
      pr = [r for r in rows if r["policy"] == policy]
      ratios = [r["ratio_max_abs_mean"] for r in pr]
      worst = max(pr, key=lambda r: r["ratio_max_abs_mean"])
      findings.append(
        f"{policy}: Flash/Baseline gradient error ratio median "
        f"{num(float(np.median(ratios)))}, worst "
        f"{num(worst['ratio_max_abs_mean'])}"
        f" ({worst['grad']} at length {worst['seq_len']}); FlashAttention's "
        f"test rule allows 3."
      )
      ctx.headline[f"backward_worst_ratio_{policy}"] = worst[
        "ratio_max_abs_mean"
      ]
      for grad in GRADS:
        gr = [r for r in pr if r["grad"] == grad]
        series.append(
          Series(
            f"{policy} {grad}",
            [r["seq_len"] for r in gr],
            [r["max_abs_mean"] for r in gr],
          )
        )
    plot = line_plot(
      ctx.out_dir / "backward.png",
      series,
      title="Flash gradient error vs FP64",
      xlabel="length",
      ylabel="max |grad - golden|",
    )
    return Section(body, findings, [plot.name])


STUDY = BackwardDeviation()
