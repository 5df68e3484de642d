"""The monitor's verdict on a run: where each layer's heads were on the
calibrated 2-D map (largest logit, near-tie share) at every logged step,
when a head entered a region where a calibrated kernel misses a rule and
whether it left, and what to do about it, each remedy marked measured or
not.

The records are the monitor's per-head statistics at each logged step
(`<name>_per_head` of `stableattn.numerics.monitor.attention_statistics`:
the training reports' metrics.jsonl rows, or what the Flax drop-in sows),
so a run's verdict and a user's own loop's come from one function,
`verdict`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.auditing import map_check, thresholds

OFFSETS = "key_offset_ratio_per_head"

# Remedies for a head in a kernel's miss region, in the order to try them,
# each with what it changes (Wortsman et al. 2023 for QK-norm; Gemma 2 for
# the softcap; Kimi K2's QK-clip for clipping; docs/precision.md for the
# stable presets).
REMEDIES = {
  "stable preset": "the kernel's stable preset (e.g. bf16-fa2-stable): the "
  "backward's delta from dP's own product, which passes where ties cancel",
  "qk-norm": "QK-norm (RMSNorm of each head's q and k): bounds the logits",
  "softcap": "a logit softcap (softcap * tanh(s / softcap)): caps the logits",
  "logit clipping": "per-head QK-clip (rescaling W_q, W_k when a head's "
  "largest logit passes a bound)",
}


@dataclasses.dataclass(frozen=True)
class Entry:
  """One head's stay in the region where `kernels` miss."""

  layer: int
  head: int
  kernels: tuple[str, ...]
  entered: int  # the first logged step in the region
  left: int | None  # the first logged step out of it again; None: stayed
  max_logit: float  # the head's statistics where it entered
  near_tied_share: float
  key_offset_ratio: float | None = None  # None: the records had none


def head_records(rows, run: str | None = None) -> list[dict]:
  """Per-head statistics from metrics.jsonl rows (kind "attention"), of
  `run` (None: rows without a run name, or every run's), worst over
  replicates: one record per (step, layer)."""
  return worst_over_replicates(
    {
      "step": r["step"],
      "layer": r["layer"],
      "max_logit_per_head": np.asarray(r["max_logit_per_head"], np.float64),
      "near_tied_share_per_head": np.asarray(
        r["near_tied_share_per_head"], np.float64
      ),
      **(
        {"key_offset_ratio_per_head": np.asarray(r[OFFSETS], np.float64)}
        if OFFSETS in r
        else {}
      ),
    }
    for r in rows
    if r.get("kind", "attention") == "attention"
    and (run is None or r.get("run") == run)
    and "max_logit_per_head" in r
  )


def worst_over_replicates(records) -> list[dict]:
  """One record per (step, layer), sorted: each head's largest statistics
  over the replicates' records."""
  worst: dict = {}
  for r in records:
    key = (r["step"], r["layer"])
    if key in worst:
      for name in ("max_logit_per_head", "near_tied_share_per_head", OFFSETS):
        if name in r and name in worst[key]:
          r = {**r, name: np.maximum(r[name], worst[key][name])}
    worst[key] = r
  return [worst[k] for k in sorted(worst)]


def records_of_layers(step: int, logits_LxH, ties_LxH) -> list[dict]:
  """One step's records from per-layer lists of per-head values (as the
  stability sweep logs them)."""
  return [
    {
      "step": step,
      "layer": layer,
      "max_logit_per_head": np.asarray(logits, np.float64),
      "near_tied_share_per_head": np.asarray(ties, np.float64),
    }
    for layer, (logits, ties) in enumerate(zip(logits_LxH, ties_LxH))
  ]


