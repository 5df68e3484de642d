"""Forward-deviation experiment: paper Figs. 3-6, FlashAttention-3 Table 3,
stage attribution, tied maxima and the backward pass.

`run(config, workdir)` measures every selected study over several seeds,
appending one row per (point, seed, comparison) to `metrics.jsonl`, then
writes `summary.csv`, `report.md` and one PNG per study. A rerun with the
same workdir skips the points already measured.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from stableattn.dispatch import check_tie_beta
from stableattn.experiments.config_values import as_tuple
from stableattn.experiments.engine import Engine
from stableattn.experiments.forward_report import write_report
from stableattn.experiments.forward_studies import (
  STUDIES,
  TIED_PLACEMENTS,
  TIED_VALUES,
  Settings,
)
from stableattn.experiments.rundir import RunDir
from stableattn.inputs import DISTRIBUTIONS
from stableattn.metrics import Deviation
from stableattn.pallas_forward import SCHEMES
from stableattn.precision import Precision, format_name

# Per-seed quantities that the summary averages; everything else in a row
# except `seed` and `argmax` identifies what was measured.
METRICS = (
  "max_abs",
  "mean_abs",
  "std_abs",
  "rmse",
  "rel_l2",
  "wasserstein",
  "max_ulp",
  "mean_signed",
  "ratio_max_abs",
  "ratio_rmse",
  "realized_margin",
  "signed_share",
)
COUNTS = ("n_nan", "n_inf", "size")
_NOT_IDENTITY = set(METRICS) | set(COUNTS) | {"seed", "argmax", "rows_in_group"}
assert set(METRICS) | set(COUNTS) >= {
  f.name for f in dataclasses.fields(Deviation)
} - {"argmax", "ulp_format"}


def settings_from_config(config) -> Settings:
  """Validates the ConfigDict and turns it into typed `Settings`."""
  studies = as_tuple(config.studies, str)
  unknown = [name for name in studies if name not in STUDIES]
  if unknown:
    raise ValueError(f"Unknown studies {unknown}; valid: {list(STUDIES)}.")
  distributions = as_tuple(config.distributions, str)
  bad = [d for d in distributions if d not in DISTRIBUTIONS]
  if bad or not distributions:
    raise ValueError(
      f"Unknown distributions {bad}; valid: {list(DISTRIBUTIONS)}."
    )
  schemes = as_tuple(config.schemes, str)
  bad = [x for x in schemes if x not in SCHEMES]
  if bad or not schemes:
    raise ValueError(f"Unknown schemes {bad}; valid: {list(SCHEMES)}.")
  for field in ("seq_len_precisions", "tied_precisions", "backward_precisions"):
    for name in as_tuple(config[field], str):
      try:
        Precision.from_name(name)
      except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
  for field, valid in (
    ("tied_placements", TIED_PLACEMENTS),
    ("tied_values", tuple(TIED_VALUES)),
  ):
    bad = [x for x in as_tuple(config[field], str) if x not in valid]
    if bad:
      raise ValueError(f"{field}: unknown {bad}; valid: {list(valid)}.")
  for beta in as_tuple(config.tied_betas, float):
    check_tie_beta(beta)
  if int(config.seeds) < 1:
    raise ValueError(f"seeds must be >= 1, got {config.seeds}.")
  return Settings(
    studies=studies,
    seeds=int(config.seeds),
    batch=int(config.batch),
    heads=int(config.heads),
    kv_heads=int(config.kv_heads),
    head_dim=int(config.head_dim),
    seq_len=int(config.seq_len),
    block_q=int(config.block_q),
    block_k=int(config.block_k),
    formats=tuple(format_name(f) for f in as_tuple(config.formats, str)),
    distributions=distributions,
    schemes=schemes,
    seq_lens=as_tuple(config.seq_lens, int),
    seq_len_precisions=as_tuple(config.seq_len_precisions, str),
    tile_seq_len=int(config.tile_seq_len),
    tile_sizes=tuple(tuple(int(b) for b in t) for t in config.tile_sizes),
    swap_tiles=tuple(int(b) for b in config.swap_tiles),
    equal_area_tiles=tuple(
      tuple(int(b) for b in t) for t in config.equal_area_tiles
    ),
    sram_elements=as_tuple(config.sram_elements, int),
    attribution_formats=tuple(
      format_name(f) for f in as_tuple(config.attribution_formats, str)
    ),
    fa3_shape=tuple(int(x) for x in config.fa3_shape),
    tied_precisions=as_tuple(config.tied_precisions, str),
    tied_betas=as_tuple(config.tied_betas, float),
    tied_counts=as_tuple(config.tied_counts, int),
    tied_placements=as_tuple(config.tied_placements, str),
    tied_values=as_tuple(config.tied_values, str),
    tied_margins=as_tuple(config.tied_margins, float),
    tied_q_len=int(config.tied_q_len),
    tied_kv_len=int(config.tied_kv_len),
    tied_seeds=int(config.tied_seeds),
    backward_precisions=as_tuple(config.backward_precisions, str),
    backward_seq_lens=as_tuple(config.backward_seq_lens, int),
    scale=float(config.scale),
  )


def point_key(study: str, point: dict) -> str:
  return study + ":" + json.dumps(point, sort_keys=True)


def summarize(rows: list[dict]) -> list[dict]:
  """Mean, std, min and max over seeds of each metric, per identity."""
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    identity = tuple(
      sorted(
        (k, json.dumps(v)) for k, v in row.items() if k not in _NOT_IDENTITY
      )
    )
    groups.setdefault(identity, []).append(row)
  summary = []
  for identity, members in groups.items():
    out = {k: json.loads(v) for k, v in identity}
    out["n_seeds"] = len(members)
    for metric in METRICS:
      values = [m[metric] for m in members if metric in m]
      if not values:
        continue
      arr = np.asarray(values, dtype=np.float64)
      out[f"{metric}_mean"] = float(np.mean(arr))
      out[f"{metric}_std"] = float(np.std(arr))
      out[f"{metric}_min"] = float(np.min(arr))
      out[f"{metric}_max"] = float(np.max(arr))
    for count in ("n_nan", "n_inf"):
      out[count] = int(sum(m.get(count, 0) for m in members))
    summary.append(out)
  return summary


def _complete_groups(run_dir: RunDir) -> list[dict]:
  """Rows of fully written (point, seed) groups; drops the rest from disk.

  A group's rows are appended in one write, but a crash can still cut it;
  a partial group is measured again on resume rather than kept half.
  """
  rows = run_dir.read_metrics()
  counts: dict[tuple, int] = {}
  for r in rows:
    counts[(r["point_key"], r["seed"])] = (
      counts.get((r["point_key"], r["seed"]), 0) + 1
    )
  complete = [
    r for r in rows if counts[(r["point_key"], r["seed"])] == r["rows_in_group"]
  ]
  if len(complete) != len(rows):
    run_dir.rewrite_metrics(complete)
  return complete


def run(config, workdir) -> dict:
  """Runs the selected studies; returns headline numbers and file paths."""
  # FP64 golden kernels and the fp64 format need JAX's 64-bit mode.
  jax.config.update("jax_enable_x64", True)
  settings = settings_from_config(config)
  run_dir = RunDir(workdir)
  run_dir.write_config(config.to_dict())
  rows = _complete_groups(run_dir)
  done = {(r["point_key"], r["seed"]) for r in rows}
  engine = Engine(scale=settings.scale)

  work = [
    (STUDIES[name], point, seed)
    for name in settings.studies
    for point in STUDIES[name].points(settings)
    for seed in range(STUDIES[name].seeds(settings))
  ]
  todo = [w for w in work if (point_key(w[0].name, w[1]), w[2]) not in done]
  started = time.time()
  current_study = None
  for study, point, seed in tqdm(
    todo, desc="forward deviation", unit="point", mininterval=1.0
  ):
    if study.name != current_study:
      engine.clear()
      current_study = study.name
    key = point_key(study.name, point)
    results = study.measure(engine, settings, point, seed)
    measured = [
      {
        "study": study.name,
        "point_key": key,
        "seed": seed,
        "rows_in_group": len(results),
        **point,
        **r,
      }
      for r in results
    ]
    run_dir.append_metrics(measured)
    rows.extend(measured)
  engine.clear()

  summary = summarize(rows)
  run_dir.write_csv("summary.csv", summary)
  headline = write_report(run_dir, settings, summary)
  return {
    "workdir": str(run_dir.path),
    "points_measured": len(todo),
    "points_skipped": len(work) - len(todo),
    "seconds": time.time() - started,
    "nonfinite_rows": sum(1 for r in rows if r["n_nan"] or r["n_inf"]),
    **headline,
  }
