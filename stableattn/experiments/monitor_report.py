"""The attention monitor in an experiment's report: a trained model's
statistics per layer (`stableattn.numerics.monitor`) and the calibrated
kernels (`stableattn.auditing.thresholds`) that miss a rule where it got
to."""

from __future__ import annotations

from stableattn.auditing import thresholds
from stableattn.harness.reporting import num, table


def attention_section(attention) -> list[str]:
  """The trained model's attention among the audit's regimes: per layer,
  the monitor's statistics on a held-out batch, and the calibrated
  kernels that miss a rule at its largest logit."""
  if not attention:
    return []
  keys = ("max_logit", "min_row_lse", "near_tied_share", "fp16_underflow_share",
          "k_outlier_ratio")  # fmt: skip
  body = [
    [i, *(num(layer[k]) for k in keys)] for i, layer in enumerate(attention)
  ]
  peak = max(layer["max_logit"] for layer in attention)
  missing = thresholds.kernels_missing_at(peak)
  return [
    "",
    "## The trained model's attention",
    "",
    "The monitor's statistics on a held-out batch (docs/monitor.md). "
    + (
      f"At its largest logit ({num(peak)}) these calibrated kernels miss a "
      f"rule: {', '.join(missing)}."
      if missing
      else f"No calibrated kernel misses a rule at its largest logit "
      f"({num(peak)})."
    ),
    "",
    table(["layer", *keys], body),
  ]
