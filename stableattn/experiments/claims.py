"""The paper's forward claims as verdicts computed from measured rows.

Golden et al. (2024) state six forward claims (Figs. 3, 4, 5, 6a-c). Each
function here reads the summary rows of the study that measures the claim
and returns where the claim holds, where it fails, and a verdict:
"reproduced" (holds in every measured setting), "reproduced in part" (in
some) or "not reproduced" (in none). A claim whose study did not run, or
ran with too few points to test it, raises: there is no verdict from no
rows.
"""

from __future__ import annotations

from stableattn.metrics import power_law
from stableattn.precision import MANTISSA_BITS

# Fig. 4: "Flash deviates ~10x more than Baseline from golden at BF16". A
# setting counts as reaching it at 8x or more (within 20% of the figure).
PAPER_RATIO = 10.0
REACHES_PAPER_RATIO = 0.8 * PAPER_RATIO
# Fig. 6b: "square tiles have no effect" holds if equal-area tiles of any
# shape stay within this factor of each other.
NO_EFFECT_SPREAD = 1.25
# Slopes (log-log) below this size count as flat, neither rising nor falling.
FLAT_SLOPE = 0.05


def _verdict(holds: int, total: int) -> str:
  if total == 0:
    raise ValueError("a verdict needs at least one measured setting")
  if holds == total:
    return "reproduced"
  return "reproduced in part" if holds else "not reproduced"


def _rows(summary, **filters) -> list[dict]:
  return [r for r in summary if all(r.get(k) == v for k, v in filters.items())]


def _require(rows, claim: str, study: str) -> list[dict]:
  if not rows:
    raise ValueError(
      f"{claim}: no rows of study {study!r}; run it to get a verdict."
    )
  return rows


def fig3(summary) -> dict:
  """Deviation falls as mantissa bits grow, for every family of policies."""
  rows = _require(
    _rows(summary, study="format_sweep", comparison="flash_vs_baseline"),
    "fig3",
    "format_sweep",
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
    "verdict": _verdict(len(holds), len(holds) + len(fails)),
    "holds_for": holds,
    "fails_for": fails,
  }


def fig4(summary) -> dict:
  """Flash's error vs golden is ~10x Baseline's at BF16: where, if at all."""
  rows = _require(
    _rows(
      summary,
      study="against_golden",
      comparison="flash_vs_golden",
      format="bf16",
    ),
    "fig4",
    "against_golden",
  )
  ratio = lambda r: r["ratio_max_abs_mean"]  # noqa: E731
  worst = max(rows, key=ratio)
  reaching = [r for r in rows if ratio(r) >= REACHES_PAPER_RATIO]
  regions = []
  settings = sorted(
    {
      (r["flash_policy"], r["baseline_policy"], r["scheme"], r["distribution"])
      for r in rows
    }
  )
  for flash, base, scheme, dist in settings:
    series = sorted(
      (r["seq_len"], ratio(r))
      for r in rows
      if (
        r["flash_policy"],
        r["baseline_policy"],
        r["scheme"],
        r["distribution"],
      )
      == (flash, base, scheme, dist)
    )
    # From which length on every longer measured length reaches the ratio.
    start = None
    for length, value in reversed(series):
      if value < REACHES_PAPER_RATIO:
        break
      start = length
    regions.append(
      {
        "flash_policy": flash,
        "baseline_policy": base,
        "scheme": scheme,
        "distribution": dist,
        "from_length": start,
        "largest_ratio": max(v for _, v in series),
        "at_longest": series[-1][1],
        "longest": series[-1][0],
      }
    )
  return {
    "verdict": _verdict(len(reaching), len(rows)),
    "threshold": REACHES_PAPER_RATIO,
    "largest_ratio": ratio(worst),
    "largest_at": {
      k: worst[k]
      for k in (
        "flash_policy",
        "baseline_policy",
        "scheme",
        "distribution",
        "seq_len",
      )
    },
    "settings_reaching": len(reaching),
    "settings": len(rows),
    "regions": regions,
  }


