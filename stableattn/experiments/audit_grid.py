"""The audit experiment: is a user's attention kernel accurate?

  python launch/audit.py --workdir=W --config.kernel=package.module:function

Runs `stableattn.auditing.kernel_audit` over shapes x input distributions
x seeds x policies x masking, and writes report.md (the verdict first),
headline.json (`kernel`, `passed`, `rules`, `deterministic`, `finite`,
`failures`), metrics.jsonl, summary.csv and a figure. The launcher exits
non-zero when the kernel fails, so the command can gate a kernel author's
CI.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np

from stableattn.auditing import invariance, regimes
from stableattn.auditing.feature_recipes import RECIPE_NAMES, FeatureRecipe
from stableattn.auditing.inputs import shape_from_spec
from stableattn.auditing.kernel_audit import (
  INVARIANCE_GATE,
  TENSORS,
  cases,
  check_accepts,
  check_gate,
  failures,
  measure_case,
)
from stableattn.contract.options import Options
from stableattn.experiments import audit_search, environment
from stableattn.experiments.config_values import as_tuple, field
from stableattn.experiments.plotting import bar_plot
from stableattn.experiments.reporting import num, table
from stableattn.experiments.rundir import RunDir, opened
from stableattn.numerics.formats import format_name
from stableattn.numerics.precision import Precision, natural_policy
from stableattn.numerics.rules import RULES
from stableattn.ops.registry import (
  IMPLEMENTATIONS,
  forward_only,
  needs_gpu,
  resolve,
)


@dataclasses.dataclass(frozen=True)
class Settings:
  kernel: str
  kernel_precision: str  # our implementations' own policy ("auto": natural)
  kernel_options: str  # more fields of our implementations' Options
  precisions: tuple[str, ...]  # input format and same-policy baseline
  shapes: tuple[tuple[int, ...], ...]
  distributions: tuple[str, ...]
  seeds: int
  features: tuple[FeatureRecipe, ...]  # each feature set is audited
  repeats: int
  gate: tuple[str, ...]  # rules (and "invariance") that decide `passed`
  # probes of `stableattn.auditing.invariance`
  invariances: tuple[str, ...] = ()
  # edge regimes of `stableattn.auditing.regimes`, built from every shape
  regimes: tuple[str, ...] = ()
  # > 0: search this many drawn cases for the smallest failing one instead
  # of auditing the grid (`audit_search.py`)
  search_budget: int = 0
  # Why the kernel has no gradients here (judged on `out` alone), or None.
  forward_only: str | None = None


def settings_from_config(c) -> Settings:
  kernel = str(c.kernel).strip()
  if not kernel:
    raise ValueError("config.kernel is empty; name a kernel to audit.")
  if needs_gpu(kernel) and jax.default_backend() != "gpu":
    raise ValueError(f"kernel {kernel!r} needs an NVIDIA GPU.")
  resolve(kernel)  # before any file is written: one line if it cannot be
  kernel_precision = str(c.kernel_precision)
  if kernel_precision != "auto":
    Precision.from_name(kernel_precision)
  gate = as_tuple(c.gate)
  try:
    check_gate(gate, RULES)
    invariances = invariance.parse(c.get("invariances", ""))
    edge_regimes = regimes.parse(c.get("regimes", ""))
  except ValueError as e:
    raise ValueError(f"config: {e}") from None
  precisions = as_tuple(c.precisions)
  for name in precisions:
    Precision.from_name(name)  # a clear error naming the valid presets
  shapes = tuple(tuple(int(x) for x in s) for s in c.shapes)
  kernel_options = str(c.get("kernel_options", "") or "")
  if kernel_options:
    if kernel not in IMPLEMENTATIONS:
      raise ValueError(
        f"config.kernel_options={kernel_options!r} applies to our "
        f"implementations {list(IMPLEMENTATIONS)}, not {kernel!r}."
      )
    Options.from_string(kernel_options)  # names and values checked here
  return Settings(
    kernel=kernel,
    kernel_precision=kernel_precision,
    kernel_options=kernel_options,
    precisions=precisions,
    shapes=shapes,
    distributions=as_tuple(c.distributions),
    seeds=field(c, "seeds", minimum=1),
    features=_feature_sets(c.features),
    repeats=field(c, "repeats", minimum=2),
    gate=gate,
    invariances=invariances,
    regimes=edge_regimes,
    search_budget=field(c, "search_budget", minimum=0)
    if "search_budget" in c
    else 0,
    forward_only=forward_only(kernel),
  )


def _feature_sets(text) -> tuple[FeatureRecipe, ...]:
  """config.features: sets separated by ';', each "none" or a comma list
  of `stableattn.contract.features.RECIPE_NAMES`."""
  sets = [t.strip() for t in str(text).split(";") if t.strip()]
  if not sets:
    raise ValueError(
      f"config.features is empty; give e.g. 'none;causal' (valid names: "
      f"{list(RECIPE_NAMES)})."
    )
  try:
    return tuple(
      FeatureRecipe.from_names("" if t == "none" else t) for t in sets
    )
  except ValueError as e:
    raise ValueError(f"config.features: {e}") from None


def kernel_fn(s: Settings, policy: Precision):
  """The audited function; our implementations run under their own policy
  at the input format ("auto": Flash's for pallas, eager's otherwise;
  below 16 bits, where no policy is natural, the audited policy itself)."""
  if s.kernel not in IMPLEMENTATIONS:
    return resolve(s.kernel)
  own = s.kernel_precision
  if own == "auto" and policy.quantizes:
    own = policy
  elif own == "auto":
    fmt = format_name(policy.dtype("inputs"))
    own = natural_policy(fmt, "flash" if s.kernel == "pallas" else "baseline")
  return resolve(
    s.kernel, Options.from_string(s.kernel_options, Options(precision=own))
  )


def run(config, workdir, *, restart: bool = False) -> dict:
  """Audits the kernel; the headline says whether it passed and why not."""
  s = settings_from_config(config)
  with opened(workdir, config, restart=restart) as (run_dir, _):
    if s.search_budget:
      return audit_search.run(run_dir, s, kernel_fn)
    rows = []
    for name in s.precisions:
      policy = Precision.from_name(name)
      fn = kernel_fn(s, policy)
      for features in s.features:
        for case in cases(s.shapes, s.distributions, s.seeds, features):
          new = _measure(fn, policy, case, s)
          run_dir.append_metrics(new)
          rows += new
    notes = []
    for name in s.precisions:
      policy = Precision.from_name(name)
      new, skipped = _measure_regimes(kernel_fn(s, policy), policy, s)
      run_dir.append_metrics(new)
      rows += new
      notes += skipped
    probes = []
    if s.invariances:
      for name in s.precisions:
        policy = Precision.from_name(name)
        first = cases(s.shapes, s.distributions, 1)[0]
        probes += [
          {"kernel": s.kernel, "policy": policy.name, **r}
          for r in invariance.measure(
            kernel_fn(s, policy),
            policy,
            first.shape,
            s.invariances,
            distribution=first.distribution,
          )
        ]
      run_dir.write_csv("invariance.csv", probes)
    return write_report(run_dir, s, rows, probes, notes)


def _measure_regimes(fn, policy, s: Settings):
  """The edge regimes' rows and n/a notes at every shape."""
  tensors = ("out",) if s.forward_only else TENSORS
  rows, notes = [], []
  for spec in dict.fromkeys(s.shapes):
    for regime in s.regimes:
      new, skipped = regimes.measure_regime(
        fn, policy, shape_from_spec(spec), regime, s.repeats, tensors, RULES
      )
      rows += [{"kernel": s.kernel, **r} for r in new]
      notes += skipped
  return rows, notes


