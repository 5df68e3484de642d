"""What every launcher does: its flags, then the run and its printed result."""

from __future__ import annotations

import json
import pathlib
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


def launch(
  launcher_file: str,
  run,
  *,
  config: str,
  workdir: str,
  workdir_holds: str,
  before_run=None,
  failed=None,
) -> None:
  """Defines a launcher's flags and runs it under absl.

  Flags: --config (`configs/<config>` beside the launcher's folder, with
  an optional :variant, and --config.field overrides), --workdir (default
  `workdir`; it holds `workdir_holds`) and --restart.
  `before_run(config)` runs after the flags are parsed and before the
  experiment (e.g. to simulate CPU devices before JAX starts); `failed`
  is `run_and_print`'s.
  """
  from absl import app, flags
  from ml_collections import config_flags

  configs = pathlib.Path(launcher_file).resolve().parent.parent / "configs"
  config_flags.DEFINE_config_file(
    "config",
    str(configs / config),
    "Experiment configuration file (with an optional :variant).",
  )
  flags.DEFINE_string("workdir", workdir, f"Directory for {workdir_holds}.")
  flags.DEFINE_bool(
    "restart",
    False,
    "Delete the results of an earlier run in --workdir before running.",
  )

  def main(argv):
    del argv
    parsed = flags.FLAGS.config
    if before_run is not None:
      before_run(parsed)
    return run_and_print(
      run,
      parsed,
      flags.FLAGS.workdir,
      restart=flags.FLAGS.restart,
      failed=failed,
    )

  app.run(main)
