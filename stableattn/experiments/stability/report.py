"""report.md, headline.json and the figures of the stability experiment;
every number is computed from the rows in metrics.jsonl."""

from __future__ import annotations

import json

import numpy as np

from stableattn.experiments.stability import analysis, monitor_cells
from stableattn.experiments.stability.settings import Arm, Settings
from stableattn.experiments.stability.sweep import load_tokens
from stableattn.harness import environment
from stableattn.harness.plotting import Series, line_panels
from stableattn.harness.reporting import Interval, num, resolution, table


def numbers_of(s: Settings, rows) -> dict:
  """Arm name -> `analysis.arm_numbers`, for arms with a complete grid.

  Raises ValueError when no arm has one (no verdict from no rows)."""
  out = {}
  for arm in s.arms:
    numbers = analysis.arm_numbers(
      rows, arm.name, s.learning_rates, s.clip_loss
    )
    if numbers:
      out[arm.name] = numbers
  if not out:
    raise ValueError(
      "stability: no arm has final rows at every learning rate of one "
      "replicate; there is nothing to judge yet."
    )
  return out


def _interval_dict(i):
  return None if i is None else i.as_dict()


def verdicts(s: Settings, numbers: dict) -> dict:
  """Flash (and every other variant) against Baseline, next to the two
  references (BF16 against FP32 training, Baseline on another machine);
  each mitigation against none; and Wortsman et al.'s qualitative result,
  from the arms' numbers."""
  precision = s.arms[0].precision
  mitigations = sorted({a.mitigation for a in s.arms}, key=_mitigation_order)
  variants = [
    v for v in dict.fromkeys(a.variant for a in s.arms_here) if v != "baseline"
  ]
  out = {"variants": {}, "mitigations": {}, "precision": {}, "machine": {}}
  for m in mitigations:
    base = numbers.get(f"baseline/{precision}/{m}")
    elsewhere = Arm("baseline", precision, m, s.machine)
    others = {
      "precision": numbers.get(f"baseline/{s.reference_precision}/{m}"),
      "machine": numbers.get(elsewhere.name)
      if s.machine_flags is not None
      else None,
    }
    references = {}  # label -> the reference's comparison
    for kind, other in others.items():
      if not (base and other):
        continue
      # BF16 minus FP32 training; the other machine minus this one.
      first, second = (base, other) if kind == "precision" else (other, base)
      out[kind][m] = _comparison(first, second, {})
      references[_reference_label(s, kind)] = out[kind][m]
    for v in variants:
      arm = numbers.get(f"{v}/{precision}/{m}")
      if arm and base:
        out["variants"][f"{v} ({m})"] = _comparison(arm, base, references)
  for m in mitigations:
    if m == "none":
      continue
    for v in ["baseline", *variants]:
      with_m = numbers.get(f"{v}/{precision}/{m}")
      without = numbers.get(f"{v}/{precision}/none")
      if with_m and without:
        out["mitigations"][f"{m}: {v}"] = _comparison(with_m, without, {})
  out["wortsman"] = _wortsman(s, numbers, precision)
  return out


def _reference_label(s: Settings, kind: str) -> str:
  """How a reference difference is named in verdicts."""
  if kind == "precision":
    return f"{s.arms[0].precision.upper()}-vs-{s.reference_precision.upper()}"
  return f"other-machine ({s.machine})"


def _mitigation_order(m):
  return (m != "none", m)


def _comparison(a: dict, b: dict, references: dict) -> dict:
  """a against b, paired by replicate: LR sensitivity and largest stable
  LR (log2), verdicts, what the interval could tell apart, and, per
  reference {label: its comparison}, the ratio of root-mean-square
  differences."""
  own = analysis.paired_values(a, b, "lr_sensitivity")
  d_s = analysis.paired_difference(a, b, "lr_sensitivity")
  d_l = analysis.paired_difference(a, b, "largest_stable_lr", log2=True)
  by_label = {
    label: _interval_of(c["lr_sensitivity_difference"])
    for label, c in references.items()
  }
  lr_refs = {
    label: _interval_of(c["largest_stable_lr_log2_difference"])
    for label, c in references.items()
  }
  return {
    "lr_sensitivity_per_replicate": own,
    "lr_sensitivity_difference": _interval_dict(d_s),
    "lr_sensitivity": analysis.change_verdict(d_s, by_label),
    "lr_sensitivity_resolution": resolution(d_s),
    "largest_stable_lr_log2_difference": _interval_dict(d_l),
    "largest_stable_lr": analysis.change_verdict(d_l, lr_refs),
    "spread_ratio": {
      label: _interval_dict(
        analysis.spread_ratio(own, c["lr_sensitivity_per_replicate"])
      )
      for label, c in references.items()
    },
  }


