"""Audit any attention kernel: forward, gradients, determinism, NaN.

A kernel on the contract of `stableattn.ops.registry`, `fn(q, k, v,
**features)`, is run on inputs rounded to a policy's input format with
the features the audit names, and compared, output and gradients (dQ, dK,
dV for one random cotangent), against the FP64 golden value with the
same features and against our same-policy Baseline. Each tensor is judged
by the rules of the projects users trust, side by side
(`stableattn.numerics.rules`), repeated runs must agree bit for bit, and any NaN
or Inf fails. `check` is the same audit restricted to the forward output
and FlashAttention's rule.
"""

from __future__ import annotations

import dataclasses

from stableattn.auditing import captures, invariance, offsets
from stableattn.auditing import regimes as regimes_lib
from stableattn.auditing.feature_recipes import FeatureRecipe
from stableattn.auditing.inputs import (
  DISTRIBUTIONS,
  Shape,
  make_inputs,
  shape_from_spec,
)
from stableattn.auditing.measure import (
  TENSORS,
  ContractError,
  check_accepts,
  error_row,
  interpreter_reset,
  measure_arrays,
)
from stableattn.contract.arguments import names
from stableattn.contract.features import Features
from stableattn.harness.memory_maps import release_if_near_limit
from stableattn.numerics.precision import Precision
from stableattn.numerics.rules import RULES
from stableattn.ops.registry import in_layout

__all__ = ["TENSORS", "AuditReport", "audit", "check_accepts", "measure_case"]


@dataclasses.dataclass(frozen=True)
class Case:
  """One audited input: shape, distribution, seed and features."""

  shape: Shape
  distribution: str
  seed: int
  features: FeatureRecipe | Features = FeatureRecipe()

  @property
  def label(self) -> str:
    return self.shape.label

  @property
  def features_label(self) -> str:
    return features_label(self.features)

  def built_features(self) -> Features:
    if isinstance(self.features, Features):
      return self.features
    return self.features.build(self.shape)


def features_label(features) -> str:
  """ "none", or the set features' names ("causal,local_window_size")."""
  if isinstance(features, FeatureRecipe):
    return features.label
  return ",".join(features.kwargs()) or "none"


def case_label(case: Case) -> dict:
  """The columns that name a grid case in every row of it."""
  return {
    "shape": case.label,
    "distribution": case.distribution,
    "seed": case.seed,
    "features": case.features_label,
    "regime": "none",
    "detail": "",
  }


def measured_or_error(
  measure, label: dict, policy: Precision, contract_stops: bool = True
):
  """(rows, errors) of `measure()`: its rows, or, where the kernel raised,
  one error row naming the case and the error's type and first line. A
  broken contract (a feature the kernel's signature cannot take, an
  output of the wrong shape) stops the audit unless not
  `contract_stops` (the launcher's grid, which marks the case)."""
  try:
    return measure(), []
  except Exception as e:  # noqa: BLE001 - the kernel's own error: go on
    interpreter_reset()
    if contract_stops and isinstance(e, ContractError):
      raise
    return [], [error_row(label, policy, e)]


def case_words(r: dict) -> str:
  """A row's case in words: shape, inputs, seed, policy, features and
  its edge regime when it has one."""
  where = (
    f"{r['shape']}, {r['distribution']} inputs, seed {r['seed']}, "
    f"{r['policy']}, features {r['features']}"
  )
  if r.get("regime", "none") != "none":
    where += f", regime {r['regime']} ({r['detail']})"
  return where


def error_lines(errors) -> list[str]:
  """Each case the kernel raised on, in words."""
  return [f"the kernel raised on {case_words(e)}: {e['error']}" for e in errors]


def measure_case(
  fn, policy: Precision, case: Case, repeats, tensors=TENSORS, rules=RULES
):
  """Rows (one per tensor) of one case: rules, quality, determinism."""
  q, k, v = make_inputs(case.distribution, case.seed, case.shape)
  label = case_label(case)
  features = case.built_features().kwargs()
  return measure_arrays(
    fn, policy, label, (q, k, v), features, repeats, tensors, rules
  )


