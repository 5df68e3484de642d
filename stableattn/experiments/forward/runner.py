"""The generic forward runner: settings from the config, resumable
measurement of every selected study, the summary, the report.

`metrics.jsonl` holds one row per (point, seed, comparison):
`{"study", "point_key", "seed", "rows_in_group", "labels", "values"}`. The
summary groups rows by study, point and labels and averages every value,
so a new metric needs no registration anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
from tqdm.auto import tqdm

from stableattn.experiments.engine import Engine
from stableattn.experiments.forward.registry import STUDIES
from stableattn.experiments.forward.report import write_report
from stableattn.experiments.forward.study import Common
from stableattn.harness.config_values import as_tuple, from_section
from stableattn.harness.reporting import summarize
from stableattn.harness.rundir import RunDir, opened

# Fields whose change only adds measurements to a run directory.
EXTENDABLE = ("studies", "common.seeds") + tuple(
  f"{name}.{field}"
  for name, study in STUDIES.items()
  for field in study.extendable
)


@dataclasses.dataclass(frozen=True)
class Settings:
  studies: tuple[str, ...]  # the selected studies, in report order
  common: Common
  configs: dict  # study name -> its Config


def settings_from_config(config) -> Settings:
  """Validates the ConfigDict and builds every study's settings.

  Each selected study's section is read (and validated) by its own Config.

  Raises:
    ValueError: naming the field, what it got and what is valid.
  """
  selected = as_tuple(config.studies)
  unknown = [s for s in selected if s not in STUDIES]
  if unknown or not selected:
    raise ValueError(
      f"config.studies: unknown {unknown or 'none given'}; valid: "
      f"{list(STUDIES)}."
    )
  studies = tuple(name for name in STUDIES if name in selected)
  configs = {}
  for name in studies:
    cls = STUDIES[name].Config
    if dataclasses.fields(cls) and name not in config:
      raise ValueError(
        f"config.{name}: study {name!r} is selected but its config section is "
        "missing."
      )
    configs[name] = from_section(cls, config, name)
  return Settings(
    studies=studies,
    common=from_section(Common, config, "common"),
    configs=configs,
  )


def point_key(study: str, point: dict, common: Common) -> str:
  """The identity of a measurement: its study, its point and every setting
  outside the point that changes what it measures."""
  return study + ":" + json.dumps({**common.context(), **point}, sort_keys=True)


def _complete_groups(run_dir: RunDir) -> list[dict]:
  """Rows of fully written (point, seed) groups; drops the rest from disk.

  A group's rows are appended in one write, but a crash can still cut it;
  a partial group is measured again on resume rather than kept half.
  """
  stored = run_dir.read_metrics()
  rows = [r for r in stored if "labels" in r]
  counts: dict[tuple, int] = {}
  for r in rows:
    group = (r["point_key"], r["seed"])
    counts[group] = counts.get(group, 0) + 1
  complete = [
    r for r in rows if counts[(r["point_key"], r["seed"])] == r["rows_in_group"]
  ]
  if len(complete) != len(stored):
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
  with opened(workdir, config, restart=restart, extendable=EXTENDABLE) as (
    run_dir,
    extended,
  ):
    return _run(settings, run_dir, extended)


def _labelled(study: str, key: str, seed: int, point: dict, results) -> list:
  rows = []
  for result in results:
    clash = [
      k
      for k in result["labels"]
      if k in point and point[k] != result["labels"][k]
    ]
    if clash:
      raise ValueError(
        f"study {study!r}: row labels {clash} contradict the point {point}."
      )
    rows.append(
      {
        "study": study,
        "point_key": key,
        "seed": seed,
        "rows_in_group": len(results),
        "labels": {**point, **result["labels"]},
        "values": result["values"],
      }
    )
  return rows


def _run(settings: Settings, run_dir: RunDir, extended: dict) -> dict:
  rows = _complete_groups(run_dir)
  done = {(r["point_key"], r["seed"]) for r in rows}
  common = settings.common
  engine = Engine(scale=common.scale)

  work = []
  for name in settings.studies:
    study, config = STUDIES[name], settings.configs[name]
    for point in study.points(common, config):
      key = point_key(name, point, common)
      for seed in range(study.seeds(common, config)):
        work.append((name, point, key, seed))
  todo = [w for w in work if (w[2], w[3]) not in done]
  started = time.time()
  # One engine for every study: they share inputs, outputs and golden
  # values (the default run's tiles study reads 45 outputs of seq_len's).
  for name, point, key, seed in tqdm(
    todo, desc="forward deviation", unit="point", mininterval=1.0
  ):
    results = STUDIES[name].measure(
      engine, common, settings.configs[name], point, seed
    )
    measured = _labelled(name, key, seed, point, results)
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
    "nonfinite_rows": sum(
      1 for r in rows if r["values"].get("n_nan") or r["values"].get("n_inf")
    ),
    **headline,
  }
