"""report.md of the forward experiment: the paper's claims first, then one
section per study (written by the study), then non-finite values.

Every sentence with a number is computed from the summary (means over
seeds, with the min-max range where it matters), never typed in.
"""

from __future__ import annotations

import jax

from stableattn.experiments.forward.registry import CLAIMS, STUDIES
from stableattn.experiments.forward.study import ReportContext
from stableattn.harness import environment
from stableattn.harness.reporting import section, select, table
from stableattn.harness.rundir import RunDir


def paper_claims(summary, studies) -> dict[str, dict]:
  """Every claim of the selected studies, with its verdict and evidence."""
  return {
    claim_id: {
      "claim": claim.text,
      **claim.compute(select(summary, study=name)),
    }
    for name in studies
    for claim_id, claim in STUDIES[name].claims.items()
  }


def _claims_section(claims: dict) -> str:
  return "\n".join(
    [
      "## The paper's claims, mapped",
      "",
      "Each verdict is computed from the rows of the study that measures "
      "the claim: reproduced (holds in every measured setting), reproduced "
      "in part (in some), not reproduced (in none).",
      "",
      table(
        [
          "claim",
          "claimed (Golden et al. 2024; later work)",
          "verdict",
          "where it holds",
        ],
        [
          [
            claim_id,
            claim["claim"],
            f"**{claim['verdict']}**",
            CLAIMS[claim_id].evidence(claim),
          ]
          for claim_id, claim in claims.items()
        ],
      ),
      "",
    ]
  )


def _nonfinite_section(summary) -> str:
  bad = [r for r in summary if r.get("n_nan_max") or r.get("n_inf_max")]
  if not bad:
    return (
      "## Non-finite values\n\nNo NaN or Inf appeared in any output "
      "or gradient.\n"
    )
  lines = [
    "## Non-finite values",
    "",
    "These measurements produced NaN or Inf; their metrics above are "
    "NaN/Inf by design (counts: the most in one seed):",
    "",
  ]
  for r in bad:
    lines.append(
      f"- {r['study']} / {r.get('comparison', '-')} / "
      f"{r['point_key'].split(':', 1)[1]}: {r['n_nan_max']:.0f} NaN, "
      f"{r['n_inf_max']:.0f} Inf"
    )
  return "\n".join(lines) + "\n"


def _where_flash_ran() -> str:
  device = jax.devices()[0]
  if device.platform == "gpu":
    return (
      f"compiled for {device.device_kind}, interpret mode for FP64 policies"
    )
  return f"interpret mode on {device.platform.upper()}"


def write_report(
  run_dir: RunDir, settings, summary: list[dict], extended: dict = None
) -> dict:
  """Writes report.md and the plots; returns the headline numbers.

  Args:
    extended: {field: (before, now)} when this run extended an earlier one.

  Raises:
    ValueError: if there is nothing to report (no verdict from no rows).
  """
  if not summary:
    raise ValueError(
      f"No measurements in {run_dir.path} for studies "
      f"{list(settings.studies)}: nothing to report."
    )
  env = environment.describe()
  headline: dict = {"environment": env}
  parts = [
    "# Forward deviation of flash attention",
    "",
    environment.summary_line(env),
    "",
    f"Flash = our Pallas kernel ({_where_flash_ran()}); Baseline = "
    "materialized softmax(QK^T/sqrt(d))V; golden = Baseline in NumPy FP64 "
    "on the same (already rounded) inputs. Errors are max |difference| "
    "unless a column says otherwise; numbers are means over seeds with the "
    "min-max range in parentheses. Policies: see the README's precision "
    "table.",
    "",
  ]
  claims = paper_claims(summary, settings.studies)
  headline["claims"] = claims
  if claims:
    parts.append(_claims_section(claims))
  if extended:
    parts += [
      "*Extended run:* this directory held an earlier run; "
      + "; ".join(
        f"{k} {old!r} -> {new!r}" for k, (old, new) in extended.items()
      )
      + ". Measurements made before are kept; the rest were added.",
      "",
    ]
  for name in settings.studies:
    study, config = STUDIES[name], settings.configs[name]
    result = study.report(
      ReportContext(
        rows=select(summary, study=name),
        common=settings.common,
        config=config,
        out_dir=run_dir.path,
        headline=headline,
        claims=claims,
      )
    )
    if result is not None:
      parts.append(
        section(
          study.title,
          study.ran(settings.common, config),
          result.body,
          result.findings,
          result.plots,
        )
      )
  parts.append(_nonfinite_section(summary))
  run_dir.write_text("report.md", "\n".join(parts))
  return headline
