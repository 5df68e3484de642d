"""The tied-maxima study's report section: headline table, the map of
every condition, findings and figure (kept apart from the study's
measurement for length; `tied_maxima.py` is the study)."""

from __future__ import annotations

from stableattn.experiments.forward.study import Section
from stableattn.harness.plotting import signed_share_panels
from stableattn.harness.reporting import one, table
from stableattn.numerics.precision import Precision

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


def report(ctx, cond: dict):
  """The section, from the rows; `cond` is the headline condition."""
  c, headline, rows = ctx.config, ctx.headline, ctx.rows
  if not rows:
    return None
  betas = [None, *c.betas]
  head = [r for r in rows if r["headline"]]
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
