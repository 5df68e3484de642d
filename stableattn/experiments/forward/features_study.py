"""How the attention features real models use change Flash's deviation:
causal, a KV cache (bottom-right causal), a sliding window, logit softcap
(Gemma 2: 50 on attention logits, 30 on final logits), packed segments, a
sink logit (gpt-oss) and ALiBi, each against plain (or causal) attention,
under the natural and the all-stage BF16 policies."""

from __future__ import annotations

import dataclasses

from stableattn.auditing.feature_recipes import FeatureRecipe
from stableattn.auditing.inputs import Shape
from stableattn.experiments.engine import Case
from stableattn.experiments.forward.study import (
  Section,
  Study,
  against_golden,
  baseline,
  flash,
  range_text,
  verdict,
)
from stableattn.harness.config_values import spec
from stableattn.harness.plotting import bar_plot
from stableattn.harness.reporting import num, select, table
from stableattn.numerics.metrics import safe_ratio
from stableattn.numerics.precision import Precision

# name -> (causal, features, share of the length that queries; the rest
# is a KV cache). Each setting is compared with plain attention of the same
# causality, its reference setting.
SETTINGS = {
  "plain": (False, FeatureRecipe(), 1),
  "causal": (True, FeatureRecipe(), 1),
  "kv_cache": (True, FeatureRecipe(causal_alignment="bottom_right"), 8),
  "window_64": (True, FeatureRecipe(window=(64, 0)), 1),
  "window_256": (True, FeatureRecipe(window=(256, 0)), 1),
  "softcap_30": (False, FeatureRecipe(softcap=30.0), 1),
  "softcap_50": (False, FeatureRecipe(softcap=50.0), 1),
  "segments_4": (True, FeatureRecipe(segments=4), 1),
  "sink": (False, FeatureRecipe(sink=1.0), 1),
  "alibi": (True, FeatureRecipe(alibi=True), 1),
}
# Policy pairings: (Flash's policy, Baseline's policy). "natural": each
# kernel as it is usually built; "all_stage": every stage in BF16.
PAIRINGS = {
  "natural": ("bf16-fa2", "bf16-framework"),
  "all_stage": ("bf16", "bf16"),
}
# A feature "leaves the deviation as it was" if Flash's error relative to
# Baseline's (RMSE vs FP64) moves by less than this factor either way.
SAME_FACTOR = 1.5


@dataclasses.dataclass(frozen=True)
class Config:
  settings: tuple[str, ...] = spec(
    choices=tuple(SETTINGS),
  )
  pairings: tuple[str, ...] = spec(choices=tuple(PAIRINGS))
  # Seeds of this study (fewer than the common section's: eight settings).
  seeds: int = spec(minimum=1)


def reference_setting(setting: str) -> str:
  return "causal" if SETTINGS[setting][0] else "plain"