def cases(shapes, distributions, seeds: int, features=None):
  features = FeatureRecipe() if features is None else features
  bad = [d for d in distributions if d not in DISTRIBUTIONS]
  if bad or not distributions:
    raise ValueError(
      f"distributions {list(distributions)}: unknown {bad}; valid: "
      f"{list(DISTRIBUTIONS)} (at least one)."
    )
  if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
    raise ValueError(f"seeds must be an integer >= 1, got {seeds!r}.")
  if shapes is not None and not len(shapes):
    raise ValueError("an audit needs at least one shape.")
  return [
    Case(shape_from_spec(spec), distribution, seed, features)
    for spec in shapes
    for distribution in distributions
    for seed in range(seeds)
  ]


def failures(rows, rules=tuple(RULES)) -> list[str]:
  """Every failed rule, non-deterministic tensor and NaN, in words."""
  out = []
  for r in rows:
    where = f"{r['tensor']} at {case_words(r)}"
    if r["nonfinite"]:
      out.append(f"{r['nonfinite']} NaN/Inf values in {where}")
    if r.get("empty_rows_max"):
      out.append(
        f"rows no key may attend are not 0 in {where}: largest "
        f"|value| {r['empty_rows_max']:.3g} (documented: exactly 0)"
      )
    if r.get("no_gradient"):
      out.append(
        f"the kernel returns no gradient for its {r['tensor'][1:]} in "
        f"{where}: all zeros where FP64's is not"
      )
    if not r["deterministic"]:
      out.append(f"{where} differs between {r['repeats']} identical runs")
    for rule in rules:
      if not r[f"{rule}_passed"]:
        out.append(
          f"{rule} rule fails on {where}: {r[f'{rule}_value']:.3g} > "
          f"limit {r[f'{rule}_limit']:.3g}"
        )
  return out


# The opt-in gate that fails a kernel whose rows are not bitwise invariant.
INVARIANCE_GATE = "invariance"


def check_gate(gate, rules) -> None:
  unknown = [g for g in gate if g not in rules and g != INVARIANCE_GATE]
  if unknown:
    raise ValueError(
      f"unknown gate {unknown}; valid: {[*rules, INVARIANCE_GATE]}."
    )


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The rows of an audit and what failed (`passed`: nothing did);
  `invariance_rows` are the probes of `stableattn.auditing.invariance`."""

  rows: tuple[dict, ...]
  gate: tuple[str, ...]
  invariance_rows: tuple[dict, ...] = ()
  # Edge-regime cases that do not apply to this kernel or policy, each
  # with its reason ("n/a" in the report).
  regime_notes: tuple[dict, ...] = ()
  # Cases the kernel raised on: the case and the error's first line. Any
  # fails the audit; every other case is still judged.
  errors: tuple[dict, ...] = ()
  # The kernel's layout: "bhsd" kernels were called on transposed inputs.
  layout: str = "bshd"

  @property
  def invariant(self) -> dict:
    """{invariance: True, False or None (n/a)} for the probes run."""
    return invariance.verdicts(self.invariance_rows)

  @property
  def failures(self) -> list[str]:
    found = failures(self.rows, [g for g in self.gate if g in RULES])
    found += error_lines(self.errors)
    if INVARIANCE_GATE in self.gate:
      found += invariance.failures(self.invariance_rows)
    return found

  @property
  def passed(self) -> bool:
    return not self.failures

  def __str__(self) -> str:
    rules = [r for r in RULES if self.rows and f"{r}_passed" in self.rows[0]]
    lines = (
      []
      if self.layout == "bshd"
      else [
        f"layout {self.layout}: inputs and output transposed around the kernel"
      ]
    )
    lines += [
      f"{'tensor':>6} {'policy':>16} {'features':>16} "
      + " ".join(f"{rule:>18}" for rule in rules)
      + "  deterministic"
    ]
    for r in self.rows:
      cells = [
        f"{r[f'{rule}_value']:.2e}/{r[f'{rule}_limit']:.1e}"
        + (" ok" if r[f"{rule}_passed"] else " XX")
        for rule in rules
      ]
      lines.append(
        f"{r['tensor']:>6} {r['policy']:>16} {_features_cell(r):>16} "
        + " ".join(f"{c:>18}" for c in cells)
        + f"  {r['deterministic']}"
      )
    for n in self.regime_notes:
      lines.append(f"{n['regime']:>16} {n['detail']:>36}  n/a: {n['reason']}")
    for r in self.invariance_rows:
      if r["invariant"] is None:
        said = f"n/a: {r['reason']}"
      elif r["invariant"]:
        said = "bitwise equal"
      else:
        said = (
          f"differ by {r['diff_ulps']:.3g} ulps (error vs FP64 "
          f"{r['error_ulps']:.3g} ulps)"
        )
      lines.append(f"{r['invariance']:>16} {r['detail']:>36}  {said}")
    lines += self.failures
    lines.append("PASSED" if self.passed else "FAILED")
    return "\n".join(lines)


def _features_cell(r) -> str:
  """The row's features, and its edge regime when it has one."""
  regime = r.get("regime", "none")
  return r["features"] if regime == "none" else f"{regime}: {r['features']}"


