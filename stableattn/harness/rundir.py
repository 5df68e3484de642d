"""A run directory: config.json, metrics.jsonl, summary.csv, report.md, PNGs.

`metrics.jsonl` holds one JSON object per line. Lines are appended whole
(one write, then flush and fsync); a line damaged by an interrupted run is
dropped when the file is opened again, and every other line is kept, so a
restarted run never reads or leaves a corrupt row and never loses a good one.

A run directory is bound to its config: `bind_config` refuses a rerun whose
config differs in a field that can change a result, and `lock` refuses a
second process writing to the same directory.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import math
import os
import pathlib
import shutil
from collections.abc import Iterable

from stableattn.harness import machine_twin

# Files and folders a restart removes: everything a run wrote.
RUN_OUTPUTS = (
  "metrics.jsonl",
  "summary.csv",
  "report.md",
  "headline.json",
  "config.json",
  "config_history.jsonl",
  "checkpoints",
  "machine_twin",  # the other-machine run of the training experiments
  "sizes",  # one drift study per model size (drift scaling)
  machine_twin.CONFIG_NAME,  # the config that run was started with
)


def _json_default(value):
  if hasattr(value, "item"):  # NumPy scalars
    return value.item()
  if isinstance(value, tuple):
    return list(value)
  raise TypeError(f"not JSON serializable: {type(value).__name__}")


def to_json_line(row: dict) -> str:
  # NaN and Inf are results: written as JSON's NaN/Infinity extensions,
  # which Python's json reads back.
  return json.dumps(row, default=_json_default, sort_keys=True) + "\n"


class RunDir:
  """Reads and writes the files of one run."""

  def __init__(self, workdir: str | os.PathLike):
    if not str(workdir).strip():
      raise ValueError(
        "workdir is empty; name a directory for the run's files, e.g. "
        "--workdir=runs/forward."
      )
    self.path = pathlib.Path(workdir)
    self.path.mkdir(parents=True, exist_ok=True)
    self.metrics_path = self.path / "metrics.jsonl"

  def write_config(self, config_dict: dict) -> None:
    text = json.dumps(
      config_dict, indent=2, sort_keys=True, default=_json_default
    )
    self.write_text("config.json", text + "\n")

  @contextlib.contextmanager
  def lock(self, wait: bool = False):
    """Holds an exclusive lock on the directory; a second run is refused
    (`wait`: waits for it instead, for the brief steps shards share)."""
    with open(self.path / "run.lock", "w") as f:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
      except BlockingIOError:
        raise RuntimeError(
          f"Another run is writing to {self.path} (run.lock is held). Wait "
          "for it to finish, or use another --workdir."
        ) from None
      try:
        yield self
      finally:
        fcntl.flock(f, fcntl.LOCK_UN)

  def bind_config(
    self,
    config_dict: dict,
    *,
    extendable: Iterable[str] = (),
    restart: bool = False,
  ) -> dict[str, tuple]:
    """Binds the directory to a config; refuses one that changes results.

    Args:
      config_dict: the run's config as a (nested) dict.
      extendable: dotted field names whose change only adds measurements
        (e.g. more seeds); a rerun may change them.
      restart: remove every output of an earlier run first.

    Returns:
      {field: (stored, new)} of the extendable fields that changed (also
      appended to config_history.jsonl), so the report can say so.

    Raises:
      ValueError: naming every differing field that can change a result,
        and the ways out.
    """
    if restart:
      self.clear()
    stored_path = self.path / "config.json"
    changed: dict[str, tuple] = {}
    if stored_path.exists():
      stored = _flatten(json.loads(stored_path.read_text()))
      new = _flatten(json.loads(json.dumps(config_dict, default=_json_default)))
      differing = {
        k: (stored.get(k, "<absent>"), new.get(k, "<absent>"))
        for k in sorted(set(stored) | set(new))
        if stored.get(k, "<absent>") != new.get(k, "<absent>")
      }
      blocking = {k: v for k, v in differing.items() if k not in extendable}
      if blocking:
        fields = "; ".join(
          f"{k}: {old!r} there, {now!r} now"
          for k, (old, now) in blocking.items()
        )
        raise ValueError(
          f"{self.path} holds a run with another config, which would mix "
          f"old and new results. Differing fields: {fields}. Use a new "
          "--workdir, or pass --restart (restart=True from Python) to "
          "delete the earlier run's results"
          + (
            f" (only {sorted(extendable)} may change to extend a run)."
            if extendable
            else "."
          )
        )
      changed = differing
      if changed:
        with open(self.path / "config_history.jsonl", "a") as f:
          f.write(
            to_json_line({"extended": {k: list(v) for k, v in changed.items()}})
          )
    self.write_config(config_dict)
    return changed

  def clear(self) -> None:
    """Removes every output of an earlier run (not the lock)."""
    for name in RUN_OUTPUTS:
      target = self.path / name
      if target.is_dir():
        shutil.rmtree(target)
      elif target.exists():
        target.unlink()
    for png in self.path.glob("*.png"):
      png.unlink()

  def start_afresh(self, config_dict: dict, restart: bool) -> None:
    """For runs measured anew each time (timings, audits): the config and
    an empty metrics file; `restart` also removes earlier outputs."""
    if restart:
      self.clear()
    self.write_config(config_dict)
    self.rewrite_metrics([])

  def read_metrics(self) -> list[dict]:
    """Every intact row; drops only lines an interrupted write damaged."""
    if not self.metrics_path.exists():
      return []
    raw = self.metrics_path.read_text()
    rows, kept, dropped = [], [], 0
    for line in raw.splitlines(keepends=True):
      try:
        row = json.loads(line) if line.endswith("\n") else None
      except json.JSONDecodeError:
        row = None
      if isinstance(row, dict):
        rows.append(row)
        kept.append(line)
      else:
        dropped += 1
    if dropped:
      self.write_text("metrics.jsonl", "".join(kept))
    return rows

  def rewrite_metrics(self, rows: Iterable[dict]) -> None:
    """Replaces metrics.jsonl atomically with `rows`."""
    self.write_text("metrics.jsonl", "".join(to_json_line(r) for r in rows))

  def append_metrics(self, rows: Iterable[dict]) -> None:
    """Appends rows in one write, so a group of rows lands whole or not."""
    text = "".join(to_json_line(row) for row in rows)
    if not text:
      return
    if self.metrics_path.exists() and self.metrics_path.stat().st_size:
      with open(self.metrics_path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
          # A cut line: end it, so this row does not fuse with its remains.
          text = "\n" + text
    with open(self.metrics_path, "a", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())

  def write_text(self, name: str, text: str) -> pathlib.Path:
    """Writes a file atomically (temporary file, then rename)."""
    target = self.path / name
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
    return target

  def write_csv(self, name: str, rows: list[dict]) -> pathlib.Path:
    columns: list[str] = []
    for row in rows:
      columns.extend(c for c in row if c not in columns)
    target = self.path / name
    with open(target, "w", newline="", encoding="utf-8") as f:
      writer = csv.DictWriter(f, fieldnames=columns)
      writer.writeheader()
      for row in rows:
        writer.writerow({c: _csv_value(row.get(c)) for c in columns})
    return target


def _flatten(tree: dict, prefix: str = "") -> dict:
  """{'a.b': leaf} of a nested dict."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_flatten(value, name + "."))
    else:
      out[name] = value
  return out


def _csv_value(value):
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, (list, tuple)):
    return " ".join(str(v) for v in value)
  return value


AFRESH = None  # `extendable` of a run measured anew each time


@contextlib.contextmanager
def opened(workdir, config, *, restart: bool, extendable=AFRESH):
  """The run directory of one experiment run, locked for it and bound to
  its config; every experiment's `run` starts here, in this order.

  extendable: the dotted config fields a rerun may change to extend the
    run (it resumes, skipping what is measured); `AFRESH`: every run
    starts with empty metrics (timings, audits).

  Yields (run_dir, extended): `extended` maps each extendable field that
  changed to (stored, new), for the report to say so.
  """
  run_dir = RunDir(workdir)
  with run_dir.lock():
    if extendable is AFRESH:
      run_dir.start_afresh(config.to_dict(), restart)
      extended = {}
    else:
      extended = run_dir.bind_config(
        config.to_dict(), extendable=extendable, restart=restart
      )
    yield run_dir, extended
