"""What every launcher does after parsing its flags."""

from __future__ import annotations

import json
import sys


def run_and_print(
  run, config, workdir, *, restart: bool = False, failed=None
) -> int:
  """Runs an experiment and prints its result as JSON.

  A bad config, a busy or mismatched run directory, or a NaN result prints
  one line saying what was wrong and what is valid, and exits with 2 (no
  traceback: the message is the whole answer). `failed(result)` True (an
  audited kernel that failed) exits with 1.
  """
  try:
    result = run(config, workdir, restart=restart)
  except (ValueError, RuntimeError, FloatingPointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(result, indent=2, default=str))
  return 1 if failed is not None and failed(result) else 0
