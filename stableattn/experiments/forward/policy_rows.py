"""Studies below 16 bits compare named policies, one row each, against FP64
at every point: what they share (measuring the rows, finding one, ratios
between rows, the verdict over settings, the grouped-bar figure)."""

from __future__ import annotations

from stableattn.contract.options import Options
from stableattn.experiments.engine import Case, Engine, Kernel
from stableattn.experiments.forward.study import (
  deviation_values,
  row,
  verdict,
)
from stableattn.harness.plotting import bar_plot
from stableattn.harness.reporting import num, one


def measure(engine: Engine, common, case: Case, rows: dict) -> list[dict]:
  """One row per name of `rows` (name -> (implementation, policy, ...)):
  the output's deviation from FP64, at the common tiles."""
  gold = engine.golden(case)
  out = []
  for name, (implementation, policy, *_) in rows.items():
    kernel = Kernel(
      implementation,
      Options(policy, block_q=common.block_q, block_k=common.block_k),
    )
    values = deviation_values(gold, engine.output(kernel, case))
    out.append(row({"comparison": name, "policy": policy}, values))
  return out


def settings(rows, keys: tuple[str, ...]) -> list[tuple]:
  """The distinct values of `keys` over the summary rows, sorted."""
  return sorted({tuple(r[k] for k in keys) for r in rows}, key=str)


def rmse(rows, name: str, keys: tuple[str, ...], setting: tuple):
  """The mean RMSE of row `name` at one setting, or None if not measured."""
  match = one(rows, comparison=name, **dict(zip(keys, setting)))
  return match["rmse_mean"] if match else None


def ratio(rows, numerator, denominator, keys, setting):
  """RMSE(numerator) / RMSE(denominator) at a setting; None if either is
  missing or the denominator is zero."""
  top, bottom = (rmse(rows, n, keys, setting) for n in (numerator, denominator))
  if top is None or not bottom:
    return None
  return top / bottom


def where_text(keys, setting) -> str:
  return ", ".join(
    f"{k.replace('_', ' ')} {num(v) if isinstance(v, float) else v}"
    for k, v in zip(keys, setting)
  )


def judged(values: list[dict], holds, study: str, claim: str) -> dict:
  """{"verdict", "settings"} of a claim from its per-setting values
  ({"value": ..., setting keys...}; None where a row is missing)."""
  measured = [v for v in values if v["value"] is not None]
  if not measured:
    raise ValueError(f"{study}: no setting has the rows of claim {claim!r}.")
  return {
    "verdict": verdict(
      sum(bool(holds(v["value"])) for v in measured), len(measured)
    ),
    "settings": measured,
  }


def claim_finding(text: str, claim: dict, keys, value_text: str) -> str:
  """'text: **verdict** (setting: value; ...).'"""
  parts = "; ".join(
    f"{where_text(keys, tuple(m[k] for k in keys))}: "
    + value_text.format(m["value"])
    for m in claim["settings"]
  )
  return f"{text}: **{claim['verdict']}** ({parts})."


def rmse_table_rows(rows, names, keys) -> list[list]:
  """[setting..., row name, policy, RMSE] for every measured row."""
  out = []
  for setting in settings(rows, keys):
    for name in names:
      match = one(rows, comparison=name, **dict(zip(keys, setting)))
      if match:
        out.append([*setting, name, match["policy"], num(match["rmse_mean"])])
  return out


def plot(ctx, file_name: str, names, rows, keys, title: str):
  """RMSE of every row (bars) per setting (groups), log scale."""
  groups = {
    where_text(keys, setting): [
      rmse(rows, name, keys, setting) or float("nan") for name in names
    ]
    for setting in settings(rows, keys)
  }
  return bar_plot(
    ctx.out_dir / file_name,
    list(names),
    groups,
    title=title,
    ylabel="RMSE vs FP64",
    legend_outside=True,
  )
