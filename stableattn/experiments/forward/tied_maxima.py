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

from stableattn.dispatch import check_tie_beta
from stableattn.experiments.config_values import as_tuple, spec
from stableattn.experiments.engine import Case, Kernel
from stableattn.experiments.forward.study import (
  Section,
  Study,
  deviation_values,
  policies,
  row,
)
from stableattn.experiments.reporting import one, table
from stableattn.inputs import Shape, TiedMaximaSpec, untied_mass_ratio
from stableattn.plotting import signed_share_panels
from stableattn.precision import Precision

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
      check_tie_beta(beta)
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

  precisions: tuple[str, ...] = spec(
    default="bf16,bf16-fa2+out_accum=bf16,bf16-fa2", parse=policies
  )
  betas: tuple[float, ...] = spec(default="2,7", parse=_betas)
  counts: tuple[int, ...] = spec(default="1,2,3,4", minimum=1)
  placements: tuple[str, ...] = spec(
    default="same_tile,different_tiles", choices=TIED_PLACEMENTS
  )
  values: tuple[str, ...] = spec(
    default="one_sign,zero_mean", choices=tuple(TIED_VALUES)
  )
  margins: tuple[float, ...] = spec(default="1e-1,1e-4,1e-7", minimum=1e-30)
  q_len: int = spec(default=64, minimum=1)
  kv_len: int = spec(default=256, minimum=1)  # room for 4 ties in 4 tiles
  # Each condition already averages 64 x 256 x 2 heads.
  seeds: int = spec(default=1, minimum=1)


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
  # The config variants' changes to this study's block.
  variants = {
    "paper": {
      "counts": "1,2,3,4,8",
      "margins": "1e-1,1e-2,1e-3,1e-4,1e-5,1e-6,1e-7,1e-8,1e-9",
      "kv_len": 512,
    },
    "smoke": {
      "precisions": "bf16-fa2+out_accum=bf16",
      "betas": "2",
      "counts": "2",
      "margins": "1e-4",
      "q_len": 32,
      "kv_len": 32,
    },
  }
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
            "pallas", policy, s.block_q, s.block_k, "fa2", tie_beta=beta
          ),
          "baseline": Kernel("reference", policy, tie_beta=beta),
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
    return _report(ctx)


# Signed share (see `metrics.signed_share`) from which errors are called
# biased away from zero, and below which (in magnitude) a fix removed it.
BIASED_SHARE = 0.5
UNBIASED_SHARE = 0.1


def _fix_label(beta) -> str:
  return "no fix" if beta is None else f"beta={beta:g}"


def spaced(name: str) -> str:
  return name.replace("_", " ")


def _axis_counts(conditions, biased, axis: str, label) -> str:
  """'axis value: biased of all' for each value of one condition axis."""
  values = sorted({c[axis] for c in conditions})
  parts = []
  for v in values:
    n_all = sum(1 for c in conditions if c[axis] == v)
    n_biased = sum(1 for c in biased if c[axis] == v)
    parts.append(f"{label(v)} {n_biased}/{n_all}")
  return ", ".join(parts)


def _share(r) -> float:
  return r["signed_share_mean"]


def _cell(pool, **filters) -> str:
  r = one(pool, **filters)
  return f"{_share(r):+.2f}" if r else "-"


HEADLINE_QUANTITIES = (
  "O",
  "delta(dO positive)",
  "delta(dO random)",
  "dq",
  "dk",
  "dv",
)


def _headline_table(c, head, betas) -> str:
  """Signed shares at the headline condition: every quantity and fix."""
  header = ["policy", "fix", "Flash O", "delta, dO > 0", "delta, random dO"]
  header += ["dQ", "dK", "dV", "Baseline O"]
  body = []
  for policy in c.precisions:
    for beta in betas:
      at = dict(policy=policy, tie_beta=beta)
      flash = [
        _cell(head, implementation="flash", quantity=q, **at)
        for q in HEADLINE_QUANTITIES
      ]
      base = _cell(head, implementation="baseline", quantity="O", **at)
      body.append([policy, _fix_label(beta), *flash, base])
  return table(header, body)


def _flash_o(rows, policy) -> list[dict]:
  return [
    r
    for r in rows
    if r["policy"] == policy
    and r["implementation"] == "flash"
    and r["quantity"] == "O"
  ]


