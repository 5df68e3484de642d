"""The long_context study's report: its table, figure and the verdicts on
the claims of the threads it maps, each computed from the summary rows."""

from __future__ import annotations

from stableattn.experiments.forward.study import (
  FLAT_SLOPE,
  Claim,
  Section,
  claim_findings,
  require,
  verdict,
)
from stableattn.harness.plotting import Series, line_panels
from stableattn.harness.reporting import num, one, select, table
from stableattn.numerics.metrics import power_law

ONE_LEVEL = "fp8 one-level (Hopper)"
TWO_LEVEL = ("two-level n=1", "two-level n=4", "two-level n=64")
CONTROL = "fp8 (FP32 accumulator)"  # the same FP8 operands
ERROR_INPUTS = ("normal", "outliers", "sink")
# Two-level n = 1 "restores" the FP32 accumulator's error within this.
RESTORED = 1.1
# Relative differences of error below this are noise; one level must cost
# at least COSTS over n = 1 for the trade-off to show.
NOISE, COSTS = 0.01, 0.05
# A share of needle rows retrieved otherwise this much larger counts.
KEPT = 0.02


def _verdict(found: list[dict], **evidence) -> dict:
  """The verdict over the settings in `found` (each with "holds"), and
  the evidence the claim's sentence reads."""
  return {
    "verdict": verdict(sum(f["holds"] for f in found), len(found)),
    **evidence,
  }


def _rows(rows, study="long_context"):
  return require(select(rows, study=study), "long_context", "long_context")


def _error(rows, label, length, distribution):
  r = one(rows, comparison=label, length=length, distribution=distribution)
  return None if r is None else r["rel_error_mean"]


def _series(rows, label, distribution, value="rel_error_mean"):
  return sorted(
    (r["length"], r[value])
    for r in select(rows, comparison=label, distribution=distribution)
    if value in r
  )


def grows(rows) -> dict:
  """The one-level accumulator's error grows with length (log-log slope
  above FLAT_SLOPE), per input distribution."""
  rows = _rows(rows)
  found = []
  for dist in ERROR_INPUTS:
    series = _series(rows, ONE_LEVEL, dist)
    if len(series) < 3:
      continue
    slope, _ = power_law(*zip(*series))
    found.append({"distribution": dist, "slope": slope, "from": series[0],
                  "to": series[-1], "holds": slope > FLAT_SLOPE})  # fmt: skip
  if not found:
    raise ValueError(
      "long_context: fewer than 3 lengths measured, no trend; give at "
      "least 3 in config.long_context.lengths."
    )
  return _verdict(found, series=found)


def grows_evidence(claim) -> str:
  return "; ".join(
    f"{f['distribution']}: slope {f['slope']:+.2f} ({num(f['from'][1])} at "
    f"{f['from'][0]} to {num(f['to'][1])} at {f['to'][0]})"
    for f in claim["series"]
  )


def cause(rows) -> dict:
  """The narrow accumulator is what grows: the one-level error over the
  FP32-accumulator control's (same FP8 operands) grows with length,
  per input; the control's own slope is reported beside it."""
  rows = _rows(rows)
  found = []
  for dist in ERROR_INPUTS:
    one_level = dict(_series(rows, ONE_LEVEL, dist))
    control = dict(_series(rows, CONTROL, dist))
    lengths = sorted(set(one_level) & set(control))
    if len(lengths) < 3:
      continue
    ratios = [one_level[n] / control[n] for n in lengths]
    slope, _ = power_law(lengths, ratios)
    control_slope, _ = power_law(lengths, [control[n] for n in lengths])
    found.append(
      {
        "distribution": dist,
        "slope": slope,
        "control_slope": control_slope,
        "last": ratios[-1],
        "length": lengths[-1],
        "holds": slope > FLAT_SLOPE,
      }
    )
  if not found:
    raise ValueError(
      f"long_context: {ONE_LEVEL!r} and {CONTROL!r} at 3 lengths needed."
    )
  return _verdict(found, series=found)


def cause_evidence(claim) -> str:
  return "; ".join(
    f"{f['distribution']}: one level / FP32 accumulator slope "
    f"{f['slope']:+.2f} ({f['last']:.2f}x at {f['length']}), the FP32 "
    f"accumulator's own slope {f['control_slope']:+.2f}"
    for f in claim["series"]
  )


def restored(rows) -> dict:
  """Two-level accumulation (n = 1) has the FP32 accumulator's error
  (within RESTORED) at every length and input."""
  rows = _rows(rows)
  found = []
  for r in select(rows, comparison=TWO_LEVEL[0]):
    if r["distribution"] not in ERROR_INPUTS:
      continue
    control = _error(rows, CONTROL, r["length"], r["distribution"])
    if control:
      ratio = r["rel_error_mean"] / control
      found.append({"length": r["length"], "distribution": r["distribution"],
                    "ratio": ratio, "holds": ratio <= RESTORED})  # fmt: skip
  if not found:
    raise ValueError(f"long_context: no rows of {TWO_LEVEL[0]} and {CONTROL}.")
  worst = max(found, key=lambda f: f["ratio"])
  return _verdict(found, worst=worst, settings=len(found))


def restored_evidence(claim) -> str:
  w = claim["worst"]
  return (
    f"largest error over the FP32-accumulator control {w['ratio']:.3f}x "
    f"({w['distribution']}, length {w['length']}) over "
    f"{claim['settings']} settings"
  )


