"""The audit launcher's report: headline.json, report.md (the verdict
first, the errors and failures, the tables), summary.csv, a figure, and
the few lines a person at a terminal reads."""

from __future__ import annotations

import functools
import json

import numpy as np

from stableattn.auditing import captured_report, invariance
from stableattn.auditing.kernel_audit import (
  INVARIANCE_GATE,
  error_lines,
  failures,
)
from stableattn.harness import environment
from stableattn.harness.plotting import bar_plot
from stableattn.harness.reporting import num, table
from stableattn.harness.rundir import RunDir
from stableattn.numerics.rules import RULES


def headline(s, rows, probes=(), errors=()) -> dict:
  """What headline.json holds: the verdict and why; `s` is the audit's
  `grid.Settings`."""
  # Failures list what the gate, determinism and the NaN scan failed, so
  # the kernel passed exactly when there are none and nothing raised.
  found = failures(rows, [g for g in s.gate if g in RULES])
  if INVARIANCE_GATE in s.gate:
    found += [
      f"{p['policy']}: {text}"
      for p in probes
      for text in invariance.failures([p])
    ]
  raised = list(errors)
  if INVARIANCE_GATE in s.gate:  # an ungated probe's error is a note
    raised += [p for p in probes if p.get("error")]
  return {
    "kernel": s.kernel,
    "passed": not found and not raised,
    "verdict": verdict(bool(found), bool(raised)),
    "gate": list(s.gate),
    "layout": s.layout,
    "rules": {rule: all(r[f"{rule}_passed"] for r in rows) for rule in RULES},
    "worst_ratio": worst_ratios(rows, [g for g in s.gate if g in RULES]),
    "deterministic": all(r["deterministic"] for r in rows),
    "finite": all(r["nonfinite"] == 0 for r in rows),
    "failures": found,
    "errors": [
      {
        k: e.get(k, "")
        for k in (
          "policy",
          "shape",
          "features",
          "regime",
          "detail",
          "error",
          "command",
        )
      }
      for e in errors
    ],  # fmt: skip
    "gradients": gradient_notes(s, rows),
    "invariant": invariance.verdicts(probes) if s.invariances else {},
    "environment": environment.describe(),
  }


def verdict(failed: bool, raised: bool) -> str:
  words = [w for w, on in (("FAILED", failed), ("ERRORS", raised)) if on]
  return ", ".join(words) or "PASSED"


def worst_ratios(rows, rules) -> dict:
  """{rule: {tensor: the largest value / limit}} over the rows each gated
  rule applies to: under 1 passes, and how far under is the margin."""
  out: dict = {}
  for rule in rules:
    for r in rows:
      if not r[f"{rule}_applies"]:
        continue
      value, limit = r[f"{rule}_value"], r[f"{rule}_limit"]
      if limit > 0 or np.isnan(value):
        ratio = value / limit if limit > 0 else value
      else:  # a limit of 0 (the baseline exact) is met by exactness alone
        ratio = np.inf if value > 0 else 0.0
      per_tensor = out.setdefault(rule, {})
      seen = per_tensor.get(r["tensor"], 0.0)
      # NaN (a NaN in the kernel's tensor) stays: it is the worst.
      per_tensor[r["tensor"]] = (
        seen + ratio if np.isnan(ratio + seen) else max(seen, ratio)
      )
  return out


def gradient_notes(s, rows) -> list[str]:
  """Why gradients were not audited: the registry's reason, or the cases
  where the kernel has no VJP (judged on its output alone)."""
  notes = [] if s.forward_only is None else [s.forward_only]
  notes += [r["gradients"] for r in rows if r.get("gradients")]
  return list(dict.fromkeys(notes))


def write_report(
  run_dir: RunDir, s, rows, probes=(), notes=(), errors=(), captured=()
) -> dict:
  """report.md, headline.json, summary.csv (and errors.csv); `captured`:
  each captured layer's place (`captured_report.layer_statistics`), for
  the section on the model's own tensors."""
  if not rows and not errors:
    raise ValueError("the audit measured nothing: no verdict from 0 rows.")
  result = headline(s, rows, probes, errors)
  result["regimes_not_applicable"] = list(notes)
  if captured:
    result["captured"] = [
      {k: v for k, v in c.items() if k != "per_head"} for c in captured
    ]
  run_dir.write_text(
    "headline.json", json.dumps(result, indent=2, default=str) + "\n"
  )
  run_dir.write_csv("summary.csv", rows)
  if errors:
    run_dir.write_csv("errors.csv", list(errors))
  parts = [
    f"# Audit of `{s.kernel}`: **{result['verdict']}**",
    "",
    environment.summary_line(result["environment"]),
    "",
    f"Gate: {', '.join(s.gate)} rules, bitwise determinism over "
    f"{s.repeats} runs, no NaN/Inf, no case raising. Policies "
    f"{list(s.precisions)}; {len(s.shapes)} shape(s), inputs "
    f"{list(s.distributions)}, {s.seeds} seed(s), features "
    f"{[f.label for f in s.features]}.",
    "",
    *_layout_lines(s.layout),
    *([verdict_table(rows), ""] if rows else []),
    *[f"Gradients not audited: {n}." for n in result["gradients"]],
    *([""] if result["gradients"] else []),
    *_failure_lines(result["failures"]),
    *errors_section(errors),
  ]
  if rows:
    figure = _error_figure(run_dir, rows)
    parts += [
      "## Errors against FP64 (worst over cases)",
      "",
      error_table(rows),
      "",
      f"![errors]({figure})",
    ]
  parts += [
    *captured_report.section(rows, list(captured), s.gate),
    *edge_checks_section(rows),
    *regime_notes_section(notes),
    *invariance_section(probes),
  ]
  run_dir.write_text("report.md", "\n".join(parts) + "\n")
  return {"workdir": str(run_dir.path), **result}


