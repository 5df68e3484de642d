"""FlashAttention-3's Table 3, all six rows (Shah et al. 2024, Sec. 4.3):
RMSE against FP64 on outlier inputs, FP16 and FP8 (e4m3), standard
attention against FlashAttention-3 and its two FP8 ablations, mapped over
the outliers' size, the head dim, the sequence length and two readings of
the FP8 baseline.

Table 3 describes its FP8 baseline as "per-tensor scaling, matmul
accumulation in FP32, softmax intermediates in FP16" without saying
whether the probabilities enter P V in e4m3 (`fp8-baseline`) or stay FP16
(`fp8-baseline+probs=fp16`). The readings differ: a normalized P (about
1/length) cast to e4m3 falls among its subnormals, so under the first
the flash algorithm alone (P unnormalized until after P V) already gains,
and the rotation's share of FlashAttention-3's gain shrinks."""

from __future__ import annotations

import dataclasses
import math

from stableattn.auditing.inputs import Shape
from stableattn.contract.options import Options
from stableattn.experiments.engine import Case, Kernel
from stableattn.experiments.forward.study import (
  Section,
  Study,
  deviation_values,
  row,
  verdict,
)
from stableattn.harness.config_values import spec
from stableattn.harness.plotting import bar_plot
from stableattn.harness.reporting import num, table

# Table 3's rows: name -> (implementation, policy, FlashAttention-3's RMSE).
# The published numbers are compared with, never measured here.
ROWS = {
  "fp16_standard": ("reference", "fp16-framework", 3.2e-4),
  "fp16_flash": ("pallas", "fp16-fa2", 1.9e-4),
  "fp8_baseline": ("reference", "fp8-baseline", 2.4e-2),
  "fp8_baseline_fp16_probs": (
    "reference",
    "fp8-baseline+probs=fp16",
    2.4e-2,
  ),
  "fp8_fa3": ("pallas", "fp8-fa3", 9.1e-3),
  "fp8_fa3_no_block_quant": ("pallas", "fp8-fa3+block_quant=off", 9.3e-3),
  "fp8_fa3_no_hadamard": ("pallas", "fp8-fa3+hadamard=off", 2.4e-2),
  # Not in Table 3: the baseline's policy in our flash kernel, which keeps
  # P unnormalized (its largest entry 1) until after P V, so small
  # probabilities stay above e4m3's smallest subnormal (2^-9) more often
  # than the standard attention's normalized P.
  "fp8_baseline_in_flash_kernel": ("pallas", "fp8-baseline", None),
}
# The two readings of Table 3's FP8 baseline: reading -> row.
BASELINES = {
  "P in e4m3": "fp8_baseline",
  "P in FP16": "fp8_baseline_fp16_probs",
}
# Claims of Table 3 (computed from rows at every measured setting):
# the baseline / FA3 RMSE ratio lies in this band (FA3: 2.6) ...
GAIN_BAND = (1.5, 5.0)
# ... switching the rotation off loses at least this share of the gain ...
MOST = 0.5
# ... and switching block quantization off costs at most this factor.
LITTLE = 1.2


@dataclasses.dataclass(frozen=True)
class Config:
  seq_lens: tuple[int, ...] = spec(minimum=1)
  heads: int = spec(minimum=1)
  head_dims: tuple[int, ...] = spec(minimum=1)
  # Standard deviation of the outlier spikes: 10 is FlashAttention-3's
  # N(0, 100) read as a variance, 100 as a standard deviation.
  outlier_stds: tuple[float, ...] = spec(minimum=0.0)
  seeds: int = spec(minimum=1)