def _measure(fn, policy, case, s: Settings) -> list[dict]:
  check_accepts(fn, case.built_features().kwargs(), f"kernel {s.kernel!r}")
  # A kernel with no backward here is judged on its output alone; the
  # report says why its gradients are not (never a silent pass).
  tensors = ("out",) if s.forward_only else TENSORS
  try:
    rows = measure_case(fn, policy, case, s.repeats, tensors)
  except Exception as e:  # the kernel's own error, said in one line
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e)
    raise ValueError(
      f"kernel {s.kernel!r} raised on {case.label}, {case.distribution} "
      f"inputs, {policy.name}, features {case.features_label}: {first}"
    ) from e
  return [{"kernel": s.kernel, **r} for r in rows]


def headline(s: Settings, rows, probes=()) -> dict:
  # Failures list what the gate, determinism and the NaN scan failed, so
  # the kernel passed exactly when there are none.
  found = failures(rows, [g for g in s.gate if g in RULES])
  if INVARIANCE_GATE in s.gate:
    found += [
      f"{p['policy']}: {text}"
      for p in probes
      for text in invariance.failures([p])
    ]
  return {
    "kernel": s.kernel,
    "passed": not found,
    "gate": list(s.gate),
    "rules": {rule: all(r[f"{rule}_passed"] for r in rows) for rule in RULES},
    "deterministic": all(r["deterministic"] for r in rows),
    "finite": all(r["nonfinite"] == 0 for r in rows),
    "failures": found,
    "invariant": invariance.verdicts(probes) if s.invariances else {},
    "environment": environment.describe(),
  }


def write_report(
  run_dir: RunDir, s: Settings, rows, probes=(), notes=()
) -> dict:
  if not rows:
    raise ValueError("the audit measured nothing: no verdict from 0 rows.")
  result = headline(s, rows, probes)
  result["regimes_not_applicable"] = list(notes)
  run_dir.write_text(
    "headline.json", json.dumps(result, indent=2, default=str) + "\n"
  )
  run_dir.write_csv("summary.csv", rows)
  figure = _error_figure(run_dir, rows)
  verdict = "**PASSED**" if result["passed"] else "**FAILED**"
  parts = [
    f"# Audit of `{s.kernel}`: {verdict}",
    "",
    environment.summary_line(result["environment"]),
    "",
    f"Gate: {', '.join(s.gate)} rules, bitwise determinism over "
    f"{s.repeats} runs, no NaN/Inf. Policies {list(s.precisions)}; "
    f"{len(s.shapes)} shape(s), inputs {list(s.distributions)}, "
    f"{s.seeds} seed(s), features {[f.label for f in s.features]}.",
    "",
    verdict_table(rows),
    "",
    *_forward_only_lines(s.forward_only),
    *_failure_lines(result["failures"]),
    "## Errors against FP64 (worst over cases)",
    "",
    error_table(rows),
    "",
    f"![errors]({figure})",
    *regime_notes_section(notes),
    *invariance_section(probes),
  ]
  run_dir.write_text("report.md", "\n".join(parts) + "\n")
  return {"workdir": str(run_dir.path), **result}


def _forward_only_lines(reason: str | None) -> list[str]:
  return [] if reason is None else [f"Gradients not audited: {reason}.", ""]


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