def _layout_lines(layout: str) -> list[str]:
  if layout == "bshd":
    return []
  return [
    f"The kernel takes layout `{layout}`: the audit transposed q, k and v "
    "into it and the output back; every shape here is [batch, length, "
    "heads, head_dim].",
    "",
  ]


def errors_section(errors, most: int = 20) -> list[str]:
  """The cases the kernel raised on, each with a reproducing command (the
  first `most`; errors.csv holds them all)."""
  if not errors:
    return []
  lines = [
    "## Errors: cases the kernel raised on",
    "",
    f"{len(errors)} case(s) raised (errors.csv); every other case was judged.",
    "",
  ]
  for text, e in zip(error_lines(errors[:most]), errors):
    lines.append(f"- {text}")
    if e.get("command"):
      lines.append(f"  `{e['command']}`")
  if len(errors) > most:
    lines.append(f"- ... and {len(errors) - most} more (errors.csv)")
  return lines + [""]


def summary_text(result: dict, most: int = 5) -> str:
  """The audit's end at a terminal: kernel and verdict, the worst ratio
  to each gated rule's limit per tensor, the first failures and errors,
  and where the report is (a search: what it found)."""
  if "verdict" not in result:  # the search's headline
    found = result.get("reproducer", f"nothing in {result['cases']} cases")
    return (
      f"{result['kernel']}: {'FAILED' if result['found'] else 'PASSED'}\n"
      f"  smallest failure: {found}\n  report: {result['workdir']}/report.md"
    )
  lines = [f"{result['kernel']}: {result['verdict']}"]
  judged = result.get("baseline")
  if isinstance(judged, str):
    lines.append(f"  baseline: {judged}")
  elif judged:
    counts = ", ".join(f"{len(judged[k])} {k}" for k in judged)
    lines.append(f"  against the baseline: {counts}")
    lines += [f"  - {k}: {key}" for k in ("new", "worse") for key in judged[k]][
      :most
    ]
  for rule, per_tensor in result.get("worst_ratio", {}).items():
    cells = ", ".join(f"{t} {v:.3g}" for t, v in per_tensor.items())
    lines.append(f"  worst {rule} value/limit: {cells}")
  for note in result.get("gradients", []):
    lines.append(f"  gradients not audited: {note}")
  problems = list(result.get("failures", []))
  problems += [
    f"raised {e['error']} ({e['shape']}, {e['policy']}, features "
    f"{e['features']})"
    for e in result.get("errors", [])
  ]
  for text in problems[:most]:
    lines.append(f"  - {text}")
  if len(problems) > most:
    lines.append(f"  - ... and {len(problems) - most} more")
  lines.append(f"  report: {result['workdir']}/report.md")
  return "\n".join(lines)


def verdict_table(rows) -> str:
  """Rule x tensor, per policy and features: passed cases / cases."""
  header = ["policy", "features", "tensor", *RULES, "deterministic", "finite"]
  body = []
  for key, group in _groups(rows).items():
    cells = [_rule_cell(group, rule) for rule in RULES]
    cells.append(_count(group, lambda r: r["deterministic"]))
    cells.append(_count(group, lambda r: r["nonfinite"] == 0))
    body.append([*key, *cells])
  return table(header, body)


def _groups(rows) -> dict:
  """Rows by (policy, features, tensor), in the order they first occur;
  an edge regime's rows apart, under "regime: features"."""
  out: dict = {}
  for r in rows:
    out.setdefault((r["policy"], _features(r), r["tensor"]), []).append(r)
  return out


def _features(r) -> str:
  regime = r.get("regime", "none")
  return r["features"] if regime == "none" else f"{regime}: {r['features']}"