class FA3FP8(Study):
  name = "fa3_fp8"
  title = "FlashAttention-3 Table 3, FP16 and FP8 (outlier inputs, RMSE)"
  Config = Config
  extendable = ("seeds",)

  def seeds(self, common, config) -> int:
    return config.seeds

  def points(self, s, c):
    return [
      {"head_dim": d, "outlier_std": std, "seq_len": n}
      for n in c.seq_lens
      for d in c.head_dims
      for std in c.outlier_stds
    ]

  def measure(self, engine, s, c, p, seed):
    shape = Shape(
      1, p["seq_len"], p["seq_len"], c.heads, c.heads, p["head_dim"]
    )
    case = Case("outliers", shape, "fp16", seed, outlier_std=p["outlier_std"])
    gold = engine.golden(case)
    rows = []
    for name, (implementation, policy, _) in ROWS.items():
      kernel = Kernel(
        implementation, Options(policy, block_q=s.block_q, block_k=s.block_k)
      )
      values = deviation_values(gold, engine.output(kernel, case))
      rows.append(row({"comparison": name, "policy": policy}, values))
    return rows

  def ran(self, s, c):
    return (
      f"outlier inputs N(0,1) + N(0, std^2) * Bernoulli(0.001), std "
      f"{list(c.outlier_stds)}; lengths {list(c.seq_lens)}, {c.heads} "
      f"heads, head dims {list(c.head_dims)}, tiles {s.block_q}x"
      f"{s.block_k}, inputs in FP16, {c.seeds} seed(s)."
    )

  def report(self, ctx):
    rows = [r for r in ctx.rows if r["comparison"] in ROWS]
    if not rows:
      return None
    claims = table3_claims(rows)
    ctx.headline["fa3_fp8"] = claims
    settings = _settings(rows)
    body_rows = []
    for setting in settings:
      for name, (_, policy, published) in ROWS.items():
        r = _one(rows, name, setting)
        if r:
          body_rows.append(
            [
              *_setting_cells(setting),
              name,
              policy,
              num(r["rmse_mean"]),
              "-" if published is None else num(published),
            ]
          )
    body = table(
      [
        "length",
        "head dim",
        "outlier std",
        "row",
        "policy",
        "ours: RMSE vs FP64",
        "FlashAttention-3",
      ],
      body_rows,
    )
    findings = [_finding(key, claim) for key, claim in claims.items()]
    split = _statistics_share(rows, settings)
    if split:
      findings.append(split)
    findings.append(_absolute_finding(rows, settings))
    plot = _plot(ctx, rows, settings)
    return Section(body, findings, [plot.name])


def _settings(rows) -> list[tuple]:
  """The measured (length, head dim, outlier std) settings, sorted."""
  return sorted({(r["seq_len"], r["head_dim"], r["outlier_std"]) for r in rows})


def _setting_cells(setting) -> list:
  n, d, std = setting
  return [n, d, num(std)]


def _setting_text(setting) -> str:
  n, d, std = setting
  return f"length {n}, head dim {d}, outlier std {num(std)}"


def _one(rows, name, setting):
  for r in rows:
    if r["comparison"] == name and (
      r["seq_len"],
      r["head_dim"],
      r["outlier_std"],
    ) == tuple(setting):
      return r
  return None


def _rmse(rows, name, setting):
  r = _one(rows, name, setting)
  return r and r["rmse_mean"]


def table3_claims(rows) -> dict:
  """Table 3's three FP8 claims at each measured setting, the first two
  under each reading of the FP8 baseline (`BASELINES`).

  Raises when no setting has FlashAttention-3's three FP8 rows and a
  baseline (no verdict from no rows).
  """
  out = {"gain": [], "hadamard": [], "block_quant": []}
  for setting in _settings(rows):
    fa3, no_rotation, no_blocks = (
      _rmse(rows, name, setting)
      for name in ("fp8_fa3", "fp8_fa3_no_hadamard", "fp8_fa3_no_block_quant")
    )
    if not (fa3 and no_rotation and no_blocks):
      continue
    n, d, std = setting
    where = {"seq_len": n, "head_dim": d, "outlier_std": std}
    bases = {
      reading: _rmse(rows, name, setting) for reading, name in BASELINES.items()
    }
    bases = {reading: base for reading, base in bases.items() if base}
    if not bases:
      continue
    for reading, base in bases.items():
      # Share of the gain (base - fa3) the rotation's absence gives back;
      # None where FlashAttention-3 gains nothing.
      lost = (no_rotation - fa3) / (base - fa3) if base > fa3 else None
      tagged = {**where, "baseline": reading}
      out["gain"].append({**tagged, "value": base / fa3})
      out["hadamard"].append({**tagged, "value": lost})
    out["block_quant"].append({**where, "value": no_blocks / fa3})
  if not out["block_quant"]:
    raise ValueError(
      "fa3_fp8: no setting has FlashAttention-3's three FP8 rows and a "
      "baseline."
    )
  holds = {
    "gain": lambda v: GAIN_BAND[0] <= v <= GAIN_BAND[1],
    "hadamard": lambda v: v is not None and v >= MOST,
    "block_quant": lambda v: v <= LITTLE,
  }

  def judged(values):
    return verdict(sum(holds[key](m["value"]) for m in values), len(values))

  claims = {}
  for key, values in out.items():
    claims[key] = {"verdict": judged(values), "settings": values}
    if key != "block_quant":
      claims[key]["by_baseline"] = {
        reading: judged([m for m in values if m["baseline"] == reading])
        for reading in BASELINES
        if any(m["baseline"] == reading for m in values)
      }
  return claims


