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
import json
import os
import pathlib

from tqdm.auto import tqdm

from stableattn.auditing import (
  captured_report,
  captures,
  ci_reports,
  invariance,
  offsets,
  regimes,
  reproducers,
  shrinking_search,
)
from stableattn.auditing.feature_recipes import RECIPE_NAMES, FeatureRecipe
from stableattn.auditing.kernel_audit import (
  INVARIANCE_GATE,
  TENSORS,
  case_label,
  cases,
  check_gate,
  measure_case,
  measured_or_error,
  regime_rows,
)
from stableattn.auditing.report import write_report
from stableattn.contract.options import Options
from stableattn.harness.config_values import as_tuple, field
from stableattn.harness.memory_maps import release_if_near_limit
from stableattn.harness.rundir import opened
from stableattn.numerics.formats import format_name
from stableattn.numerics.precision import (
  Precision,
  natural_policy,
  stable_policy,
)
from stableattn.numerics.rules import RULES
from stableattn.ops.dispatch import FLASH_IMPLEMENTATIONS, check_options_for
from stableattn.ops.registry import (
  IMPLEMENTATIONS,
  LAYOUTS,
  forward_only,
  in_layout,
  resolve,
  unavailable,
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
  # of auditing the grid (`shrinking_search.py`)
  search_budget: int = 0
  # Why the kernel has no gradients here (judged on `out` alone), or None.
  forward_only: str | None = None
  # The kernel's layout (`stableattn.ops.registry.LAYOUTS`): "bhsd"
  # kernels are called on transposed inputs.
  layout: str = "bshd"
  # A model's captured tensors (`stableattn.auditing.captures`): a run's
  # directory, its captures/ or one step's folder; "": none.
  inputs: str = ""
  # CI: a JUnit XML path (""), a baseline of known findings ("") and
  # whether to record the current failures as it.
  junit: str = ""
  baseline: str = ""
  update_baseline: bool = False


def settings_from_config(c) -> Settings:
  kernel = str(c.kernel).strip()
  if not kernel:
    raise ValueError("config.kernel is empty; name a kernel to audit.")
  reason = unavailable(kernel)
  if reason is not None:
    raise ValueError(f"kernel {kernel!r} cannot run here: {reason}.")
  resolve(kernel)  # before any file is written: one line if it cannot be
  kernel_precision = str(c.kernel_precision)
  if kernel_precision not in ("auto", "stable"):
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
    # Names and values, and what the chosen path refuses whatever the
    # shapes, before any case runs.
    try:
      check_options_for(kernel, Options.from_string(kernel_options))
    except ValueError as e:
      raise ValueError(
        f"config.kernel_options={kernel_options!r}: {e}"
      ) from None
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
    layout=_layout(c),
    inputs=_inputs(c),
    junit=str(c.get("junit", "") or ""),
    baseline=str(c.get("baseline", "") or ""),
    update_baseline=bool(c.get("update_baseline", False)),
  )


def _inputs(c) -> str:
  """config.inputs, checked before any file is written."""
  path = str(c.get("inputs", "") or "").strip()
  if path:
    try:
      captures.index(path)  # the folders and their records; arrays later
    except ValueError as e:
      raise ValueError(f"config.inputs: {e}") from None
  return path


def _layout(c) -> str:
  layout = str(c.get("layout", "bshd"))
  if layout not in LAYOUTS:
    raise ValueError(
      f"config.layout={layout!r}; valid: {list(LAYOUTS)} ('bhsd' for a "
      "kernel in torch's [batch, heads, length, head_dim] layout)."
    )
  return layout


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
  at the input format ("auto": Flash's for our flash kernels, pallas and
  mosaic_gpu, eager's otherwise;
  below 16 bits, where no policy is natural, the audited policy itself)."""
  if s.kernel not in IMPLEMENTATIONS:
    return resolve(s.kernel)
  own = s.kernel_precision
  if own == "auto" and policy.quantizes:
    own = policy
  elif own == "stable":
    own = stable_policy(format_name(policy.dtype("inputs")))
  elif own == "auto":
    fmt = format_name(policy.dtype("inputs"))
    flash = s.kernel in FLASH_IMPLEMENTATIONS
    own = natural_policy(fmt, "flash" if flash else "baseline")
  return resolve(
    s.kernel, Options.from_string(s.kernel_options, Options(precision=own))
  )


def run(config, workdir, *, restart: bool = False) -> dict:
  """Audits the kernel; the headline says whether it passed and why not.
  A case the kernel raises on is an error row with a reproducing command;
  every other case is still judged."""
  s = settings_from_config(config)
  with opened(workdir, config, restart=restart) as (run_dir, _):
    if s.search_budget:
      return shrinking_search.run(run_dir, s, kernel_fn)
    progress = tqdm(total=_steps(s), desc=f"audit {s.kernel}", unit="case",
                    disable=None)  # fmt: skip
    rows, notes, errors, probes = [], [], [], []
    layers = captures.load(s.inputs) if s.inputs else []
    captured = [layer.edge_case() for layer in layers]
    placed = [captured_report.layer_statistics(layer) for layer in layers]
    for name in s.precisions:
      policy = Precision.from_name(name)
      fn = in_layout(kernel_fn(s, policy), s.layout)
      for features in s.features:
        for case in cases(s.shapes, s.distributions, s.seeds, features):
          new, raised = _measure(fn, policy, case, s)
          run_dir.append_metrics(new)
          rows += new
          errors += raised
          progress.update()
          release_if_near_limit()
      for spec in dict.fromkeys(s.shapes):
        new, skipped, raised = regime_rows(
          fn, policy, (spec,), s.regimes, s.repeats, _tensors(s), RULES
        )
        new = [{"kernel": s.kernel, **r} for r in new]
        run_dir.append_metrics(new)
        rows += new
        notes += skipped
        errors += [_with_command(s, e, spec) for e in raised]
        progress.update(len(s.regimes))
      bitwise, shifts = invariance.split(s.invariances)
      first = cases(s.shapes, s.distributions, 1)[0]
      judged = [*captured, *offsets.shift_cases_at(first, shifts)]
      if judged:
        new, skipped, raised = regimes.measure_cases(
          fn, policy, judged, s.repeats, _tensors(s), RULES
        )
        new = [{"kernel": s.kernel, **r} for r in new]
        run_dir.append_metrics(new)
        rows += new
        notes += skipped
        errors += raised
      progress.update(bool(captured))
      if bitwise:
        probes += [
          {"kernel": s.kernel, "policy": policy.name, **r}
          for r in invariance.measure(
            fn, policy, first.shape, bitwise,
            distribution=first.distribution,
          )
        ]  # fmt: skip
      progress.update(bool(s.invariances))
    progress.close()
    if probes:
      run_dir.write_csv("invariance.csv", probes)
    result = write_report(
      run_dir, s, rows, probes, notes, errors, captured=placed
    )
    return ci_verdict(run_dir, s, result, rows, notes, errors, probes)


def _steps(s: Settings) -> int:
  """The progress bar's length: grid cases, regimes per shape, probes."""
  grid = len(cases(s.shapes, s.distributions, s.seeds)) * len(s.features)
  regimes_run = len(dict.fromkeys(s.shapes)) * len(s.regimes)
  return len(s.precisions) * (
    grid + regimes_run + bool(s.invariances) + bool(s.inputs)
  )


