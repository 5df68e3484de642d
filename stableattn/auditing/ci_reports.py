"""The audit's verdict in the forms CI systems read, and known findings as
a baseline.

* JUnit XML: one testcase per audited row and gated rule (kernel x format
  x shape x features x regime x tensor x rule), the ratio and limit as
  properties; a raised case is an error, a case the kernel cannot take is
  skipped.
* A GitHub step summary (markdown appended to `$GITHUB_STEP_SUMMARY`) and
  `::error` annotations for what failed.
* A baseline: the current failures under stable keys (kernel, format,
  regime, features, rule, tensor) with their worst ratio. Judged against
  one, an audit passes when only recorded findings fail, and names new
  failures, findings that got worse beyond a margin, and fixed ones (the
  pattern of pytest-benchmark's `--benchmark-compare-fail` and snapshot
  tests).
"""

from __future__ import annotations

import json
import pathlib
import xml.etree.ElementTree as ET

from stableattn.auditing.measure import rule_ratio

KEY_FIELDS = ("kernel", "policy", "regime", "features", "rule", "tensor")
BASELINE_FORMAT = 1
WORSE_MARGIN = 1.25  # a recorded ratio may grow this much before it fails


def _checks(row, gate):
  """(rule, failed, ratio or None) of one row: each gated rule that
  applies, then the NaN scan and determinism."""
  for rule in gate:
    if row.get(f"{rule}_applies"):
      yield rule, not row[f"{rule}_passed"], rule_ratio(row, rule)
  yield "finite", row["nonfinite"] > 0, None
  yield "deterministic", not row["deterministic"], None


def key(row, rule: str) -> str:
  fields = {**row, "rule": rule, "regime": row.get("regime", "none")}
  return " | ".join(str(fields.get(f, "")) for f in KEY_FIELDS)


def probe_key(probe: dict) -> str:
  """An invariance probe's key: its invariance is the rule, its detail
  (how the row was computed) the features."""
  fields = {**probe, "regime": "invariance", "tensor": "out"}
  return key(
    {**fields, "features": probe.get("detail", "")}, probe["invariance"]
  )


def probe_failed(probe: dict) -> bool:
  return probe["invariant"] is False or bool(probe.get("error"))


def failing(rows, gate, errors=(), probes=()) -> dict[str, float | None]:
  """{key: the worst ratio (None for the NaN scan, determinism, errors
  and invariance probes)} of everything that failed; `probes` count
  when "invariance" is in `gate`."""
  found: dict[str, float | None] = {}
  if "invariance" in gate:
    found.update({probe_key(p): None for p in probes if probe_failed(p)})
  for row in rows:
    for rule, failed, ratio in _checks(row, gate):
      if failed:
        k = key(row, rule)
        seen = found.get(k)
        found[k] = ratio if seen is None else max(seen, ratio or 0.0)
  for e in errors:
    found[key({"kernel": e.get("kernel", ""), **e, "tensor": "-"}, "error")] = (
      None
    )
  return found


def junit_xml(suite: str, rows, gate, errors=(), notes=(), probes=()) -> str:
  """One testcase per row and check, per error (an error case), per n/a
  note (a skipped case) and, when "invariance" is gated, per probe."""
  cases = ET.Element("testsuite", name=suite)
  counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
  for probe in probes if "invariance" in gate else ():
    case = ET.SubElement(
      cases,
      "testcase",
      classname=f"{probe.get('kernel', suite)}.{probe['policy']}.invariance",
      name=f"{probe['invariance']} {probe.get('detail', '')}".strip(),
    )
    counts["tests"] += 1
    if probe_failed(probe):
      counts["failures"] += 1
      text = (
        probe.get("error") or f"rows differ by {probe['diff_ulps']:.3g} ulps"
      )
      ET.SubElement(case, "failure", message=str(text))
  for row in rows:
    for rule, failed, ratio in _checks(row, gate):
      where = (
        row.get("kernel", suite),
        row["policy"],
        row.get("regime", "none"),
      )
      what = (
        row["shape"],
        row["features"],
        row.get("detail", ""),
        row["tensor"],
      )
      case = ET.SubElement(
        cases,
        "testcase",
        classname=".".join(where),
        name=" ".join(x for x in (*what, rule) if x),
      )
      counts["tests"] += 1
      if ratio is not None:
        props = ET.SubElement(case, "properties")
        ET.SubElement(props, "property", name="ratio", value=f"{ratio:.6g}")
        ET.SubElement(
          props, "property", name="limit", value=f"{row[f'{rule}_limit']:.6g}"
        )
      if failed:
        counts["failures"] += 1
        text = f"{rule} fails" + (f": {ratio:.3g}x its limit" if ratio else "")
        ET.SubElement(case, "failure", message=text)
  extra = [
    ("errors", "error", e.get("policy", ""),
     f"{e.get('shape', '')} {e.get('features', '')} raised", e.get("error", ""))
    for e in errors
  ] + [
    ("skipped", "skipped", n.get("policy", ""),
     f"{n.get('regime', '')} {n.get('detail', '')} n/a", n.get("reason", ""))
    for n in notes
  ]  # fmt: skip
  for count, tag, policy, name, message in extra:
    counts["tests"] += 1
    counts[count] += 1
    case = ET.SubElement(
      cases, "testcase", classname=f"{suite}.{policy}", name=name
    )
    ET.SubElement(case, tag, message=str(message))
  for name, count in counts.items():
    cases.set(name, str(count))
  return ET.tostring(cases, encoding="unicode")