def _interval_of(d):
  return None if d is None else Interval(**d)


def _wortsman(s, numbers, precision) -> dict:
  """Without qk-norm the largest attention logit grows with the learning
  rate and the top of the grid diverges; qk-norm lowers the sensitivity."""
  out = {}
  for v in dict.fromkeys(a.variant for a in s.arms):
    arm = numbers.get(f"{v}/{precision}/none")
    if not arm:
      continue
    grid = sorted(arm["max_logit"])
    means = [
      _mean([x for x in arm["max_logit"][lr] if x is not None]) for lr in grid
    ]
    growth = analysis.slope(grid, means)
    qk = numbers.get(f"{v}/{precision}/qk_norm")
    qk_diff = (
      analysis.paired_difference(qk, arm, "lr_sensitivity") if qk else None
    )
    bound = _logit_bound(arm, qk, grid)
    out[v] = {
      "max_logit_slope": growth,
      "logit_grows": growth is not None and growth > 0,
      "top_diverges": any(arm["diverged_at_top"]),
      "top_unstable": any(
        lr is None or lr < max(grid) for lr in arm["largest_stable_lr"]
      ),
      "qk_norm_sensitivity_difference": _interval_dict(qk_diff),
      "qk_norm": analysis.change_verdict(qk_diff),
      **bound,
    }
  return out


def _logit_bound(arm, qk, grid) -> dict:
  """The largest attention logit without and with qk-norm at the largest
  learning rate both trained through (means over replicates)."""
  if not qk:
    return {}
  for lr in sorted(grid, reverse=True):
    without = [x for x in arm["max_logit"][lr] if x is not None]
    with_qk = [x for x in qk["max_logit"][lr] if x is not None]
    diverged = arm["diverged"][lr] + qk["diverged"][lr]
    if without and with_qk and not any(diverged):
      return {
        "logit_bound_lr": lr,
        "max_logit_without_qk_norm": _mean(without),
        "max_logit_with_qk_norm": _mean(with_qk),
      }
  return {}


def _mean(values):
  return sum(values) / len(values) if values else None


def headline(s: Settings, numbers: dict, judged: dict) -> dict:
  arms = {}
  for name, n in numbers.items():
    sens = analysis.interval(n["lr_sensitivity"])
    stable = analysis.interval(n["largest_stable_lr"], log2=True)
    arms[name] = {
      "lr_sensitivity": _interval_dict(sens),
      "largest_stable_lr": _interval_dict(stable),
      "largest_stable_lr_per_replicate": n["largest_stable_lr"],
      "diverged_at_top_lr": n["diverged_at_top"],
    }
  return {
    "arms": arms,
    "verdicts": judged,
    "learning_rates": list(s.learning_rates),
    "replicates": s.replicates,
    "machine_pair": {"xla_flags": s.machine_flags, "label": s.machine},
    "environment": environment.describe(corpus=corpus_sha256(s)),
  }


def write_report(run_dir, s: Settings, rows) -> dict:
  numbers = numbers_of(s, rows)
  judged = verdicts(s, numbers)
  result = headline(s, numbers, judged)
  run_dir.write_text("headline.json", json.dumps(result, indent=2) + "\n")
  figures = _figures(s, numbers, run_dir.path)
  text = _markdown(s, numbers, judged, figures, result["environment"])
  monitor = monitor_cells.verdict_lines(s, rows, run_dir.path, result)
  run_dir.write_text("report.md", "\n".join([text, *monitor]) + "\n")
  return result


