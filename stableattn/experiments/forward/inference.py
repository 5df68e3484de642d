"""Inference's ways of computing the same attention, measured against each
other and against FP64: split-KV counts and sizes, batch size, chunked
prefill, paged caches and decode position (Thinking Machines 2025,
"Defeating Nondeterminism in LLM Inference"; FlashAttention's
`num_splits`; SGLang's and FlashInfer's fixed split size).

One decode step is the workload: a batch of sequences, each with one new
query at the end of a padded KV cache of its own length. Every axis runs
the same rows two ways and records the difference in ulps of the output
format (at the rows' largest FP64 value) beside the error against FP64;
split axes run with the partial outputs in FP32 and in the input format
(the `partials` stage).
"""

from __future__ import annotations

import dataclasses

from stableattn.experiments.forward import inference_rows
from stableattn.experiments.forward.study import (
  Claim,
  Section,
  Study,
  claim_findings,
  policies,
  require,
  verdict,
)
from stableattn.harness.config_values import spec
from stableattn.harness.plotting import Series, line_plot
from stableattn.harness.reporting import num, select, table
from stableattn.numerics.precision import Precision

PARTIALS = ("fp32", "input")
# "Harmless": the split output's error against FP64 stays within this
# factor of the unsplit kernel's.
HARMLESS_FACTOR = 1.25


@dataclasses.dataclass(frozen=True)
class Config:
  policies: tuple[str, ...] = spec(parse=policies)
  partials: tuple[str, ...] = spec(choices=PARTIALS)
  cache_len: int = spec(minimum=2)
  batch: int = spec(minimum=1)  # sequences in the decode step
  split_counts: tuple[int, ...] = spec(minimum=1)
  split_sizes: tuple[int, ...] = spec(minimum=1)  # multiples of block_k
  batch_sizes: tuple[int, ...] = spec(minimum=2)  # a row among N
  chunk_sizes: tuple[int, ...] = spec(minimum=1)
  page_sizes: tuple[int, ...] = spec(minimum=1)  # multiples of block_k
  positions: int = spec(minimum=1)  # decode positions compared with prefill
  seeds: int = spec(minimum=1)


def fixed_split_invariant(rows) -> dict:
  """A fixed split size is bitwise batch-invariant (so is one pass)."""
  rows = require(
    select(rows, axis="batch", schedule="split_size"),
    "inference_fixed_split",
    "inference",
  )
  holds = [r for r in rows if r["bitwise_min"] == 1.0]
  return {
    "verdict": verdict(len(holds), len(rows)),
    "bitwise": len(holds),
    "rows": len(rows),
    "batch_sizes": sorted({r["value"] for r in rows}),
  }


def heuristic_breaks(rows) -> dict:
  """A split count chosen from the batch size breaks batch invariance."""
  rows = require(
    select(rows, axis="batch", schedule="num_splits_by_batch"),
    "inference_heuristic_split",
    "inference",
  )
  by_policy: dict = {}
  for r in rows:
    by_policy.setdefault(r["policy"], []).append(r)
  broken = {
    p: max(r["diff_ulps_max"] for r in group)
    for p, group in by_policy.items()
    if any(r["bitwise_min"] < 1.0 for r in group)
  }
  return {
    "verdict": verdict(len(broken), len(by_policy)),
    "largest_ulps": broken,
    "policies": sorted(by_policy),
  }


def split_error(rows) -> dict:
  """Splitting the keys changes the output by less than its own error
  against FP64 (FP32 partials)."""
  rows = require(
    [
      r
      for r in rows
      if r["axis"] in ("num_splits", "split_size") and r["partials"] == "fp32"
    ],
    "inference_split_error",
    "inference",
  )
  ratio = {}
  for r in rows:
    share = r["diff_ulps_max"] / max(r["reference_error_ulps_max"], 1e-300)
    ratio[r["policy"]] = max(ratio.get(r["policy"], 0.0), share)
  below = [p for p, v in ratio.items() if v < 1.0]
  return {"verdict": verdict(len(below), len(ratio)), "ratio": ratio}


def fp32_partials_harmless(rows) -> dict:
  """With FP32 partials the split count leaves the error against FP64
  where one pass has it (within HARMLESS_FACTOR); with partials in the
  input format it may not."""
  rows = require(
    [r for r in rows if r["axis"] in ("num_splits", "split_size")],
    "inference_fp32_partials",
    "inference",
  )
  worst: dict = {}
  for r in rows:
    key = (r["policy"], r["partials"])
    worst[key] = max(worst.get(key, 0.0), r["error_ratio_max"])
  fp32 = {p: v for (p, f), v in worst.items() if f == "fp32"}
  require(fp32, "inference_fp32_partials (FP32 partials)", "inference")
  harmless = [p for p, v in fp32.items() if v <= HARMLESS_FACTOR]
  return {
    "verdict": verdict(len(harmless), len(fp32)),
    "worst_error_ratio": {f"{p} ({f})": v for (p, f), v in worst.items()},
    "factor": HARMLESS_FACTOR,
  }


