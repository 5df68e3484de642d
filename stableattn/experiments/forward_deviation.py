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
from stableattn.experiments.config_values import field, field_tuple
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


def _choices(config, name: str, valid) -> tuple[str, ...]:
  values = field_tuple(config, name, str)
  bad = [v for v in values if v not in valid]
  if bad:
    raise ValueError(f"config.{name}: unknown {bad}; valid: {list(valid)}.")
  return values


def _tiles(config, name: str) -> tuple:
  """A pair or a list of pairs of positive tile sizes."""
  raw = config[name]
  try:
    pairs = [raw] if isinstance(raw[0], int) else list(raw)
    out = tuple((int(a), int(b)) for a, b in pairs)
  except (TypeError, ValueError, IndexError):
    raise ValueError(
      f"config.{name} must be (block_q, block_k) pairs, got {raw!r}."
    ) from None
  if not out or min(min(p) for p in out) < 1:
    raise ValueError(f"config.{name} needs positive tile sizes, got {raw!r}.")
  return out[0] if isinstance(raw[0], int) else out


def settings_from_config(config) -> Settings:
  """Validates the ConfigDict and turns it into typed `Settings`.

  Raises:
    ValueError: naming the field, what it got and what is valid.
  """
  for name in ("seq_len_precisions", "tied_precisions", "backward_precisions"):
    for policy in field_tuple(config, name, str):
      try:
        Precision.from_name(policy)
      except ValueError as e:
        raise ValueError(f"config.{name}: {e}") from None
  tied_betas = field_tuple(config, "tied_betas", float, allow_empty=True)
  for beta in tied_betas:
    try:
      check_tie_beta(beta)
    except ValueError as e:
      raise ValueError(f"config.tied_betas: {e}") from None

  def formats(name):
    try:
      return tuple(format_name(f) for f in field_tuple(config, name, str))
    except ValueError as e:
      raise ValueError(f"config.{name}: {e}") from None

  fa3_shape = field_tuple(config, "fa3_shape", int, minimum=1)
  if len(fa3_shape) != 4:
    raise ValueError(
      f"config.fa3_shape must be (batch, seq_len, heads, head_dim), got "
      f"{config.fa3_shape!r}."
    )
  return Settings(
    studies=_choices(config, "studies", STUDIES),
    seeds=field(config, "seeds", minimum=1),
    batch=field(config, "batch", minimum=1),
    heads=field(config, "heads", minimum=1),
    kv_heads=field(config, "kv_heads", minimum=1),
    head_dim=field(config, "head_dim", minimum=1),
    seq_len=field(config, "seq_len", minimum=1),
    block_q=field(config, "block_q", minimum=1),
    block_k=field(config, "block_k", minimum=1),
    formats=formats("formats"),
    distributions=_choices(config, "distributions", DISTRIBUTIONS),
    schemes=_choices(config, "schemes", SCHEMES),
    golden_seq_lens=field_tuple(config, "golden_seq_lens", int, minimum=1),
    seq_lens=field_tuple(config, "seq_lens", int, minimum=1),
    seq_len_precisions=field_tuple(config, "seq_len_precisions", str),
    tile_seq_len=field(config, "tile_seq_len", minimum=1),
    tile_sizes=_tiles(config, "tile_sizes"),
    swap_tiles=_tiles(config, "swap_tiles"),
    equal_area_tiles=_tiles(config, "equal_area_tiles"),
    sram_elements=field_tuple(config, "sram_elements", int, minimum=1),
    attribution_formats=formats("attribution_formats"),
    fa3_shape=fa3_shape,
    tied_precisions=field_tuple(config, "tied_precisions", str),
    tied_betas=tied_betas,
    tied_counts=field_tuple(config, "tied_counts", int, minimum=1),
    tied_placements=_choices(config, "tied_placements", TIED_PLACEMENTS),
    tied_values=_choices(config, "tied_values", tuple(TIED_VALUES)),
    tied_margins=field_tuple(config, "tied_margins", float, minimum=1e-30),
    tied_q_len=field(config, "tied_q_len", minimum=1),
    tied_kv_len=field(config, "tied_kv_len", minimum=1),
    tied_seeds=field(config, "tied_seeds", minimum=1),
    backward_precisions=field_tuple(config, "backward_precisions", str),
    backward_seq_lens=field_tuple(config, "backward_seq_lens", int, minimum=1),
    scale=field(config, "scale", float),
  )


# Fields whose change only adds measurements to a run directory.
EXTENDABLE = ("seeds", "studies", "tied_seeds")


def point_key(study: str, point: dict, s: Settings) -> str:
  """The identity of a measurement: its study, its point and every setting
  outside the point that changes what it measures."""
  context = {
    "batch": s.batch,
    "heads": s.heads,
    "kv_heads": s.kv_heads,
    "head_dim": s.head_dim,
    "seq_len": s.seq_len,
    "block_q": s.block_q,
    "block_k": s.block_k,
    "scale": s.scale,
  }
  return study + ":" + json.dumps({**context, **point}, sort_keys=True)


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


def run(config, workdir, *, restart: bool = False) -> dict:
  """Runs the selected studies; returns headline numbers and file paths.

  A rerun into the same workdir resumes (measured points are skipped); it
  may add seeds or studies, but a config that would change a measured
  result is refused unless `restart` deletes the earlier results.
  """
  # FP64 golden kernels and the fp64 format need JAX's 64-bit mode.
  jax.config.update("jax_enable_x64", True)
  settings = settings_from_config(config)
  run_dir = RunDir(workdir)
  with run_dir.lock():
    extended = run_dir.bind_config(
      config.to_dict(), extendable=EXTENDABLE, restart=restart
    )
    return _run(settings, run_dir, extended)


def _run(settings: Settings, run_dir: RunDir, extended: dict) -> dict:
  rows = _complete_groups(run_dir)
  done = {(r["point_key"], r["seed"]) for r in rows}
  engine = Engine(scale=settings.scale)

  work = [
    (STUDIES[name], point, seed)
    for name in settings.studies
    for point in STUDIES[name].points(settings)
    for seed in range(STUDIES[name].seeds(settings))
  ]
  todo = [
    w for w in work if (point_key(w[0].name, w[1], settings), w[2]) not in done
  ]
  started = time.time()
  current_study = None
  for study, point, seed in tqdm(
    todo, desc="forward deviation", unit="point", mininterval=1.0
  ):
    if study.name != current_study:
      engine.clear()
      current_study = study.name
    key = point_key(study.name, point, settings)
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
  headline = write_report(run_dir, settings, summary, extended)
  run_dir.write_text(
    "headline.json", json.dumps(headline, indent=2, sort_keys=True) + "\n"
  )
  return {
    "workdir": str(run_dir.path),
    "points_measured": len(todo),
    "points_skipped": len(work) - len(todo),
    "seconds": time.time() - started,
    "nonfinite_rows": sum(1 for r in rows if r["n_nan"] or r["n_inf"]),
    **headline,
  }