def timeline(records, data) -> dict:
  """{(layer, head): [(step, kernels missing there, largest logit,
  near-tie share, key offset), ...]} by step: the kernels the drawn map
  places there and, where the records hold key offsets, those the
  captured calibration predicts (`map_check.predicted_on_captures`)."""
  captured = map_check.captured_entries(data)
  out: dict = {}
  for rec in records:
    heads = len(rec["max_logit_per_head"])
    offsets = rec.get(OFFSETS, np.full(heads, np.nan))
    group = heads // len(offsets)  # a KV head's offset for its queries
    for head in range(heads):
      logit = float(rec["max_logit_per_head"][head])
      share = float(rec["near_tied_share_per_head"][head])
      offset = float(offsets[head // group])
      kernels = set(thresholds.kernels_missing_at(logit, data, share))
      if not np.isnan(offset):
        point = {"key_offset_ratio": offset, "near_tied_share": share}
        kernels |= {
          name
          for name, entry in captured.items()
          if map_check.predicted_on_captures(entry, point)
        }
      out.setdefault((rec["layer"], head), []).append(
        (rec["step"], tuple(sorted(kernels)), logit, share, offset)
      )
  return {k: sorted(v) for k, v in sorted(out.items())}


def entries(records, data) -> list[Entry]:
  """Every stay of a head in a miss region: when it entered (the region
  of a set of kernels), and when it left, if it did."""
  found = []
  for (layer, head), steps in timeline(records, data).items():
    current = None
    for step, kernels, logit, share, offset in steps:
      if current is not None and kernels != current.kernels:
        found.append(dataclasses.replace(current, left=step))
        current = None
      if current is None and kernels:
        offset = None if np.isnan(offset) else offset
        current = Entry(layer, head, kernels, step, None, logit, share, offset)
    if current is not None:
      found.append(current)
  return found


def verdict(
  records, data=None, measured: dict | None = None, kernel: str | None = None
) -> dict:
  """The run's verdict from its per-head records (`head_records`, or the
  Flax drop-in's sown statistics as {"step", "layer",
  "max_logit_per_head", "near_tied_share_per_head"}):

    {"entries": [Entry as dict], "kernels": the calibrated kernels that
     miss somewhere the run went, "heads": heads that entered / all heads,
     "recommendations": [{"remedy", "what", "evidence"}], "lines": the
     verdict in words}.

  `measured`: {remedy: where it was measured} for remedies a study
  measured (the drift study's stable pair, the stability sweep's arms);
  the others are marked "not measured". `data`: the calibration
  (`thresholds.load()` by default). `kernel`: the run's own attention in
  the calibration's names (`thresholds.calibration_name`): the verdict
  says first whether it is among the kernels predicted to miss."""
  data = thresholds.load() if data is None else data
  if not data.get("regions"):
    raise ValueError(
      "the calibration has no 2-D map: run python launch/monitor_thresholds.py"
    )
  measured = measured or {}
  found = entries(records, data)
  heads = {(r["layer"], h) for r in records
           for h in range(len(r["max_logit_per_head"]))}  # fmt: skip
  kernels = sorted({k for e in found for k in e.kernels})
  recommendations = [
    {
      "remedy": name,
      "what": what,
      "evidence": measured.get(name, "not measured"),
    }
    for name, what in REMEDIES.items()
  ]
  return {
    "entries": [dataclasses.asdict(e) for e in found],
    "kernels": kernels,
    "heads": [len({(e.layer, e.head) for e in found}), len(heads)],
    "recommendations": recommendations if found else [],
    "own_kernel": kernel,
    "own_kernel_misses": kernel in kernels if kernel else None,
    "lines": _own_kernel_lines(found, kernel)
    + _lines(found, len(heads), kernels, recommendations),
  }


def _own_kernel_lines(found, kernel: str | None) -> list[str]:
  """The verdict on the run's own kernel, first: where its heads went
  that it is predicted to miss (key offsets and near ties from the
  captured calibration, the largest logit from the drawn map)."""
  if kernel is None:
    return []
  mine = [e for e in found if kernel in e.kernels]
  if not mine:
    return [f"The run's own kernel, `{kernel}`, is predicted to pass "
            "wherever its heads went."]  # fmt: skip
  worst = max(mine, key=lambda e: e.key_offset_ratio or 0.0)
  heads = len({(e.layer, e.head) for e in mine})
  offset = (
    ""
    if worst.key_offset_ratio is None
    else f", key offset {worst.key_offset_ratio:.3g}"
  )
  return [
    f"The run's own kernel, `{kernel}`, is predicted to miss a rule on "
    f"{heads} head(s), first at step {min(e.entered for e in mine)} "
    f"(e.g. layer {worst.layer} head {worst.head}: largest logit "
    f"{worst.max_logit:.3g}, near-tie share {worst.near_tied_share:.2f}"
    f"{offset}); a shared key component enters dQ through delta from "
    "the stored O (docs/precision.md)."
  ]


def _lines(found, heads: int, kernels, recommendations) -> list[str]:
  if not found:
    return [
      f"No head of {heads} entered a region where a calibrated kernel "
      "misses a rule (the 2-D map of `python launch/monitor_thresholds.py`)."
    ]
  entered = len({(e.layer, e.head) for e in found})
  lines = [
    f"{entered} of {heads} heads entered a region where calibrated "
    f"kernels miss a rule ({', '.join(kernels)}; the drawn 2-D map, or "
    "the key offsets of captured layers):"
  ]
  for e in found[:12]:
    stay = (
      f"left at step {e.left}"
      if e.left is not None
      else "still there at the last log"
    )
    lines.append(
      f"- layer {e.layer} head {e.head}: from step {e.entered} (largest "
      f"logit {e.max_logit:.3g}, near-tie share {e.near_tied_share:.2f}), "
      f"{stay}; missing there: {', '.join(e.kernels)}."
    )
  if len(found) > 12:
    lines.append(f"- ... and {len(found) - 12} more stays.")
  lines.append(
    "What to do if the run uses one of them (the map is measured; whether "
    "a remedy helps this run is measured only where marked):"
  )
  lines += [
    f"- {r['remedy']}: {r['what']} ({r['evidence']})." for r in recommendations
  ]
  return lines


def plot_timeline(records_by_run: dict, data, path) -> None:
  """Per run, heads x logged steps, coloured by how many calibrated
  kernels miss where each head is on the 2-D map (0: none)."""
  from stableattn.harness.plotting import plt, save_figure

  lines_by_run = {run: timeline(r, data) for run, r in records_by_run.items()}
  heads = max(len(v) for v in lines_by_run.values())
  fig, axes = plt.subplots(
    len(lines_by_run),
    1,
    figsize=(7, max(2.0, 0.22 * heads + 1.2) * len(lines_by_run)),
    squeeze=False,
  )
  vmax = max(1, len(data["regions"]))
  for ax, (run, lines) in zip(axes[:, 0], lines_by_run.items()):
    steps = sorted({step for v in lines.values() for step, *_ in v})
    grid = np.zeros((len(lines), len(steps)))
    for row, points in enumerate(lines.values()):
      for step, kernels, *_ in points:
        grid[row, steps.index(step)] = len(kernels)
    image = ax.imshow(grid, aspect="auto", cmap="Reds", vmin=0, vmax=vmax)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
    ax.set_yticks(
      range(len(lines)),
      [f"L{layer} H{head}" for layer, head in lines],
      fontsize=6,
    )
    ax.set_title(f"{run}: calibrated kernels missing where each head is",
                 fontsize=9)  # fmt: skip
    fig.colorbar(image, ax=ax, label="kernels")
  axes[-1, 0].set_xlabel("logged step")
  save_figure(fig, path)