class Inference(Study):
  name = "inference"
  title = "Inference: split-KV, batch, chunked prefill, pages, decode position"
  Config = Config
  extendable = ("seeds",)
  claims = {
    "inference_fixed_split": Claim(
      "a fixed split size is bitwise batch-invariant",
      fixed_split_invariant,
      lambda c: (
        f"{c['bitwise']} of {c['rows']} rows bitwise equal, batch sizes "
        f"{c['batch_sizes']}"
      ),
    ),
    "inference_heuristic_split": Claim(
      "a split count chosen from the batch size breaks batch invariance",
      heuristic_breaks,
      lambda c: (
        "rows move by up to "
        + (
          ", ".join(f"{p}: {num(v)} ulps" for p, v in c["largest_ulps"].items())
          or "0 ulps"
        )
        + f" (policies {c['policies']})"
      ),
    ),
    "inference_split_error": Claim(
      "splits change the output by less than its error against FP64",
      split_error,
      lambda c: (
        "largest change / FP64 error: "
        + ", ".join(f"{p} {num(v)}" for p, v in c["ratio"].items())
      ),
    ),
    "inference_fp32_partials": Claim(
      "FP32 partials make the split count harmless",
      fp32_partials_harmless,
      lambda c: (
        "worst error vs FP64 over split schedules / one pass's: "
        + ", ".join(f"{k} {num(v)}" for k, v in c["worst_error_ratio"].items())
        + f" (harmless: <= {c['factor']})"
      ),
    ),
  }

  def seeds(self, common, config) -> int:
    return config.seeds

  def points(self, s, c):
    for size in (*c.split_sizes, *c.page_sizes):
      if size % s.block_k:
        raise ValueError(
          f"inference: split and page sizes must be multiples of block_k="
          f"{s.block_k}; got {size}."
        )
    return [
      {"policy": policy, "partials": partials}
      for policy in c.policies
      for partials in c.partials
    ]

  def measure(self, engine, s, c, p, seed):
    policy = inference_rows.partials_policy(
      Precision.from_name(p["policy"]), p["partials"]
    )
    w = inference_rows.Workload(s, c, policy, seed)
    fmt = policy.output
    rows = inference_rows.split_rows(w, c, fmt)
    if p["partials"] == c.partials[0]:
      # Only the split axes depend on the partials' format.
      rows += inference_rows.batch_rows(w, c, s, fmt)
      rows += inference_rows.chunk_rows(w, c, fmt)
      rows += inference_rows.position_rows(w, c, fmt)
      if not policy.quantizes:
        # Operands below 16 bits are scaled per key block of a
        # contiguous cache; the paged kernel refuses them.
        rows += inference_rows.page_rows(w, c, fmt)
    return rows

  def ran(self, s, c):
    return (
      f"one decode step of {c.batch} sequences over caches of "
      f"{c.cache_len // 2}-{c.cache_len} keys ({s.heads} heads, head dim "
      f"{s.head_dim}, tiles {s.block_q}x{s.block_k}), policies "
      f"{list(c.policies)}, partials {list(c.partials)}; split counts "
      f"{list(c.split_counts)}, sizes {list(c.split_sizes)}; a row among "
      f"{list(c.batch_sizes)}; prefill chunks {list(c.chunk_sizes)}; pages "
      f"{list(c.page_sizes)} (policies of 16 bits or more); "
      f"{c.positions} decode positions; "
      f"{c.seeds} seed(s)."
    )

  def report(self, ctx):
    rows = ctx.rows
    if not rows:
      return None
    header = ["policy", "partials", "axis", "value", "schedule", "bitwise"]
    header += ["diff (ulps)", "error vs FP64 (ulps)", "one pass's error"]
    ordered = sorted(
      rows,
      key=lambda r: (
        r["policy"],
        r["partials"],
        r["axis"],
        r.get("schedule", ""),
        r["value"],
      ),
    )
    body = [
      [
        r["policy"],
        r["partials"],
        r["axis"],
        r["value"],
        r.get("schedule", "-"),
        "yes" if r["bitwise_min"] == 1.0 else "**no**",
        num(r["diff_ulps_max"]),
        num(r["error_ulps_max"]),
        num(r["reference_error_ulps_max"]),
      ]
      for r in ordered
    ]
    findings = claim_findings(self.claims, ctx)
    series = []
    for (policy, partials), group in _by(rows, "num_splits").items():
      group.sort(key=lambda r: r["value"])
      series.append(
        Series(
          f"{policy}, {partials} partials",
          [r["value"] for r in group],
          [r["error_ratio_mean"] for r in group],
        )
      )
    plots = []
    if series:
      plot = line_plot(
        ctx.out_dir / "inference.png",
        series,
        title="Split-KV: error against FP64 relative to one pass "
        "(mean over seeds)",
        xlabel="num_splits (capped at the number of key blocks)",
        ylabel="max error / one pass's max error",
        logy=False,
      )
      plots.append(plot.name)
    return Section(table(header, body), findings, plots)


def _by(rows, axis: str) -> dict:
  out: dict = {}
  for r in rows:
    if r["axis"] == axis:
      out.setdefault((r["policy"], r["partials"]), []).append(r)
  return out


STUDY = Inference()