def as_recipe(features, causal: bool = False):
  """`features` (None, "causal,window,...", a FeatureRecipe or Features)
  as a recipe or fixed Features, with `causal` sugar applied."""
  if features is None or isinstance(features, str):
    features = FeatureRecipe.from_names(features or "")
  if not isinstance(features, (FeatureRecipe, Features)):
    raise ValueError(
      "features must be None, names such as 'causal,window', a "
      f"FeatureRecipe or a stableattn.Features; got {type(features).__name__}."
    )
  if causal:
    features = dataclasses.replace(features, causal=True)
  return features


def grid_rows(fn, policy, all_cases, repeats, tensors, rules):
  """The grid cases' rows and the errors of those the kernel raised on."""
  rows, errors = [], []
  for case in all_cases:
    found, raised = measured_or_error(
      lambda case=case: measure_case(fn, policy, case, repeats, tensors, rules),
      case_label(case),
      policy,
    )
    rows += found
    errors += raised
    release_if_near_limit()
  return rows, errors


def regime_rows(fn, policy, shapes, edge_regimes, repeats, tensors, rules):
  """The edge regimes' rows, n/a notes and errors at every distinct shape
  of `shapes` (specs, as the audit takes them)."""
  rows, notes, errors = [], [], []
  for shape in dict.fromkeys(shape_from_spec(s) for s in shapes):
    for regime in edge_regimes:
      found, skipped, raised = regimes_lib.measure_regime(
        fn, policy, shape, regime, repeats, tensors, rules
      )
      release_if_near_limit()
      rows += found
      notes += skipped
      errors += raised
  return rows, notes, errors