def _tensors(s: Settings) -> tuple[str, ...]:
  return ("out",) if s.forward_only else TENSORS


def _measure(fn, policy, case, s: Settings):
  """(rows, errors) of one grid case: a case the kernel raises on, or
  cannot take (a feature its signature lacks, an output of the wrong
  shape), is an error row, and the audit goes on."""
  # A kernel with no backward here is judged on its output alone; the
  # report says why its gradients are not (never a silent pass).
  rows, errors = measured_or_error(
    lambda: measure_case(fn, policy, case, s.repeats, _tensors(s)),
    case_label(case),
    policy,
    contract_stops=False,
  )
  spec = case.shape.spec
  return (
    [{"kernel": s.kernel, **r} for r in rows],
    [_with_command(s, e, spec, case) for e in errors],
  )


def _with_command(s: Settings, error: dict, spec, case=None) -> dict:
  """An error row with the one launcher command that reproduces it."""
  own = {
    "layout": None if s.layout == "bshd" else s.layout,
    "kernel_precision": None
    if s.kernel_precision == "auto"
    else s.kernel_precision,
    "kernel_options": s.kernel_options or None,
  }
  if case is None:  # an edge regime's case, built from the audit shape
    case_fields = {"features": "none", "regimes": error["regime"]}
  else:
    case_fields = {
      "distributions": case.distribution,
      "seeds": case.seed + 1,
      "features": case.features_label,
    }
  command = reproducers.command(
    s.kernel, error["policy"], (spec,), **own, **case_fields
  )
  return {"kernel": s.kernel, **error, "command": command}


def ci_verdict(
  run_dir, s: Settings, result, rows, notes, errors, probes=()
) -> dict:
  """The verdict against a baseline of known findings (or recorded as
  it), the JUnit file, and the GitHub step summary and annotations
  (`write_report` has already refused a run that measured nothing);
  writing a summary never changes the verdict."""
  gate = [g for g in s.gate if g in RULES or g == INVARIANCE_GATE]
  rows = [{"kernel": s.kernel, **r} for r in rows]
  found = ci_reports.failing(rows, gate, errors, probes)
  judged = None
  if s.baseline and s.update_baseline:
    ci_reports.merge_baseline(s.baseline, found, s.kernel)
    result["baseline"] = f"recorded {len(found)} failures in {s.baseline}"
    result["passed"] = bool(rows)
  elif s.baseline:
    judged = ci_reports.judge(found, ci_reports.load_baseline(s.baseline))
    result["baseline"] = judged
    result["passed"] = bool(rows) and not judged["new"] and not judged["worse"]
  if s.baseline:
    result["verdict"] = "passed" if result["passed"] else "FAILED"
    text = json.dumps(result, indent=2, default=str) + "\n"
    run_dir.write_text("headline.json", text)
  if s.junit:
    pathlib.Path(s.junit).write_text(
      ci_reports.junit_xml(s.kernel, rows, gate, errors, notes, probes)
    )
  summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
  if summary_path:
    try:
      with open(summary_path, "a") as f:
        f.write(
          ci_reports.summary_markdown(s.kernel, result["passed"], judged, found)
        )
    except OSError as e:  # the verdict stands; say why there is no summary
      print(f"warning: no step summary written to {summary_path}: {e}")
    for line in ci_reports.annotations(judged, found):
      print(line)
  return result
