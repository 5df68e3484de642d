"""Pairs as data: which two runs are compared, and what their drift means.

Roles: a *subject* is a difference under study (Flash vs Baseline); a
*reference* is a difference practitioners already accept (another seed,
low-precision training), against which every subject's drift is divided;
a *control* must drift exactly 0; an *ablation* is a subject read only
as a share of a reference (BF16 training with one tensor class kept in
FP32, against BF16-vs-FP32 training), never judged by the paper's
claims. Golden et al. (2024) claim Flash vs
Baseline drifts at or below the different-seed pair and 2-5x below
low-precision training (Wasserstein); those claims sit on the references
as `at_most` and `below_band`, and every subject is judged by them.
"""

from __future__ import annotations

import dataclasses

from stableattn.experiments.training_drift.variants import (
  kept_in_fp32,
  only_in_bf16,
)
from stableattn.training.compute_format import FP32_CLASSES

ROLES = ("subject", "reference", "control", "ablation")


@dataclasses.dataclass(frozen=True)
class Pair:
  """drift(candidate - reference run) of two variants (`variants.py`).

  Attributes:
    name: the pair's name in config, rows and report.
    reference_run, candidate_run: variant names.
    role: one of ROLES.
    at_most: paper's claim: subject / this pair <= at_most.
    below_band: paper's claim: the subject drifts (low, high) times below.
    min_devices: the pair exists only with at least this many devices.
    requires: a config field that must be set for the pair to exist.
    in_all: whether `pairs="all"` holds it (the ablation's pairs are asked
      for by name: `--config=ablation`).
  """

  name: str
  reference_run: str
  candidate_run: str
  role: str
  at_most: float | None = None
  below_band: tuple[float, float] | None = None
  min_devices: int = 1
  requires: str | None = None
  in_all: bool = True

  def __post_init__(self):
    if self.role not in ROLES:
      raise ValueError(f"Pair {self.name!r}: role must be one of {ROLES}.")

  @property
  def runs(self) -> tuple[str, str]:
    return self.reference_run, self.candidate_run

  @property
  def claim(self) -> str | None:
    """The paper's claim about a subject against this pair, in words."""
    if self.at_most is not None:
      return f"<= {self.at_most:g}x"
    if self.below_band is not None:
      return f"{self.below_band[0]:g}-{self.below_band[1]:g}x below"
    return None


PAPER_BELOW = (2.0, 5.0)
# The run that `machine_twin` trains in another process; no variant.
MACHINE_RUN = "machine"

PAIRS = (
  Pair("flash_vs_baseline", "base", "flash", "subject"),
  Pair("fp16_vs_fp32", "fp32", "fp16", "reference", below_band=PAPER_BELOW),
  Pair("bf16_vs_fp32", "fp32", "bf16", "reference", below_band=PAPER_BELOW),
  Pair("fp16_vs_bf16", "bf16", "fp16", "reference", below_band=PAPER_BELOW),
  Pair("different_seed", "base", "seed", "reference", at_most=1.0),
  Pair("one_vs_n_devices", "base", "one_device", "reference", min_devices=2),
  # The base run compiled for another machine (one CPU instruction set
  # down; on a GPU, no autotuning), trained in a child process.
  Pair("other_machine", "base", MACHINE_RUN, "reference"),
  Pair("identical_rerun", "base", "rerun", "control"),
  Pair("flash_fix_vs_flash", "flash", "flash_fixed", "subject"),
  # Our kernel under its stable preset (docs/precision.md, "Stable
  # presets"): against the Baseline, and against Flash without the fixes.
  Pair("stable_vs_baseline", "base", "flash_stable", "subject"),
  Pair("stable_vs_flash", "flash", "flash_stable", "subject"),
  # A user's kernel in training: --config.attention.candidate=pkg.mod:fn.
  Pair(
    "candidate_vs_baseline",
    "base",
    "candidate",
    "subject",
    requires="attention.candidate",
  ),
  # Flash attention below 16 bits in training (forward quantized, backward
  # straight-through): --config.attention.low_precision=fp8-fa3.
  Pair(
    "low_precision_vs_baseline",
    "base",
    "flash_low",
    "subject",
    requires="attention.low_precision",
  ),
  # The flash run's attention as ring attention with the sequence sharded
  # over devices: --config.attention.context_parallel=2.
  Pair(
    "context_parallel_vs_single",
    "flash",
    "flash_context_parallel",
    "subject",
    requires="attention.context_parallel",
  ),
  # Where BF16-vs-FP32 drift comes from (`ablation` config): BF16
  # training with one tensor class kept in FP32, and FP32 training with
  # only one class in BF16, each against FP32 training; with every class
  # kept in FP32 the run must be FP32's, bit for bit.
  *(
    Pair(f"{run(c)}_vs_fp32", "fp32", run(c), "ablation", in_all=False)
    for run in (kept_in_fp32, only_in_bf16)
    for c in FP32_CLASSES
  ),
  Pair(
    "bf16_all_in_fp32_vs_fp32",
    "fp32",
    "bf16_all_in_fp32",
    "control",
    in_all=False,
  ),
)
BY_NAME = {p.name: p for p in PAIRS}


def with_role(names, role: str) -> list[Pair]:
  """The pairs among `names` with `role`, in registry order."""
  return [p for p in PAIRS if p.name in names and p.role == role]