def audit(
  fn,
  *,
  precision: str | Precision = "bf16-framework",
  shapes=((1, 128, 2, 64),),
  distributions=("normal",),
  seeds: int = 1,
  features=None,
  causal: bool = False,
  repeats: int = 3,
  gate=("flashattention", "flexattention"),
  tensors=TENSORS,
  rules=None,
  invariances=None,
  regimes=None,
  layout: str = "bshd",
  inputs=None,
) -> AuditReport:
  """Audits fn(q, k, v, **features): output and gradients under every
  rule, determinism over `repeats` runs, and NaN/Inf.

  Args:
    fn: a kernel on the contract of `stableattn.ops.registry`.
    precision: the input format and the same-policy baseline.
    shapes: (batch, seq_len, heads, head_dim) or six-field shapes.
    distributions, seeds: inputs per shape (`stableattn.auditing.inputs`).
    distributions, gate, tensors, invariances: names as 'a,b', a list or
      tuple, or one name (`stableattn.contract.arguments.names`).
    features: what fn is called (and judged) with: None, names of
      `stableattn.contract.features.RECIPE_NAMES` ("causal,window,segments"),
      built for each shape, or a `stableattn.Features` that fits every
      shape. Only the features that are set are passed.
    causal: sugar for adding `causal` to the features.
    repeats: identical runs that must agree bit for bit (at least 2; 1
      leaves determinism unjudged).
    gate: rules that decide `passed` (all are measured).
    tensors: ("out", "dq", "dk", "dv"), or ("out",) for a forward-only
      kernel.
    rules: name -> rule of `stableattn.numerics.rules` to measure; None:
      `RULES`.
    invariances: names of `stableattn.auditing.invariance.INVARIANCES` ("batch,
      decode", a sequence or "all"): the same rows computed the ways
      inference computes them, at the first shape's length, heads and
      head dim, bitwise or in ulps beside the error against FP64. The
      gate "invariance" fails a kernel that is not bitwise invariant.
      "key_shift" and "value_shift" (`stableattn.auditing.offsets`) are
      rows at the first grid case's input with a shared key (value)
      offset added, judged by the gated rules like any case.
    regimes: names of `stableattn.auditing.regimes.REGIMES`
      ("large_logits,empty_rows", a sequence or "all"): edge cases built
      from every shape, judged by the same rules, plus: NaN/Inf anywhere
      fails, and rows no key may attend must be exactly 0. Cases a kernel
      cannot run (a feature it does not take) are reported n/a.
    inputs: a model's own tensors, judged beside the grid: a capture
      directory (`stableattn.auditing.captures`; a training run's
      `captures/`), or a list of `captures.CapturedLayer` or `EdgeCase`.
      Each captured layer is a case of regime "captured" named by its
      step and layer, with its captured cotangent dO.
    layout: "bshd" (ours: [batch, length, heads, head_dim]) or "bhsd"
      (torch's and the TPU kernels': [batch, heads, length, head_dim]);
      the audit transposes around a "bhsd" kernel, inputs and output.

  A case the kernel raises on is an error row (`AuditReport.errors`,
  which fail the audit); every other case is still judged.

  Raises:
    ValueError: for bad settings, a feature the kernel does not accept, or
      a kernel that breaks the contract (the message says which case and
      why).
  """
  policy = Precision.from_name(precision)
  fn = in_layout(fn, layout)
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}.")
  rules = RULES if rules is None else rules
  gate = names(gate, "gate")
  tensors = names(tensors, "tensors")
  distributions = names(distributions, "distributions")
  check_gate(gate, rules)
  probes = invariance.parse(invariances)
  edge_regimes = regimes_lib.parse(regimes)
  if tuple(tensors) not in (TENSORS, ("out",)):
    raise ValueError(f"tensors must be {TENSORS} or ('out',), got {tensors}.")
  recipe = as_recipe(features, causal)
  all_cases = cases(shapes, distributions, seeds, recipe)
  rows, errors = grid_rows(
    fn, policy, all_cases, repeats, tuple(tensors), rules
  )
  found, notes, raised = regime_rows(
    fn, policy, shapes, edge_regimes, repeats, tuple(tensors), rules
  )
  rows += found
  errors += raised
  probes, shifts = invariance.split(probes)
  first = all_cases[0]
  judged = [
    *(captures.edge_cases(inputs) if inputs is not None else ()),
    *offsets.shift_cases_at(first, shifts),
  ]
  found, skipped, raised = regimes_lib.measure_cases(
    fn, policy, judged, repeats, tuple(tensors), rules
  )
  rows += found
  notes += skipped
  errors += raised
  invariance_rows = ()
  if probes:
    invariance_rows = tuple(
      invariance.measure(
        fn, policy, first.shape, probes, distribution=first.distribution
      )
    )
  return AuditReport(
    tuple(rows),
    tuple(gate),
    invariance_rows,
    tuple(notes),
    tuple(errors),
    layout,
  )
