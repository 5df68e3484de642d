"""Biased rounding with tied row maxima (Qiu & Yao, arXiv 2510.04212).

Bit-identical keys tie at each row's maximum, in one tile or spread one per
tile, with V of one sign or zero-mean and a chosen untied probability mass
relative to the tied mass; measured under several policies with and
without their fix (Algorithm 1, `tie_beta`), for Flash and Baseline, on O,
on delta = rowsum(dO * O), and on dQ, dK, dV at the headline condition.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.auditing.inputs import Shape, TiedMaximaSpec, untied_mass_ratio
from stableattn.contract.options import Options
from stableattn.experiments.engine import Case, Kernel
from stableattn.experiments.forward import tied_maxima_report
from stableattn.experiments.forward.study import (
  Study,
  deviation_values,
  policies,
  row,
)
from stableattn.harness.config_values import as_tuple, spec
from stableattn.numerics.precision import Precision

# V for Qiu & Yao's conditions: one sign in one binade, or zero-mean.
TIED_VALUES = {"one_sign": (-1.5, 0.2), "zero_mean": (0.0, 1.0)}
TIED_PLACEMENTS = ("same_tile", "different_tiles")
# The condition their mechanism needs (Qiu & Yao, arXiv 2510.04212): two
# exact ties in one tile, one-sign V, an untied mass within the window.
HEADLINE_TIES, HEADLINE_MARGIN = 2, 1e-4


def _betas(raw, name: str) -> tuple[float, ...]:
  try:
    betas = as_tuple(raw, float)
  except ValueError:
    raise ValueError(f"config.{name} must be numbers, got {raw!r}.") from None
  for beta in betas:
    try:
      Options(tie_beta=beta)
    except ValueError as e:
      raise ValueError(f"config.{name}: {e}") from None
  return betas


@dataclasses.dataclass(frozen=True)
class Config:
  """The policies the bias is measured under (every stage BF16; Qiu &
  Yao's regime, FP32 statistics with a BF16 O accumulator; a real kernel),
  the fix's beta values (no fix is always measured), and the conditions:
  bit-identical keys tied at each row's maximum, in one tile or spread one
  per tile, V of one sign or zero-mean, and the untied probability mass
  relative to the tied mass."""

  precisions: tuple[str, ...] = spec(parse=policies)
  betas: tuple[float, ...] = spec(parse=_betas)
  counts: tuple[int, ...] = spec(minimum=1)
  placements: tuple[str, ...] = spec(choices=TIED_PLACEMENTS)
  values: tuple[str, ...] = spec(choices=tuple(TIED_VALUES))
  margins: tuple[float, ...] = spec(minimum=1e-30)
  q_len: int = spec(minimum=1)
  kv_len: int = spec(minimum=1)  # room for 4 ties in 4 tiles
  # Each condition already averages 64 x 256 x 2 heads.
  seeds: int = spec(minimum=1)


def tied_headline(c) -> dict:
  """The condition the study's first table reports (nearest in the grid)."""
  ties = min(c.counts, key=lambda n: (abs(n - HEADLINE_TIES), -n))
  margin = min(
    c.margins,
    key=lambda m: abs(np.log10(m) - np.log10(HEADLINE_MARGIN)),
  )
  return {
    "ties": ties,
    "placement": TIED_PLACEMENTS[0],
    "values": "one_sign" if "one_sign" in c.values else c.values[0],
    "margin": margin,
  }


class TiedMaxima(Study):
  name = "tied_maxima"
  title = "Biased rounding with tied row maxima (Qiu & Yao)"
  Config = Config
  extendable = ("seeds",)

  def seeds(self, s, c):
    # Each condition averages every element of every row already.
    return c.seeds

  def points(self, s, c):
    headline = tied_headline(c)
    points = []
    for ties in c.counts:
      for placement in c.placements:
        if ties == 1 and placement != "same_tile":
          continue  # one key is in one tile either way
        for values in c.values:
          for margin in c.margins:
            condition = {
              "ties": ties,
              "placement": placement,
              "values": values,
              "margin": margin,
            }
            points.append(
              {
                **condition,
                "q_len": c.q_len,
                "kv_len": c.kv_len,
                "headline": condition == headline,
              }
            )
    return points

  def measure(self, engine, s, c, p, seed):
    v_mean, v_spread = TIED_VALUES[p["values"]]
    tied = TiedMaximaSpec(
      ties=p["ties"],
      same_tile=p["placement"] == "same_tile",
      block_k=s.block_k,
      margin=p["margin"],
      v_mean=v_mean,
      v_spread=v_spread,
    )
    shape = Shape(
      s.batch, p["q_len"], p["kv_len"], s.heads, s.kv_heads, s.head_dim
    )
    rows = []
    for name in c.precisions:
      policy = Precision.from_name(name)
      case = Case("tied_maxima", shape, policy.inputs, seed, tied=tied)
      q, k, _ = engine.inputs(case)
      gold = engine.golden(case)
      extra = {"realized_margin": untied_mass_ratio(q, k)}
      for beta in (None, *c.betas):
        kernels = {
          "flash": Kernel(
            "pallas",
            Options(
              policy, block_q=s.block_q, block_k=s.block_k, tie_beta=beta
            ),
          ),
          "baseline": Kernel("reference", Options(policy, tie_beta=beta)),
        }
        for implementation, kernel in kernels.items():
          labels = {
            "comparison": f"{implementation}_vs_golden",
            "implementation": implementation,
            "policy": name,
            "tie_beta": beta,
          }
          out = engine.output(kernel, case)
          rows.append(
            row(
              {"quantity": "O", **labels},
              {**deviation_values(gold, out), **extra},
            )
          )
          # delta = rowsum(dO * O) carries a biased O into every gradient
          # when dO has one sign; with a random-sign dO it averages out.
          for sign in ("positive", "random"):
            d_out = engine.d_out(case, sign)
            rows.append(
              row(
                {"quantity": f"delta(dO {sign})", **labels},
                {
                  **deviation_values(
                    np.sum(d_out * gold, -1), np.sum(d_out * out, -1)
                  ),
                  **extra,
                },
              )
            )
          if p["headline"] and implementation == "flash":
            golden_grads = engine.golden_grads(case, "positive")
            grads = engine.grads(kernel, case, "positive")
            for grad, g, gg in zip(("dq", "dk", "dv"), grads, golden_grads):
              rows.append(
                row(
                  {"quantity": grad, **labels},
                  {**deviation_values(gg, g), **extra},
                )
              )
    return rows

  def ran(self, s, c):
    return (
      f"{c.q_len} queries over {c.kv_len} keys, {s.shape_text()}, tiles "
      f"{s.block_q}x{s.block_k} (fa2), inputs rounded to BF16; ties "
      f"{list(c.counts)}, placements {list(c.placements)}, V "
      f"{list(c.values)}, untied mass {list(c.margins)} of the tied mass; "
      f"policies {list(c.precisions)}, fixes: none and beta "
      f"{list(c.betas)}; delta = rowsum(dO * O) in FP64 from the stored O; "
      "dQ, dK, dV for a one-sign dO at the headline condition; "
      f"{c.seeds} seed(s)."
    )

  def report(self, ctx):
    return tied_maxima_report.report(ctx, tied_headline(ctx.config))


STUDY = TiedMaxima()