def _answer_lines(s: Settings, judged) -> list[str]:
  lines = []
  for name, c in judged["variants"].items():
    lines.append(
      f"- **{name} against Baseline**: LR sensitivity "
      f"{_diff_text(c['lr_sensitivity_difference'])}: {c['lr_sensitivity']}"
      f"{_resolution_text(c)}; largest stable LR (log2) "
      f"{_diff_text(c['largest_stable_lr_log2_difference'])}: "
      f"{c['largest_stable_lr']}.{_ratio_text(c['spread_ratio'])}"
    )
  for m, c in judged["precision"].items():
    lines.append(
      f"- **{_reference_label(s, 'precision')} training, Baseline ({m})**: "
      f"LR sensitivity {_diff_text(c['lr_sensitivity_difference'])}: "
      f"{c['lr_sensitivity']}{_resolution_text(c)}."
    )
  for m, c in judged["machine"].items():
    lines.append(
      f"- **Baseline on the other machine ({s.machine}) against this one "
      f"({m})**: LR sensitivity "
      f"{_diff_text(c['lr_sensitivity_difference'])}: {c['lr_sensitivity']}"
      f"{_resolution_text(c)}; largest stable LR (log2) "
      f"{_diff_text(c['largest_stable_lr_log2_difference'])}: "
      f"{c['largest_stable_lr']}."
    )
  if s.machine_flags is None:
    lines.append(f"- No other-machine reference: {s.machine}.")
  for name, c in judged["mitigations"].items():
    lines.append(
      f"- **{name}** against no mitigation: LR sensitivity "
      f"{_diff_text(c['lr_sensitivity_difference'])}: {c['lr_sensitivity']}."
    )
  for v, w in judged["wortsman"].items():
    slope = (
      "-" if w["max_logit_slope"] is None else f"{w['max_logit_slope']:.2f}"
    )
    grows = "grows" if w["logit_grows"] else "does not grow"
    lines.append(
      f"- **Wortsman et al., {v}**: largest attention logit against LR, "
      f"log-log slope {slope} ({grows}); "
      f"top LR diverges: {'yes' if w['top_diverges'] else 'no'}; "
      f"qk-norm's effect on LR sensitivity: {w['qk_norm']}"
      + _bound_text(w)
      + "."
    )
  return lines


def _bound_text(w) -> str:
  if "logit_bound_lr" not in w:
    return ""
  return (
    f"; at LR {num(w['logit_bound_lr'])} the largest logit is "
    f"{num(w['max_logit_without_qk_norm'])} without qk-norm, "
    f"{num(w['max_logit_with_qk_norm'])} with it"
  )


def _diff_text(d) -> str:
  if d is None:
    return "-"
  if d["low"] is None:
    return f"{num(d['mean'])} (n={d['count']})"
  return f"{num(d['mean'])} [{num(d['low'])}, {num(d['high'])}]"


def _resolution_text(c: dict) -> str:
  resolution = c["lr_sensitivity_resolution"]
  return f" ({resolution})" if resolution else ""


def _ratio_text(ratios: dict) -> str:
  """' Root-mean-square difference against each reference's: ...'."""
  parts = [
    f"{num(r['mean'])}x the {label} difference [{num(r['low'])}, "
    f"{num(r['high'])}]"
    for label, r in ratios.items()
    if r is not None
  ]
  if not parts:
    return ""
  return (
    " Its root-mean-square difference per replicate is "
    + "; ".join(parts)
    + " (F interval)."
  )


def corpus_sha256(s: Settings) -> str:
  return environment.corpus_digest(*load_tokens(s))


