"""The selected tests in shares of about equal expected time, for CI.

`--share=i/n` keeps the i-th of n shares. A share takes whole test files:
the tests of one file share compiled programs and experiment runs, so
splitting a file would pay for them twice. Files are packed largest first
by the seconds stored in `slow_durations.json` beside this (a test not
stored there counts as the stored tests' mean). `--store-durations` writes
that file from the run.
"""

import collections
import json
import pathlib

import pytest

DURATIONS = pathlib.Path(__file__).with_name("slow_durations.json")


def parse(text: str) -> tuple[int, int]:
  """(i, n) of `--share=i/n`; a usage error names what is valid."""
  try:
    i, n = (int(part) for part in text.split("/"))
  except ValueError:
    raise pytest.UsageError(
      f"--share={text!r} is not 'i/n' (for example 2/4)"
    ) from None
  if not 1 <= i <= n:
    raise pytest.UsageError(f"--share={text!r}: i must be in 1..n")
  return i, n


def _file(item) -> str:
  return item.nodeid.split("::")[0]


def split(items, share: tuple[int, int], seconds: dict[str, float]):
  """(kept, dropped) items of `share`: whole files, packed largest first
  onto the least loaded share."""
  i, n = share
  mean = sum(seconds.values()) / len(seconds) if seconds else 1.0
  per_file = collections.Counter()
  for item in items:
    per_file[_file(item)] += seconds.get(item.nodeid, mean)
  load = [0.0] * n
  owner = {}
  for name, cost in sorted(per_file.items(), key=lambda f: (-f[1], f[0])):
    least = min(range(n), key=lambda s: (load[s], s))
    load[least] += cost
    owner[name] = least
  kept = [item for item in items if owner[_file(item)] == i - 1]
  dropped = [item for item in items if owner[_file(item)] != i - 1]
  return kept, dropped


def stored() -> dict[str, float]:
  return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def store(seconds: dict[str, float]) -> None:
  """Merges `seconds` (test id -> setup, call and teardown) into the file."""
  merged = {**stored(), **{k: round(v, 2) for k, v in seconds.items()}}
  DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1))
