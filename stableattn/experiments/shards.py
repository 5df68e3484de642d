"""A sweep's units of work spread over processes and hosts.

Each size is a unit: a whole study (drift, stability) in
`<workdir>/sizes/<size>`, under its own lock, resuming from its own rows
and checkpoints. `--config.shard=
i/n` trains the units k with k mod n = i - 1 (in the configured order), so
shards started at once on one run directory, on one machine or on a job
array's hosts sharing it, never train the same unit; a killed shard's
lock dies with it, and starting the shard again resumes its unit. A unit
that finishes leaves `size.json` beside its study; whichever invocation
finds every unit's there writes the report. `--config.workers=N` runs N
shards as processes here, then the report.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import re

from stableattn.experiments.rundir import RunDir

UNIT_ROW = "size.json"
# Fields that say how the sweep is spread, never what it measures: shards
# bind one run directory whatever their share.
SPREAD_FIELDS = ("shard", "workers")
_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class Shard:
  """Share `index` (from 1) of `count`."""

  index: int = 1
  count: int = 1

  @classmethod
  def parse(cls, text) -> Shard:
    match = _SHARD.match(str(text))
    if match is None:
      raise ValueError(
        f"config.shard={text!r} is not 'i/n' (e.g. '2/8', or '1/1' for "
        "every unit)."
      )
    index, count = (int(g) for g in match.groups())
    if not 1 <= index <= count:
      raise ValueError(f"config.shard={text!r}: i must be in 1..n.")
    return cls(index, count)

  def takes(self, unit: int) -> bool:
    return unit % self.count == self.index - 1

  @property
  def label(self) -> str:
    return f"{self.index}/{self.count}"


def record_unit(directory, row: dict) -> None:
  """Marks a unit done with its row, once (its first finish's time)."""
  unit = RunDir(directory)
  if not (unit.path / UNIT_ROW).exists():
    unit.write_text(UNIT_ROW, json.dumps(row, indent=2) + "\n")


def unit_row(run_dir: RunDir, name: str) -> dict | None:
  """A finished unit's row: its `size.json`, or, in a run directory from
  before shards, its row in the sweep's metrics; None while unfinished."""
  path = run_dir.path / "sizes" / name / UNIT_ROW
  if path.exists():
    return json.loads(path.read_text())
  for row in run_dir.read_metrics():
    if row.get("kind") == "size" and row.get("size") == name:
      return row
  return None


def _one_shard(run, config, workdir, shard: Shard) -> None:
  config.shard = shard.label
  config.workers = 1
  run(config, workdir)


def run_workers(run, config, workdir, workers: int) -> None:
  """Runs `workers` shards of `run` as processes (spawned: each starts its
  own JAX) and waits for all; a shard that fails is named."""
  context = multiprocessing.get_context("spawn")
  processes = [
    context.Process(
      target=_one_shard,
      args=(
        run,
        config.copy_and_resolve_references(),
        str(workdir),
        Shard(i, workers),
      ),
    )  # fmt: skip
    for i in range(1, workers + 1)
  ]
  for process in processes:
    process.start()
  for process in processes:
    process.join()
  failed = [
    f"{i}/{workers}"
    for i, process in enumerate(processes, 1)
    if process.exitcode != 0
  ]
  if failed:
    raise RuntimeError(
      f"shards {failed} failed (their output says why); run the same "
      "command again to resume them."
    )