def _markdown(s, numbers, judged, figures, env) -> str:
  rows = []
  for name, n in numbers.items():
    sens = analysis.interval(n["lr_sensitivity"])
    stable = analysis.interval(n["largest_stable_lr"], log2=True)
    rows.append(
      [
        name,
        sens.text(),
        "none" if stable is None else stable.text(),
        f"{sum(n['diverged_at_top'])}/{len(n['diverged_at_top'])}",
      ]
    )
  lines = [
    "# Training stability: learning-rate sensitivity, Flash against Baseline",
    "",
    environment.summary_line(env),
    "",
    f"*What ran:* arms {[a.name for a in s.arms]} (variant/format/"
    f"mitigation); learning rates {list(s.learning_rates)}; {s.replicates} "
    f"replicate(s); {s.steps} steps, warmup {s.warmup_steps}, batch "
    f"{s.batch_size}, sequence {s.seq_len}; model width {s.model.width}, "
    f"depth {s.model.depth}, {s.model.heads} heads. A run diverges when "
    f"its training loss is not finite or exceeds {num(s.divergence_loss)}; "
    f"final losses are clipped at ln 256 = {num(s.clip_loss)}. "
    + (
      f"Arms marked @{s.machine} ran in a child process with XLA_FLAGS="
      f"`{s.machine_flags}`: the same program compiled for another machine."
      if s.machine_flags is not None
      else f"No other-machine arms: {s.machine}."
    ),
    "",
    "## The answer",
    "",
    "Differences are paired by replicate (same initialization and data "
    "order), mean [95% interval]; 'told apart' means the interval excludes "
    "0.",
    "",
    *_answer_lines(s, judged),
    "",
    *[f"![{f}]({f})" for f in figures],
    "",
    "## Per arm",
    "",
    table(
      ["arm", "LR sensitivity", "largest stable LR", "diverged at the top LR"],
      rows,
    ),
    "",
    *_probe_lines(numbers),
  ]
  return "\n".join(lines)


def _probe_lines(numbers) -> list[str]:
  """Per arm and learning rate, the median over replicates of each probe
  ("-" where no logged step recorded it, as in a run that diverged before
  its first log)."""
  rows = []
  for name, n in numbers.items():
    for lr in n["final_loss"]:
      cells = []
      for probe in analysis.PROBES:
        values = [v for v in n["probes"][probe][lr] if v is not None]
        cells.append(num(float(np.median(values))) if values else "-")
      rows.append([name, num(lr), *cells])
  return [
    "## Probes",
    "",
    "Largest attention logit and output log-partition (max over logged "
    "steps; Wortsman et al.), share of rows whose largest logit is tied, "
    "largest share (over layers and logged steps) of rows whose two "
    "largest logits lie within one ulp of the training format (where a "
    "flash backward's delta and dS cancel; docs/audit.md), "
    "largest spectral norm of a head's W_Q (max over logged steps), and "
    "the signed share of the error of delta = rowsum(dO * O) against FP32 "
    "attention's O at the last logged step (+1: every error points away "
    "from zero, Qiu & Yao's bias; mean over layers). Median over "
    "replicates.",
    "",
    table(
      [
        "arm",
        "LR",
        "max logit",
        "max log Z",
        "tied-max share",
        "near-tied share",
        "W_Q spectral norm",
        "delta signed share",
      ],
      rows,
    ),
    "",
  ]


def _figures(s, numbers, out_dir) -> list[str]:
  grid = list(s.learning_rates)
  loss_panels, logit_panels = {}, {}
  for name, n in numbers.items():
    variant, precision, mitigation = name.split("/")
    label = f"{variant}/{precision}"
    loss_panels.setdefault(mitigation, []).append(
      Series(label, grid, [_mean(n["final_loss"][lr]) for lr in grid])
    )
    logit_panels.setdefault(mitigation, []).append(
      Series(
        label,
        grid,
        [
          _mean([x for x in n["max_logit"][lr] if x is not None]) for lr in grid
        ],
      )
    )
  line_panels(
    out_dir / "stability_loss.png",
    loss_panels,
    title="Final loss against learning rate (Wortsman et al., Fig. 1)",
    xlabel="peak learning rate",
    ylabel="final loss (clipped)",
  )
  line_panels(
    out_dir / "stability_logits.png",
    logit_panels,
    title="Largest attention logit during training (before divergence)",
    xlabel="peak learning rate",
    ylabel="max logit",
    logy=True,
    sharey=True,
  )
  return ["stability_loss.png", "stability_logits.png"]