CLAIM_TEXT = {
  "gain": (
    f"FP8 baseline RMSE / FlashAttention-3 RMSE in [{GAIN_BAND[0]}, "
    f"{GAIN_BAND[1]}] (FA3: 2.6)"
  ),
  "hadamard": (
    f"without the rotation FlashAttention-3 loses at least {MOST:.0%} of "
    "its gain (FA3: all of it)"
  ),
  "block_quant": (
    f"without block quantization it costs at most {LITTLE}x (FA3: 1.02x)"
  ),
}
VALUE_TEXT = {
  "gain": "{:.2f}x",
  "hadamard": "{:.0%} of the gain lost",
  "block_quant": "{:.2f}x",
}


def _value_text(key, value) -> str:
  if value is None:
    return "no gain to lose"
  return VALUE_TEXT[key].format(value)


def _finding(key, claim) -> str:
  def listed(values):
    return "; ".join(
      _setting_text((m["seq_len"], m["head_dim"], m["outlier_std"]))
      + ": "
      + _value_text(key, m["value"])
      for m in values
    )

  if "by_baseline" not in claim:
    return (
      f"{CLAIM_TEXT[key]}: **{claim['verdict']}** "
      f"({listed(claim['settings'])})."
    )
  parts = [
    f"baseline with {reading}: **{judged}** ("
    + listed([m for m in claim["settings"] if m["baseline"] == reading])
    + ")"
    for reading, judged in claim["by_baseline"].items()
  ]
  return f"{CLAIM_TEXT[key]}: " + "; ".join(parts) + "."


def _absolute_finding(rows, settings) -> str:
  """Ours against FlashAttention-3's absolute FP8 RMSEs, per setting."""
  parts = []
  for setting in settings:
    logs = [
      math.log(r["rmse_mean"] / published)
      for name, (_, _, published) in ROWS.items()
      if name.startswith("fp8") and published
      for r in [_one(rows, name, setting)]
      if r and r["rmse_mean"] > 0
    ]
    if logs:
      ratio = math.exp(sum(logs) / len(logs))
      parts.append(f"{_setting_text(setting)}: {ratio:.2f}x")
  return (
    "Our absolute FP8 RMSEs over FlashAttention-3's (geometric mean over "
    "its FP8 rows, both baseline readings): " + "; ".join(parts) + ". "
    "Table 3 states no shapes; the ratios between rows are what compares."
  )


def _statistics_share(rows, settings) -> str | None:
  """How much of FlashAttention-3's gain the flash algorithm alone (the
  baseline's policy in our kernel) gives."""
  parts = []
  for setting in settings:
    base, fa3, in_kernel = (
      _rmse(rows, name, setting)
      for name in ("fp8_baseline", "fp8_fa3", "fp8_baseline_in_flash_kernel")
    )
    if not (base and fa3 and in_kernel) or base <= fa3:
      continue
    share = (base - in_kernel) / (base - fa3)
    parts.append(f"{_setting_text(setting)}: {share:.0%}")
  if not parts:
    return None
  return (
    "Of FlashAttention-3's FP8 gain over the standard-attention baseline "
    "with P in e4m3, the flash algorithm alone (the baseline's policy, "
    "per-tensor scales and FP16 softmax, in our kernel, whose P is "
    "unnormalized when cast to e4m3) gives: " + "; ".join(parts) + "."
  )


def _plot(ctx, rows, settings):
  groups = {
    f"n={n}, d={d}, std {num(std)}": [
      (_one(rows, name, (n, d, std)) or {}).get("rmse_mean", float("nan"))
      for name in ROWS
    ]
    for n, d, std in settings
  }
  groups["FlashAttention-3"] = [
    float("nan") if published is None else published
    for *_, published in ROWS.values()
  ]
  return bar_plot(
    ctx.out_dir / "fa3_fp8.png",
    list(ROWS),
    groups,
    title="FlashAttention-3 Table 3 rows: RMSE vs FP64, outlier inputs",
    ylabel="RMSE",
    legend_outside=True,
  )


STUDY = FA3FP8()