class AttentionFeatures(Study):
  name = "features"
  title = "Attention features: how each changes Flash's deviation"
  Config = Config
  extendable = ("seeds",)

  def seeds(self, common, config) -> int:
    return config.seeds

  def points(self, s, c):
    settings = list(
      dict.fromkeys(
        [reference_setting(x) for x in c.settings] + list(c.settings)
      )
    )
    return [
      {"setting": setting, "pairing": pairing, "distribution": dist}
      for pairing in c.pairings
      for setting in settings
      for dist in s.distributions
    ]

  def measure(self, engine, s, c, p, seed):
    causal, features, query_share = SETTINGS[p["setting"]]
    flash_policy, base_policy = PAIRINGS[p["pairing"]]
    shape = Shape(
      s.batch,
      max(1, s.seq_len // query_share),
      s.seq_len,
      s.heads,
      s.kv_heads,
      s.head_dim,
    )
    fmt = Precision.from_name(flash_policy).inputs
    case = Case(
      p["distribution"], shape, fmt, seed, causal=causal, features=features
    )
    return against_golden(
      engine,
      flash(flash_policy, s.block_q, s.block_k),
      baseline(base_policy),
      case,
    )

  def ran(self, s, c):
    return (
      f"settings {list(c.settings)} (each with its reference: plain or "
      f"causal attention), pairings "
      + ", ".join(
        f"{p} (Flash {PAIRINGS[p][0]}, Baseline {PAIRINGS[p][1]})"
        for p in c.pairings
      )
      + f"; length {s.seq_len} (a KV cache: {s.seq_len // 8} queries at its "
      f"end), tiles {s.block_q}x{s.block_k}, {s.shape_text()}, inputs "
      f"{', '.join(s.distributions)}, {s.seeds_text(c.seeds)}."
    )

  def report(self, ctx):
    rows = select(ctx.rows, comparison="flash_vs_golden")
    if not rows:
      return None
    order = list(SETTINGS)
    rows.sort(
      key=lambda r: (r["pairing"], r["distribution"], order.index(r["setting"]))
    )
    verdicts = feature_verdicts(ctx.rows)
    ctx.headline["features"] = verdicts
    body = table(
      [
        "pairing",
        "inputs",
        "setting",
        "Flash vs FP64 (max)",
        "Baseline vs FP64 (max)",
        "Flash / Baseline (RMSE)",
        "vs its reference",
      ],
      [
        [
          r["pairing"],
          r["distribution"],
          r["setting"],
          range_text(r, "max_abs"),
          num(ctx.metric(r, "baseline_vs_golden")),
          num(r["ratio_rmse_mean"]),
          _change_text(r, ctx.rows),
        ]
        for r in rows
      ],
    )
    findings = [_finding(name, v) for name, v in verdicts.items()]
    plot = _plot(ctx, rows)
    return Section(body, findings, [plot.name])


def _reference_row(r, rows):
  for other in rows:
    if (
      other["comparison"] == "flash_vs_golden"
      and other["setting"] == reference_setting(r["setting"])
      and other["pairing"] == r["pairing"]
      and other["distribution"] == r["distribution"]
    ):
      return other
  return None


def _change(r, rows) -> float | None:
  """Flash/Baseline RMSE ratio of the setting over its reference's."""
  ref = _reference_row(r, rows)
  if ref is None or r["setting"] == ref["setting"]:
    return None
  return safe_ratio(r["ratio_rmse_mean"], ref["ratio_rmse_mean"])


def _change_text(r, rows) -> str:
  change = _change(r, rows)
  return "-" if change is None else f"{change:.2f}x"


def feature_verdicts(rows) -> dict:
  """For each feature setting: does Flash's error relative to Baseline's
  stay within SAME_FACTOR of its reference's, in every (pairing, inputs)?

  Raises when a setting has no rows to decide from.
  """
  flash_rows = select(rows, comparison="flash_vs_golden")
  out = {}
  for setting in sorted(
    {r["setting"] for r in flash_rows}, key=list(SETTINGS).index
  ):
    if setting in ("plain", "causal") and setting == reference_setting(setting):
      continue
    measured = [
      (r["pairing"], r["distribution"], _change(r, flash_rows))
      for r in flash_rows
      if r["setting"] == setting
    ]
    measured = [m for m in measured if m[2] is not None]
    if not measured:
      raise ValueError(f"features: no rows for {setting!r} and its reference.")
    holds = [m for m in measured if 1 / SAME_FACTOR <= m[2] <= SAME_FACTOR]
    out[setting] = {
      "verdict": HOLDS[verdict(len(holds), len(measured))],
      "changes": [
        {"pairing": p, "distribution": d, "change": c} for p, d, c in measured
      ],
    }
  return out


# `verdict`'s words for a hypothesis of ours rather than a paper's claim.
HOLDS = {
  "reproduced": "holds",
  "reproduced in part": "holds in part",
  "not reproduced": "does not hold",
}


def _finding(setting, v) -> str:
  words = {
    "holds": "leaves",
    "holds in part": "in part leaves",
    "does not hold": "does not leave",
  }[v["verdict"]]
  changes = "; ".join(
    f"{c['pairing']}, {c['distribution']}: {c['change']:.2f}x"
    for c in v["changes"]
  )
  return (
    f"{setting} {words} Flash's error relative to Baseline's (RMSE vs "
    f"FP64) within {SAME_FACTOR}x of {reference_setting(setting)} "
    f"attention's ({changes})."
  )


def _plot(ctx, rows):
  labels = sorted({(r["pairing"], r["distribution"]) for r in rows})
  settings = [s for s in SETTINGS if any(r["setting"] == s for r in rows)]
  groups = {
    f"{p}, {d}": [
      next(
        (
          r["ratio_rmse_mean"]
          for r in rows
          if r["setting"] == s and r["pairing"] == p and r["distribution"] == d
        ),
        float("nan"),
      )
      for s in settings
    ]
    for p, d in labels
  }
  return bar_plot(
    ctx.out_dir / "features.png",
    settings,
    groups,
    title="Flash / Baseline error (RMSE vs FP64) per attention feature",
    ylabel="Flash RMSE / Baseline RMSE",
    reference_line=1.0,
    legend_outside=True,
  )


STUDY = AttentionFeatures()