def write_baseline(path, found: dict) -> None:
  data = {"format": BASELINE_FORMAT, "failures": found}
  pathlib.Path(path).write_text(
    json.dumps(data, indent=2, sort_keys=True) + "\n"
  )


def load_baseline(path) -> dict:
  path = pathlib.Path(path)
  if not path.exists():
    raise ValueError(
      f"no baseline at {path}: record one with --config.update_baseline=True."
    )
  data = json.loads(path.read_text())
  if data.get("format") != BASELINE_FORMAT:
    raise ValueError(f"{path} is not a baseline of format {BASELINE_FORMAT}.")
  return data["failures"]


def of_kernel(found: dict, kernel: str) -> dict:
  """The entries of `found` (failing keys or a baseline) of one kernel."""
  return {k: v for k, v in found.items() if k.split(" | ")[0] == kernel}


def merge_baseline(path, found: dict, kernel: str) -> None:
  """Records `kernel`'s failures in the baseline at `path`, keeping the
  other kernels' entries (one file serves a suite of kernels)."""
  path = pathlib.Path(path)
  kept = load_baseline(path) if path.exists() else {}
  kept = {k: v for k, v in kept.items() if k not in of_kernel(kept, kernel)}
  write_baseline(path, {**kept, **of_kernel(found, kernel)})


def judge(found: dict, baseline: dict, margin: float = WORSE_MARGIN) -> dict:
  """{new, worse, fixed, known}: keys failing now and not recorded, those
  recorded whose ratio grew beyond `margin`, recorded ones that pass now,
  and recorded ones within their margin."""
  new = sorted(k for k in found if k not in baseline)
  worse = sorted(
    k
    for k in found
    if k in baseline
    and found[k] is not None
    and baseline[k] is not None
    and found[k] > margin * baseline[k]
  )
  fixed = sorted(k for k in baseline if k not in found)
  known = sorted(k for k in found if k in baseline and k not in worse)
  return {"new": new, "worse": worse, "fixed": fixed, "known": known}


def summary_markdown(
  kernel: str, passed: bool, judged: dict | None, found: dict
) -> str:
  lines = [
    f"### stableattn audit: `{kernel}` {'passed' if passed else 'FAILED'}",
    "",
  ]
  if judged is not None:
    lines.append(
      f"Against the baseline: {len(judged['new'])} new, {len(judged['worse'])} "
      f"worse, {len(judged['fixed'])} fixed, {len(judged['known'])} known."
    )
    lines.append("")
    shown = [("new", k) for k in judged["new"]] + [
      ("worse", k) for k in judged["worse"]
    ]
  else:
    shown = [("failing", k) for k in found]
  if shown:
    columns = " \\| ".join(KEY_FIELDS)
    lines += [f"| status | {columns} | ratio |", "|---|---|---|"]
    for status, k in shown[:50]:
      ratio = found.get(k)
      shown_ratio = "-" if ratio is None else f"{ratio:.3g}"
      escaped = k.replace("|", "\\|")
      lines.append(f"| {status} | {escaped} | {shown_ratio} |")
  return "\n".join(lines) + "\n"


def annotations(judged: dict | None, found: dict) -> list[str]:
  """`::error` lines GitHub Actions turns into annotations."""
  keys = found if judged is None else judged["new"] + judged["worse"]
  return [f"::error title=stableattn audit::{k}" for k in keys]


def ratios(rows, gate, with_kernel: bool = True) -> dict[str, float]:
  """{key: the worst ratio to its limit} of every gated rule over `rows`,
  passing or not (an audit's whole state, for `compare`); without the
  kernel's name in the key, two versions of a kernel compare."""
  out: dict[str, float] = {}
  for row in rows:
    for rule, _, ratio in _checks(row, gate):
      if ratio is not None:
        k = key(row if with_kernel else {**row, "kernel": "*"}, rule)
        out[k] = max(out.get(k, 0.0), ratio)
  return out


def compare(old: dict, new: dict, growth: float = WORSE_MARGIN) -> dict:
  """Two audits' `ratios` (another kernel version, commit or jax
  version): {regressions, growth, improvements, only_old, only_new}, the
  first three lists of (key, old ratio, new ratio). A regression crosses
  its limit (ratio above 1 where it was not) or grows more than `growth`
  times past it; growth is any ratio that grew more than `growth` times,
  under its limit too; an improvement is a regression's reverse."""

  def crossed(a, b):
    return a <= 1 < b

  both = sorted(set(old) & set(new))
  return {
    "regressions": [
      (k, old[k], new[k])
      for k in both
      if crossed(old[k], new[k]) or (new[k] > 1 and new[k] > growth * old[k])
    ],
    "growth": [(k, old[k], new[k]) for k in both if new[k] > growth * old[k]],
    "improvements": [
      (k, old[k], new[k])
      for k in both
      if crossed(new[k], old[k]) or (old[k] > 1 and old[k] > growth * new[k])
    ],
    "only_old": sorted(set(old) - set(new)),
    "only_new": sorted(set(new) - set(old)),
  }
