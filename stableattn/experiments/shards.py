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
shards as processes here, then the report. `run_units` is that sweep,
for any study.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import re
import time

from stableattn.harness.config_values import field
from stableattn.harness.rundir import RunDir

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


def run_units(
  run, config, workdir, names, train, report, *, restart, extendable
) -> dict:
  """A sweep of units spread by `config.shard` and `config.workers`.

  run: the sweep's own entry point (what a worker process calls).
  names: the units, in the configured order; each trains into
    `<workdir>/sizes/<name>`.
  train(index, directory): trains unit `index` (resuming) and returns its
    row, or None where its study stopped early (at `stop_at_step`).
  report(run_dir, rows): writes the report once every unit is done.
  extendable: the config fields a rerun may change besides the spread.
  """
  shard = Shard.parse(config.get("shard", "1/1"))
  workers = field(config, "workers", minimum=1) if "workers" in config else 1
  if (restart or workers > 1) and shard.count > 1:
    raise ValueError(
      f"config.shard={shard.label} with "
      f"{'--restart' if restart else 'config.workers'}: a shard neither "
      "restarts the whole sweep nor spreads itself; use config.shard=1/1."
    )
  run_dir = RunDir(workdir)
  with run_dir.lock(wait=True):  # shards share the directory: bind only
    run_dir.bind_config(
      config.to_dict(),
      extendable=tuple(extendable) + SPREAD_FIELDS,
      restart=restart,
    )
  if workers > 1:
    run_workers(run, config, workdir, workers)
  for index, name in enumerate(names):
    if workers > 1 or not shard.takes(index):
      continue
    directory = run_dir.path / "sizes" / name
    started = time.time()
    row = train(index, directory)
    if row is None:
      return {"workdir": str(run_dir.path), "stopped_in": name}
    record_unit(directory, {**row, "seconds": round(time.time() - started, 1)})
  rows = [unit_row(run_dir, name) for name in names]
  waiting = [name for name, row in zip(names, rows) if row is None]
  if waiting:  # another shard's units: the last to finish reports
    return {"workdir": str(run_dir.path), "shard": shard.label,
            "waiting_for": waiting}  # fmt: skip
  with run_dir.lock(wait=True):
    return report(run_dir, rows)
