"""A run directory: config.json, metrics.jsonl, summary.csv, report.md, PNGs.

`metrics.jsonl` holds one JSON object per line. Lines are appended whole
(one write, then flush and fsync), and a line cut short by an interrupted
run is dropped when the file is opened again, so a restarted run never
reads or leaves a corrupt row.
"""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
from collections.abc import Iterable


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
    self.path = pathlib.Path(workdir)
    self.path.mkdir(parents=True, exist_ok=True)
    self.metrics_path = self.path / "metrics.jsonl"

  def write_config(self, config_dict: dict) -> None:
    text = json.dumps(
      config_dict, indent=2, sort_keys=True, default=_json_default
    )
    self.write_text("config.json", text + "\n")

  def read_metrics(self) -> list[dict]:
    """All complete rows; drops a trailing partial line left by a crash."""
    if not self.metrics_path.exists():
      return []
    raw = self.metrics_path.read_text()
    rows, good_chars = [], 0
    for line in raw.splitlines(keepends=True):
      if not line.endswith("\n"):
        break
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        break
      good_chars += len(line)
    if good_chars != len(raw):
      self.write_text("metrics.jsonl", raw[:good_chars])
    return rows

  def rewrite_metrics(self, rows: Iterable[dict]) -> None:
    """Replaces metrics.jsonl atomically with `rows`."""
    self.write_text("metrics.jsonl", "".join(to_json_line(r) for r in rows))

  def append_metrics(self, rows: Iterable[dict]) -> None:
    """Appends rows in one write, so a group of rows lands whole or not."""
    text = "".join(to_json_line(row) for row in rows)
    if not text:
      return
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


def _csv_value(value):
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, (list, tuple)):
    return " ".join(str(v) for v in value)
  return value
