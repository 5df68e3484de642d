"""A search for the smallest input on which a kernel fails the audit.

Property-based (hypothesis): shapes (batch, lengths that need not be whole
tiles, heads, head dim), a causal mask or none, an input distribution and
an edge regime are drawn within a budget of cases; each is one audit of
the kernel exactly as the launcher runs it. On a failure hypothesis
shrinks the case to the smallest one that still fails, and the result is
one launcher command that reproduces it. Shrinking is capped at as many
audits again as the budget, so a search costs at most twice its budget.
"""

from __future__ import annotations

import dataclasses
import json

from tqdm.auto import tqdm

from stableattn.auditing import regimes, reproducers
from stableattn.auditing.kernel_audit import audit
from stableattn.numerics.precision import Precision
from stableattn.numerics.rules import RULES

DISTRIBUTIONS = ("normal", "uniform", "outliers")
# A kernel raising these on a drawn case refuses it (a length or feature
# it does not take): not a wrong number. Any other error is a failure.
REFUSALS = ("ValueError", "NotImplementedError")


def _strategy(st):
  return st.fixed_dictionaries(
    {
      "batch": st.integers(1, 3),
      "q_len": st.integers(1, 130),
      "kv_len": st.integers(1, 130),
      "heads": st.integers(1, 2),
      "head_dim": st.sampled_from((16, 32)),
      "causal": st.booleans(),
      "distribution": st.sampled_from(DISTRIBUTIONS),
      "regime": st.sampled_from(("none", *regimes.REGIMES)),
    }
  )


def case_audit(fn, policy, case: dict, gate):
  """The audit of one drawn case (what its reproducer runs)."""
  shape = (case["batch"], case["q_len"], case["kv_len"], case["heads"],
           case["heads"], case["head_dim"])  # fmt: skip
  return audit(
    fn,
    precision=policy,
    shapes=(shape,),
    distributions=(case["distribution"],),
    features="causal" if case["causal"] else None,
    regimes=None if case["regime"] == "none" else case["regime"],
    repeats=2,
    gate=gate,
  )


def audit_failed(report) -> bool:
  """A rule, determinism or NaN failure, or an error other than a
  refusal."""
  crashed = [e for e in report.errors if not e["error"].startswith(REFUSALS)]
  return bool(crashed) or bool(dataclasses.replace(report, errors=()).failures)


def reproducer(kernel: str, policy: str, case: dict, gate) -> str:
  """One launcher command that audits exactly `case`."""
  shape = (case["batch"], case["q_len"], case["kv_len"], case["heads"],
           case["heads"], case["head_dim"])  # fmt: skip
  return reproducers.command(
    kernel,
    policy,
    (shape,),
    distributions=case["distribution"],
    features="causal" if case["causal"] else "none",
    gate=",".join(gate),
    regimes=None if case["regime"] == "none" else case["regime"],
  )


def search(fn, kernel: str, policy: str, *, budget: int, gate):
  """{"found": False, "cases": n} or the smallest failing case with its
  failures and reproducer. Cases the kernel refuses (a ValueError, e.g. a
  length it does not take) count as passing: a refusal is not a wrong
  number; any other error is a failure)."""
  try:
    import hypothesis
    from hypothesis import strategies as st
  except ImportError:
    raise ValueError(
      "the audit's search needs hypothesis: pip install hypothesis (or the "
      "project's [test] extra)."
    ) from None
  tried, known = [], {}

  def fails(case) -> bool:
    key = tuple(sorted(case.items()))
    if key in known:
      return known[key]
    # Shrinking may try many cases, each an audit compiled anew: after a
    # first failure, `budget` more are audited and the rest count as
    # passing, so the search ends with the smallest failure seen.
    failed = sum(known.values())
    if failed and len(tried) >= 2 * budget:
      return False
    tried.append(case)
    progress.update()
    try:
      known[key] = audit_failed(case_audit(fn, policy, case, gate))
    except ValueError:  # the kernel breaks the contract at this shape
      known[key] = False
    return known[key]

  settings = hypothesis.settings(
    max_examples=budget,
    database=None,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck),
  )
  # At most the budget, then as many again to shrink a failure.
  progress = tqdm(total=2 * budget, desc=f"search {kernel}", unit="case",
                  disable=None)  # fmt: skip
  try:
    found = hypothesis.find(_strategy(st), fails, settings=settings)
  except hypothesis.errors.NoSuchExample:
    return {"found": False, "cases": len(tried)}
  finally:
    progress.close()
  return {
    "found": True,
    "cases": len(tried),
    "case": found,
    "failures": case_audit(fn, policy, found, gate).failures,
    "reproducer": reproducer(kernel, policy, found, gate),
  }


def run(run_dir, s, kernel_fn) -> dict:
  """The audit launcher's search: the smallest failing case at each of
  `s.precisions` in turn until one fails, written as report.md and
  headline.json; `kernel_fn(s, policy)` is the audited function."""
  gate = [g for g in s.gate if g in RULES]
  result = {"found": False}
  for name in s.precisions:
    policy = Precision.from_name(name)
    result = search(
      kernel_fn(s, policy), s.kernel, name, budget=s.search_budget, gate=gate
    )
    if result["found"]:
      break
  lines = [f"# Search of `{s.kernel}`", ""]
  if result["found"]:
    print(f"reproduce: {result['reproducer']}")
    lines += [
      f"Smallest failing case after {result['cases']} cases: "
      f"`{result['case']}`.",
      "",
      *[f"- {f}" for f in result["failures"]],
      "",
      "Reproduce:",
      "",
      f"    {result['reproducer']}",
    ]
  else:
    lines.append(
      f"No failure in {result['cases']} cases per policy "
      f"({list(s.precisions)}): a larger budget may still find one."
    )
  run_dir.write_text("report.md", "\n".join(lines) + "\n")
  headline = {"kernel": s.kernel, "passed": not result["found"], **result}
  run_dir.write_text(
    "headline.json", json.dumps(headline, indent=2, default=str) + "\n"
  )
  return {"workdir": str(run_dir.path), **headline}