def _condition_map(flash_o, policy, betas, margins) -> str:
  """Flash O's share in every (ties, placement, V) x margin condition."""
  conditions = sorted(
    {(r["ties"], r["placement"], r["values"]) for r in flash_o}
  )
  map_rows = []
  for ties, placement, values in conditions:
    cells = []
    for margin in margins:
      at = dict(ties=ties, placement=placement, values=values, margin=margin)
      cells.append(" / ".join(_cell(flash_o, tie_beta=b, **at) for b in betas))
    map_rows.append([ties, placement.replace("_", " "), values, *cells])
  return (
    f"Flash O under `{policy}`, share "
    f"{' / '.join(_fix_label(b) for b in betas)}:\n\n"
    + table(
      ["ties", "placement", "V", *(f"margin {m:g}" for m in margins)],
      map_rows,
    )
  )


def _listed(pool) -> str:
  """Conditions in words; by axis when there are many."""
  if len(pool) <= 6:
    return "; ".join(
      f"{r['ties']} tie(s), {spaced(r['placement'])}, {r['values']}, "
      f"margin {r['margin']:g}"
      for r in pool
    )

  def counts(axis, label):
    values = sorted({r[axis] for r in pool})
    return ", ".join(
      f"{label(v)} x{sum(1 for r in pool if r[axis] == v)}" for v in values
    )

  return (
    f"ties {counts('ties', str)}; {counts('placement', spaced)}; V "
    f"{counts('values', str)}; margins "
    f"{min(r['margin'] for r in pool):g} to "
    f"{max(r['margin'] for r in pool):g}"
  )


def _removed_by_every_fix(c, flash_o, biased):
  """(removed, kept): biased conditions every fix brings to |share| <=
  UNBIASED_SHARE (Qiu & Yao's mechanism), and those it does not."""
  removed, kept = [], []
  for r in biased:
    at = {k: r[k] for k in ("ties", "placement", "values", "margin")}
    fixed = [one(flash_o, tie_beta=beta, **at) for beta in c.betas]
    if fixed and all(
      f is not None and abs(_share(f)) <= UNBIASED_SHARE for f in fixed
    ):
      removed.append(r)
    else:
      kept.append(r)
  return removed, kept


def _flash_finding(c, flash_o, policy) -> str | None:
  """Where Flash's O is biased under `policy`, and what the fix removes."""
  unfixed = [r for r in flash_o if r["tie_beta"] is None]
  if not unfixed:
    return None
  biased = [r for r in unfixed if _share(r) >= BIASED_SHARE]
  if not biased:
    return (
      f"Under `{policy}`, Flash's O is never biased away from zero "
      f"(share < {BIASED_SHARE}) in the {len(unfixed)} conditions measured "
      f"(largest share {max(_share(r) for r in unfixed):+.2f})."
    )
  # Qiu & Yao's mechanism is the bias their fix removes; what stays
  # biased under every fix has another cause.
  removed, kept = _removed_by_every_fix(c, flash_o, biased)
  text = (
    f"Under `{policy}`, Flash's O is biased away from zero (share >= "
    f"{BIASED_SHARE}) in {len(biased)} of {len(unfixed)} conditions."
  )
  if removed:
    text += (
      f" Every fix (beta {', '.join(f'{b:g}' for b in c.betas)}) "
      f"brings {len(removed)} of them to |share| <= {UNBIASED_SHARE}: "
      f"Qiu & Yao's mechanism, found at untied mass "
      f"{min(r['margin'] for r in removed):g} to "
      f"{max(r['margin'] for r in removed):g} of the tied mass; "
      f"biased-and-fixed/all by axis: ties "
      f"{_axis_counts(unfixed, removed, 'ties', str)}; "
      f"{_axis_counts(unfixed, removed, 'placement', spaced)}; V "
      f"{_axis_counts(unfixed, removed, 'values', str)}."
    )
  else:
    text += f" No fix brings any of them to |share| <= {UNBIASED_SHARE}."
  return text + _kept_text(kept, policy)


def _kept_text(kept, policy) -> str:
  outside = [r for r in kept if r["ties"] < 2 or r["placement"] != "same_tile"]
  within = [r for r in kept if r not in outside]
  text = ""
  if outside:
    text += (
      f" {len(outside)} stay biased with one key or keys in different "
      f"tiles, which the fix does not act on ({_listed(outside)}): the "
      "untied mass lost to rounding pulls O from the other keys' mean "
      "toward the winning value."
    )
  if within:
    stats = Precision.from_name(policy).softmax_stats
    text += (
      f" {len(within)} with ties in one tile stay biased under some fix "
      f"({_listed(within)})"
      + (
        f"; this policy keeps the softmax statistics in {stats}, where the "
        "shifted tied probabilities meet the same rounding in the sum l."
        if stats in ("bf16", "fp16")
        else "."
      )
    )
  return text


