"""`assert_audit_passes`: the audit as one assertion in a kernel project's
own tests, with known findings as a baseline."""

from __future__ import annotations

import pathlib

from stableattn.auditing import ci_reports, reproducers
from stableattn.auditing.kernel_audit import INVARIANCE_GATE, AuditReport, audit
from stableattn.numerics.rules import RULES


class AuditFailed(AssertionError):
  """The audit failed (or, against a baseline, failed in a new or worse
  way); `report` holds every row and `failing` the keys that decided."""

  def __init__(self, message: str, report: AuditReport, failing: list[str]):
    super().__init__(message)
    self.report = report
    self.failing = failing


def kernel_name(fn) -> str:
  """The import path the command line takes for `fn` (`module:function`),
  so a baseline recorded by `stableattn audit` keys the same."""
  module = getattr(fn, "__module__", None) or "kernel"
  name = getattr(fn, "__qualname__", None) or type(fn).__name__
  return f"{module}:{name}"


def _audit_shapes(settings: dict) -> tuple:
  """The shapes `audit` was given (one shape or several)."""
  shapes = settings.get("shapes", ((1, 128, 2, 64),))
  return (shapes,) if isinstance(shapes[0], int) else tuple(shapes)


def shape_spec(label: str) -> tuple[int, ...]:
  """'B1 T64 S64 H2/2 D16' (a row's shape) -> (1, 64, 64, 2, 2, 16)."""
  dims = {part[0]: part[1:] for part in label.split()}
  heads, kv_heads = dims["H"].split("/")
  head_dims = dims["D"].split("/")
  spec = (int(dims["B"]), int(dims["T"]), int(dims["S"]), int(heads))
  return (*spec, int(kv_heads), *map(int, head_dims))


def reproducer(name: str, row: dict, settings: dict) -> str:
  """One `stableattn audit` command that audits `row`'s case alone."""
  layout = settings.get("layout", "bshd")
  layout = None if layout == "bshd" else layout
  regime = row.get("regime", "none")
  if regime == "captured":
    shapes, fields = _audit_shapes(settings), {"inputs": settings.get("inputs")}
  elif regime != "none":  # built from the audit's shapes
    shapes = _audit_shapes(settings)
    fields = {"features": "none", "regimes": regime}
  else:
    shapes = (shape_spec(row["shape"]),)
    fields = {
      "distributions": row["distribution"],
      "seeds": row["seed"] + 1,
      "features": row["features"] or "none",
    }
  return reproducers.command(
    name, row["policy"], shapes, layout=layout, **fields
  )


def _gated_failures(report: AuditReport, name: str):
  gate = [g for g in report.gate if g in RULES or g == INVARIANCE_GATE]
  rows = [{"kernel": name, **r} for r in report.rows]
  errors = [{"kernel": name, **e} for e in report.errors]
  probes = [{"kernel": name, **p} for p in report.invariance_rows]
  found = ci_reports.failing(rows, gate, errors, probes)
  commands = {}
  for row in rows:
    for rule in [*gate, "finite", "deterministic"]:
      commands.setdefault(ci_reports.key(row, rule), row)
  for e in errors:
    commands.setdefault(
      ci_reports.key({**e, "tensor": "-"}, "error"), {"tensor": "-", **e}
    )
  return found, commands


def _message(header, keys, found, commands, name, settings) -> str:
  lines, by_command = [header], {}
  for k in keys[:20]:  # the tensors and rules of one case share a command
    row = commands.get(k) or {}
    command = row.get("command")
    if "policy" in row and "shape" in row:
      command = reproducer(name, row, settings)
    by_command.setdefault(command, []).append(k)
  for command, group in by_command.items():
    for k in group:
      ratio = found.get(k)
      lines.append(
        f"  {k}" + ("" if ratio is None else f": {ratio:.3g}x limit")
      )
    if command:
      lines.append(f"    reproduce: {command}")
  if len(keys) > 20:
    lines.append(f"  ... {len(keys) - 20} more")
  return "\n".join(lines)


def assert_audit_passes(
  fn,
  *,
  baseline: str | pathlib.Path | None = None,
  update_baseline: bool = False,
  name: str | None = None,
  margin: float = ci_reports.WORSE_MARGIN,
  **audit_kwargs,
) -> AuditReport:
  """Audits `fn` (`stableattn.audit`'s keywords) and raises `AuditFailed`
  when it fails, listing each failing case with a `stableattn audit`
  command that reproduces it; returns the report when it passes.

  With `baseline` (a file of `stableattn audit --baseline`'s format), only
  failures not recorded there, or recorded ones grown more than `margin`
  times, fail. `update_baseline` records this kernel's current failures
  in it instead (other kernels' entries are kept). `name` keys the
  kernel in the baseline: by default `module:function`, as the command
  line names it.
  """
  report = audit(fn, **audit_kwargs)
  name = name or kernel_name(fn)
  found, commands = _gated_failures(report, name)
  if update_baseline:
    if baseline is None:
      raise ValueError("update_baseline=True needs a baseline path to write.")
    ci_reports.merge_baseline(baseline, found, name)
    return report
  if baseline is not None:
    recorded = ci_reports.load_baseline(baseline)
    judged = ci_reports.judge(
      found, ci_reports.of_kernel(recorded, name), margin
    )
    keys = judged["new"] + judged["worse"]
    header = (
      f"{name}: {len(judged['new'])} new and {len(judged['worse'])} worse "
      f"failures against {baseline} ({len(judged['known'])} known, "
      f"{len(judged['fixed'])} fixed):"
    )
  else:
    keys = list(found)
    header = f"{name} fails the audit ({len(keys)} failing checks):"
  if keys:
    message = _message(header, keys, found, commands, name, audit_kwargs)
    if baseline is None:
      message += "\n" + "\n".join(f"  - {f}" for f in report.failures[:20])
    raise AuditFailed(message, report, keys)
  return report