def fig5(summary) -> dict:
  """max |Flash - Baseline| grows with sequence length: for which inputs."""
  rows = _require(
    _rows(summary, study="seq_len", comparison="flash_vs_baseline"),
    "fig5",
    "seq_len",
  )
  slopes = []
  for policy, dist in sorted({(r["policy"], r["distribution"]) for r in rows}):
    series = sorted(
      (r["seq_len"], r["max_abs_mean"])
      for r in rows
      if r["policy"] == policy and r["distribution"] == dist
    )
    if len(series) < 2:
      continue
    slope, _ = power_law(*zip(*series))
    slopes.append(
      {
        "policy": policy,
        "distribution": dist,
        "slope": slope,
        "grows": slope > FLAT_SLOPE,
        "from": series[0],
        "to": series[-1],
      }
    )
  if not slopes:
    raise ValueError("fig5: every series has a single length; no trend.")
  grows = [s for s in slopes if s["grows"]]
  return {"verdict": _verdict(len(grows), len(slopes)), "series": slopes}


def _tile_rows(summary, variant: str) -> list[dict]:
  return _rows(
    summary, study="tiles", variant=variant, comparison="flash_vs_baseline"
  )


def fig6a(summary) -> dict:
  """Swapping B_r and B_c (B_r > B_c) gives a larger deviation."""
  rows = _require(_tile_rows(summary, "swap"), "fig6a", "tiles")
  if len(rows) != 2:
    raise ValueError(f"fig6a: expected 2 swap rows, got {len(rows)}.")
  original = min(rows, key=lambda r: r["block_q"] / r["block_k"])
  swapped = max(rows, key=lambda r: r["block_q"] / r["block_k"])
  ratio = swapped["max_abs_mean"] / original["max_abs_mean"]
  return {
    "verdict": _verdict(int(ratio > 1), 1),
    "original": [original["block_q"], original["block_k"]],
    "swapped": [swapped["block_q"], swapped["block_k"]],
    "ratio": ratio,
  }


def fig6b(summary) -> dict:
  """Constraining tiles to be square has no effect (equal area)."""
  rows = _require(_tile_rows(summary, "equal_area"), "fig6b", "tiles")
  values = [r["max_abs_mean"] for r in rows]
  spread = max(values) / min(values)
  by_block_k = sorted((r["block_k"], r["max_abs_mean"]) for r in rows)
  return {
    "verdict": _verdict(int(spread <= NO_EFFECT_SPREAD), 1),
    "spread": spread,
    "no_effect_within": NO_EFFECT_SPREAD,
    "by_block_k": by_block_k,
  }


def fig6c(summary) -> dict:
  """Larger tiles give a smaller deviation, at every format below FP64."""
  rows = _require(_tile_rows(summary, "area"), "fig6c", "tiles")
  slopes = {}
  for fmt in sorted({r["format"] for r in rows}, key=MANTISSA_BITS.get):
    if fmt == "fp64":
      continue  # exact to rounding noise: no trend to claim
    series = sorted(
      (r["block_area"], r["max_abs_mean"]) for r in rows if r["format"] == fmt
    )
    if len(series) >= 2:
      slopes[fmt], _ = power_law(*zip(*series))
  if not slopes:
    raise ValueError("fig6c: no format with two tile areas.")
  falling = [f for f, s in slopes.items() if s < -FLAT_SLOPE]
  return {
    "verdict": _verdict(len(falling), len(slopes)),
    "slopes": slopes,
    "holds_for": falling,
  }


CLAIMS = {
  "fig3": (fig3, "deviation falls as mantissa bits grow"),
  "fig4": (fig4, "at BF16 Flash deviates ~10x more than Baseline from FP64"),
  "fig5": (fig5, "deviation grows with sequence length"),
  "fig6a": (fig6a, "swapping B_r and B_c gives a larger deviation"),
  "fig6b": (fig6b, "square tiles have no effect"),
  "fig6c": (fig6c, "larger tiles give a smaller deviation"),
}
# The study each claim is read from.
CLAIM_STUDY = {
  "fig3": "format_sweep",
  "fig4": "against_golden",
  "fig5": "seq_len",
  "fig6a": "tiles",
  "fig6b": "tiles",
  "fig6c": "tiles",
}


def paper_claims(summary, studies) -> dict[str, dict]:
  """Every claim whose study ran, with its verdict and evidence."""
  return {
    name: {"claim": text, **fn(summary)}
    for name, (fn, text) in CLAIMS.items()
    if CLAIM_STUDY[name] in studies
  }
