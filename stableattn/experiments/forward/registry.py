"""The forward studies, in report order: one line per study module, each
module defining `STUDY` (a `study.Study`) and named after its config section,
with `_study` added where the library holds a module of that name
(`features_study` is the study `features`).
"""

from __future__ import annotations

import importlib

STUDY_MODULES = (
  "format_sweep",
  "against_golden",
  "seq_len",
  "tiles",
  "stage_attribution",
  "fa3_table3",
  "fa3_fp8",
  "tied_maxima",
  "backward",
  "features_study",
  "fp8_underflow",
  "sage_fp8",
  "fp8_stages",
  "inference",
  "context_parallel",
  "long_context",
)


def _load(module: str):
  study = importlib.import_module(f"{__package__}.{module}").STUDY
  if study.name != module.removesuffix("_study"):
    raise ValueError(
      f"study module {module!r} defines a study named {study.name!r}: the "
      "study, its module and its config section share one name."
    )
  return study


STUDIES = {study.name: study for study in map(_load, STUDY_MODULES)}
# Every paper claim ("fig4") -> its `study.Claim`, from the study answering it.
CLAIMS = {
  claim_id: claim
  for study in STUDIES.values()
  for claim_id, claim in study.claims.items()
}