def trade_off(rows) -> dict:
  """At the longest length, error rises as promotion gets rarer:
  n = 1 <= n = 4 <= n = 64 <= one level (each within NOISE), and one
  level at least COSTS above n = 1, per input."""
  rows = _rows(rows)
  longest = max(r["length"] for r in rows)
  order = (*TWO_LEVEL, ONE_LEVEL)
  found = []
  for dist in ERROR_INPUTS:
    errors = [_error(rows, label, longest, dist) for label in order]
    if None in errors:
      continue
    # Non-decreasing within noise, and one level measurably worse.
    monotone = all(a <= b * (1 + NOISE) for a, b in zip(errors, errors[1:]))
    costs = errors[-1] >= errors[0] * (1 + COSTS)
    found.append({"distribution": dist, "errors": errors,
                  "holds": monotone and costs})  # fmt: skip
  if not found:
    raise ValueError("long_context: the interval rows are missing.")
  return _verdict(found, length=longest, series=found)


def trade_off_evidence(claim) -> str:
  return f"length {claim['length']}: " + "; ".join(
    f"{f['distribution']}: " + " / ".join(num(e) for e in f["errors"])
    for f in claim["series"]
  )


def needle(rows) -> dict:
  """At the longest length the one-level accumulator retrieves needles
  otherwise than the same FP8 operands with an FP32 accumulator more often
  than two-level accumulation (n = 1) does."""
  rows = _rows(rows)
  needles = select(rows, distribution="needle")
  if not needles:
    raise ValueError("long_context: no needle rows.")
  longest = max(r["length"] for r in needles)
  flips = {}
  for label in (ONE_LEVEL, *TWO_LEVEL):
    r = one(needles, comparison=label, length=longest)
    if r is not None and "flips_vs_fp32_accumulator_mean" in r:
      flips[label] = r["flips_vs_fp32_accumulator_mean"]
  if ONE_LEVEL not in flips or TWO_LEVEL[0] not in flips:
    raise ValueError(
      f"long_context: the needle claim needs {ONE_LEVEL!r}, "
      f"{TWO_LEVEL[0]!r} and the control {CONTROL!r}."
    )
  holds = flips[ONE_LEVEL] > flips[TWO_LEVEL[0]] + KEPT
  return {"verdict": verdict(int(holds), 1), "length": longest,
          "flips": flips}  # fmt: skip


def needle_evidence(claim) -> str:
  return f"length {claim['length']}, needle rows retrieved otherwise than " \
    "with an FP32 accumulator: " + ", ".join(
      f"{label} {share:.3f}" for label, share in claim["flips"].items()
    )  # fmt: skip


CLAIMS = {
  "lc_grows": Claim(
    "FP8 attention's error grows with context under the one-level narrow "
    "accumulator (vllm #15865, #23813)",
    grows,
    grows_evidence,
  ),
  "lc_cause": Claim(
    "the growth is the narrow accumulator's: one level over the same FP8 "
    "operands with an FP32 accumulator grows with context "
    "(vllm #23813, DeepSeek-V3 3.3.2)",
    cause,
    cause_evidence,
  ),
  "lc_restored": Claim(
    "two-level accumulation (n = 1) restores the FP32 accumulator's error "
    "(vllm-project/flash-attention #104)",
    restored,
    restored_evidence,
  ),
  "lc_interval": Claim(
    "promoting less often trades accuracy: n = 1 <= 4 <= 64 <= one level "
    "(vllm-project/flash-attention #122)",
    trade_off,
    trade_off_evidence,
  ),
  "lc_needle": Claim(
    "the one-level accumulator changes which needle is retrieved at long "
    "context more often than two-level accumulation "
    "(vllm-project/flash-attention #122)",
    needle,
    needle_evidence,
  ),
}


def section(ctx) -> Section | None:
  rows = select(ctx.rows, study="long_context")
  if not rows:
    return None
  lengths = sorted({r["length"] for r in rows})
  labels = list(dict.fromkeys(r["comparison"] for r in rows))
  dists = [d for d in ERROR_INPUTS if select(rows, distribution=d)]
  header = ["policy", "length"] + [f"error, {d}" for d in dists]
  header += ["needles retrieved", "by FP64", "flips vs FP32 accumulator",
             "needle mass error"]  # fmt: skip
  body = []
  for label in labels:
    for n in lengths:
      cells = [label, n] + [num(_error(rows, label, n, d)) for d in dists]
      r = one(rows, comparison=label, length=n, distribution="needle")
      if r is None:
        cells += ["-"] * 4
      else:
        flips = r.get("flips_vs_fp32_accumulator_mean")
        cells += [f"{r['retrieved_mean']:.3f}",
                  f"{r['retrieved_fp64_mean']:.3f}",
                  "-" if flips is None else f"{flips:.3f}",
                  num(r["needle_mass_error_mean"])]  # fmt: skip
      body.append(cells)
  text = (
    "Relative error ||O - O_fp64|| / ||O_fp64|| of the decode rows (mean "
    "over seeds), and the needle task's retrieval rate and the needle's "
    "attention mass error.\n\n" + table(header, body)
  )
  figure = _figure(ctx, rows, labels, dists)
  ctx.headline["long_context"] = {
    cid: ctx.claims[cid] for cid in CLAIMS if cid in ctx.claims
  }
  return Section(text, claim_findings(CLAIMS, ctx), [figure])


def _figure(ctx, rows, labels, dists) -> str:
  panels = {
    f"error, {d} inputs": [
      Series.from_points(label, _series(rows, label, d)) for label in labels
    ]
    for d in dists
  }
  if select(rows, distribution="needle"):
    panels["needles retrieved"] = [
      Series.from_points(
        label, _series(rows, label, "needle", "retrieved_mean")
      )
      for label in labels
    ]
  path = ctx.out_dir / "long_context.png"
  line_panels(
    path,
    panels,
    title="Decode rows over long contexts: error and needle retrieval",
    xlabel="keys",
    ylabel="relative error / rate",
    logy=True,
  )
  return path.name
