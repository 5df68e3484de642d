"""Forward-deviation experiment: paper Figs. 3-6, FlashAttention-3 Table 3,
stage attribution, tied maxima and the backward pass.

Each study is one module of this package (see `study.Study`); the modules
named in `registry.STUDY_MODULES` are the experiment. `run` measures the
selected studies, resumably, and writes the report.
"""

from stableattn.experiments.forward.registry import STUDIES
from stableattn.experiments.forward.runner import (
  EXTENDABLE,
  Settings,
  point_key,
  run,
  settings_from_config,
)
from stableattn.harness.reporting import summarize

__all__ = [
  "EXTENDABLE",
  "STUDIES",
  "Settings",
  "point_key",
  "run",
  "settings_from_config",
  "summarize",
]
