"""The attention monitor in an experiment's report: a trained model's
statistics per layer (`stableattn.numerics.monitor`) and the calibrated
kernels (`stableattn.auditing.thresholds`) that miss a rule where it got
to."""

from __future__ import annotations

from stableattn.auditing import monitor_verdict, thresholds
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


def verdict_section(
  records_by_run: dict, out_dir, measured: dict, data=None, kernels=None
):
  """(lines, the runs whose heads entered a region): per run (a cell of a
  sweep, a trained model), the monitor's verdict on its heads' records
  (`monitor_verdict`), worst over replicates, on the calibrated 2-D map;
  those that entered a region (or, none did, the first) drawn as heads x
  steps (`monitor_heads.png`, six at most). None without a map or
  records. `kernels`: {run: its own attention's calibration name}, which
  each run's verdict names first."""
  data = thresholds.load() if data is None else data
  if not records_by_run or not data.get("regions"):
    return [], []
  worst = {
    run: monitor_verdict.worst_over_replicates(records)
    for run, records in records_by_run.items()
  }
  found = {
    run: monitor_verdict.verdict(
      records, data, measured, (kernels or {}).get(run)
    )
    for run, records in worst.items()
  }
  entered = [run for run, v in found.items() if v["entries"]]
  lines = [
    "",
    "## The monitor's verdict, per head",
    "",
    f"Heads of {len(entered)} of {len(found)} runs entered a region of "
    f"the calibrated 2-D map (`{data['command']}`) where a kernel misses "
    "a rule (worst over replicates; docs/monitor.md).",
    "",
  ]
  for run in entered:
    verdict = found[run]["lines"]
    lines += [f"**{run}.** " + verdict[0], *verdict[1:], ""]
  # The runs that entered a region, or (none did) the first ones, quiet.
  shown = {run: worst[run] for run in (entered or list(worst))[:6]}
  monitor_verdict.plot_timeline(shown, data, out_dir / "monitor_heads.png")
  lines += ["![monitor_heads.png](monitor_heads.png)", ""]
  return lines, entered


def trained_model_verdict(out_dir, attention, step: int) -> list[str]:
  """A trained model's heads (its per-layer statistics, `attention`) on
  the calibrated 2-D map at one step, the end of training; nothing is
  measured there as a remedy."""
  if not attention or "max_logit_per_head" not in attention[0]:
    return []
  records = monitor_verdict.records_of_layers(
    step,
    [layer["max_logit_per_head"] for layer in attention],
    [layer["near_tied_share_per_head"] for layer in attention],
  )
  lines, _ = verdict_section({"trained model": records}, out_dir, {})
  return lines