def _baseline_finding(rows, head, policy, betas) -> str | None:
  base = [
    r
    for r in rows
    if r["policy"] == policy
    and r["implementation"] == "baseline"
    and r["quantity"] == "O"
    and r["tie_beta"] is None
  ]
  if not base:
    return None
  at_head = [
    one(
      head, policy=policy, tie_beta=b, implementation="baseline", quantity="O"
    )
    for b in betas
  ]
  return (
    f"Baseline under `{policy}` is biased in "
    f"{sum(1 for r in base if _share(r) >= BIASED_SHARE)} of {len(base)} "
    "conditions; at the headline condition its share is "
    + ", ".join(
      f"{_share(r):+.2f} ({_fix_label(beta)})"
      for beta, r in zip(betas, at_head)
      if r is not None
    )
    + ". It normalizes P before PV: the tied entries enter PV as p / l, "
    "1/2 for two ties up to the rounding of l, whatever the shift."
  )


def _delta_finding(c, head) -> str | None:
  at = dict(policy=c.precisions[0], tie_beta=None, implementation="flash")
  delta = one(head, quantity="delta(dO positive)", **at)
  noise = one(head, quantity="delta(dO random)", **at)
  if not (delta and noise):
    return None
  return (
    f"The bias reaches the backward pass through delta = rowsum(dO * O): "
    f"under `{c.precisions[0]}` at the headline condition its share "
    f"is {_share(delta):+.2f} for a one-sign dO and {_share(noise):+.2f} "
    "for a random-sign dO."
  )


def _figure(ctx, c, cond, betas):
  """Flash O's share per condition at the headline margin, per policy."""
  panels = {}
  for policy in c.precisions:
    pool = [
      r for r in _flash_o(ctx.rows, policy) if r["margin"] == cond["margin"]
    ]
    conditions = sorted(
      {(r["ties"], r["placement"], r["values"]) for r in pool}
    )
    labels = [
      f"{t} tied, {'one tile' if p == 'same_tile' else 'spread'}, "
      f"V {'one sign' if v == 'one_sign' else 'zero mean'}"
      for t, p, v in conditions
    ]
    missing = {"signed_share_mean": float("nan")}
    groups = {
      _fix_label(b): [
        _share(one(pool, tie_beta=b, ties=t, placement=p, values=v) or missing)
        for t, p, v in conditions
      ]
      for b in betas
    }
    panels[f"Flash O, {policy}"] = (labels, groups)
  return signed_share_panels(
    ctx.out_dir / "tied_maxima.png",
    panels,
    title=f"Signed error share per condition (ties, placement, V), margin "
    f"{cond['margin']:g}",
  )


def _report(ctx):
  c, headline, rows = ctx.config, ctx.headline, ctx.rows
  if not rows:
    return None
  betas = [None, *c.betas]
  head = [r for r in rows if r["headline"]]
  cond = tied_headline(c)
  margins = sorted({r["margin"] for r in rows}, reverse=True)
  maps = [
    _condition_map(_flash_o(rows, policy), policy, betas, margins)
    for policy in c.precisions
  ]
  findings = [_flash_finding(c, _flash_o(rows, p), p) for p in c.precisions]
  for policy in c.precisions:
    findings.append(_baseline_finding(rows, head, policy, betas))
    for beta in betas:
      r = one(
        head, policy=policy, tie_beta=beta, implementation="flash", quantity="O"
      )
      if r is not None:
        headline[f"tied_share_{policy}_{_fix_label(beta)}"] = _share(r)
  findings.append(_delta_finding(c, head))
  condition_text = (
    f"{cond['ties']} ties in one tile, "
    f"{cond['values'].replace('_', '-')} V, untied mass {cond['margin']:g} "
    "of the tied mass"
  )
  body = (
    f"Share of errors pointing away from zero, mean(err * sign(golden)) / "
    f"mean(|err|): +1 all away, -1 all toward, 0 unbiased. Headline "
    f"condition ({condition_text}):\n\n"
    + _headline_table(c, head, betas)
    + "\n\nEvery condition (cells: "
    + " / ".join(_fix_label(b) for b in betas)
    + "):\n\n"
    + "\n\n".join(maps)
  )
  plot = _figure(ctx, c, cond, betas)
  return Section(body, [f for f in findings if f], [plot.name])


STUDY = TiedMaxima()