def edge_checks_section(rows) -> list[str]:
  """What the edge cases check beyond the rules: whether a run with NaN
  or Inf in keys no query attends is the clean run bit for bit, and how
  far fully masked rows (a finite mask) are from 0 and from V's mean."""
  poisoned, masked = {}, []
  for r in rows:
    if "poison_bitwise" in r:
      key = (r["policy"], r["shape"], r["detail"])
      bitwise, moved = poisoned.get(key, (True, 0.0))
      poisoned[key] = (
        bitwise and r["poison_bitwise"],
        max(moved, r["poison_max_diff"], key=_nan_first),
      )
    if "masked_rows_vs_zero" in r:
      masked.append([
        r["policy"], r["shape"], r["detail"],
        f"{r['masked_rows_vs_zero']:.3g}", f"{r['masked_rows_vs_mean_v']:.3g}",
      ])  # fmt: skip
  lines = []
  if poisoned:
    body = [
      [*key, "yes" if bitwise else "**no**", f"{moved:.3g}"]
      for key, (bitwise, moved) in poisoned.items()
    ]
    lines += ["", "## Poisoned padding: the clean run's values?", "",
              table(["policy", "shape", "case", "bitwise",
                     "largest change"], body)]  # fmt: skip
  if masked:
    lines += ["", "## Fully masked rows under a finite mask (reported)", "",
              table(["policy", "shape", "case", "largest |out|",
                     "largest |out - mean V|"], masked)]  # fmt: skip
  return lines


def _nan_first(x: float) -> float:
  """Orders a NaN change above every number."""
  return float("inf") if x != x else x


def regime_notes_section(notes) -> list[str]:
  """The edge cases that did not apply, each with its reason."""
  if not notes:
    return []
  body = [[n["policy"], n["regime"], n["detail"], n["reason"]] for n in notes]
  return [
    "",
    "## Edge cases not run (n/a)",
    "",
    table(["policy", "regime", "case", "why"], body),
  ]


def _rule_cell(group, rule: str) -> str:
  if not any(r[f"{rule}_applies"] for r in group):
    return "n/a"
  return _count(group, lambda r: r[f"{rule}_passed"])


def _count(group, ok) -> str:
  good = sum(1 for r in group if ok(r))
  mark = "pass" if good == len(group) else "FAIL"
  return f"{mark} {good}/{len(group)}"


def _failure_lines(found: list[str], most: int = 20) -> list[str]:
  if not found:
    return ["Nothing failed.", ""]
  lines = ["## What failed", ""]
  lines += [f"- {text}" for text in found[:most]]
  if len(found) > most:
    lines.append(f"- ... and {len(found) - most} more (metrics.jsonl)")
  return lines + [""]


def error_table(rows) -> str:
  """Worst error, cosine and SNR per policy, features and tensor."""
  header = ["policy", "features", "tensor", "max |x - golden|"]
  header += ["baseline's", "min cosine", "min SNR dB", "signed share"]
  body = []
  for key, group in _groups(rows).items():
    body.append(
      [
        *key,
        num(max(r["max_abs"] for r in group)),
        num(max(r["baseline_max_abs"] for r in group)),
        num(min(r["cosine"] for r in group)),
        num(min(r["snr_db"] for r in group)),
        num(float(np.mean([r["signed_share"] for r in group]))),
      ]
    )
  return table(header, body)


def _error_figure(run_dir: RunDir, rows) -> str:
  labels = list(dict.fromkeys(f"{r['policy']} {r['tensor']}" for r in rows))
  worst = functools.partial(_worst, rows)
  return bar_plot(
    run_dir.path / "errors.png",
    labels,
    {
      "kernel": [worst(label, "max_abs") for label in labels],
      "same-policy baseline": [
        worst(label, "baseline_max_abs") for label in labels
      ],
    },
    title="Worst max |x - FP64 golden| per policy and tensor",
    ylabel="max abs error",
  ).name


def _worst(rows, label: str, key: str) -> float:
  values = [r[key] for r in rows if f"{r['policy']} {r['tensor']}" == label]
  finite = [v for v in values if np.isfinite(v)]
  return max(finite) if finite else float("nan")


def invariance_section(probes) -> list[str]:
  """The invariance probes: bitwise, or the difference in ulps of the
  output format beside the kernel's error against FP64 in the same unit."""
  if not probes:
    return []
  body = []
  for p in probes:
    if p["invariant"] is None:
      said, diff, error = f"n/a: {p['reason']}", "", ""
    else:
      said = "bitwise" if p["invariant"] else "**differs**"
      diff, error = num(p["diff_ulps"]), num(p["error_ulps"])
    flips = p.get("argmax_flips", float("nan"))
    body.append(
      [p["policy"], p["invariance"], p["detail"], said, diff, error,
       "" if not np.isfinite(flips) else f"{100 * flips:.3g}%"]
    )  # fmt: skip
  header = ["policy", "invariance", "probe", "rows", "diff (ulps)"]
  header += ["error vs FP64 (ulps)", "argmax flips"]
  return [
    "",
    "## Invariance: the same rows computed the ways inference does",
    "",
    "Ulps of the output format at the rows' largest FP64 value. "
    + "; ".join(f"`{k}`: {v}" for k, v in invariance.DESCRIPTIONS.items())
    + ".",
    "",
    table(header, body),
  ]
