"""What every launcher does: its flags, then the run and its printed result."""

from __future__ import annotations

import json
import os
import pathlib
import sys


def run_and_print(
  run,
  config,
  workdir,
  *,
  restart: bool = False,
  failed=None,
  as_json: bool = False,
  summarize=None,
) -> int:
  """Runs an experiment and prints its result: a short summary for a
  person (`summarize(result)`, or `summary`), or with `as_json` the
  result as JSON, for a program.

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
  if as_json:
    print(json.dumps(result, indent=2, default=str))
  else:
    print((summarize or summary)(result))
  return 1 if failed is not None and failed(result) else 0


FIRST_WORDS = ("verdict", "passed", "claim", "trend")


def summary(result: dict, most: int = 12) -> str:
  """A result's scalar entries, one per line, and where its report is
  (the full result is the run directory's; `--json` prints it)."""
  lines = []
  for key, value in result.items():
    if key in ("workdir", "environment"):
      continue
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
      value = ", ".join(value)  # names: the sizes a shard waits for
    inner = value.items() if isinstance(value, dict) else [("", value)]
    for name, leaf in inner:  # a verdict table's entries, one level down
      if isinstance(leaf, (str, int, float, bool)):
        lines.append(f"  {key}{'.' if name else ''}{name}: {leaf}")
  # The verdicts first: what a person reads the run for.
  lines.sort(key=lambda line: not any(w in line for w in FIRST_WORDS))
  shown = lines[:most]
  if len(lines) > most:
    shown.append(f"  ... {len(lines) - most} more (--json)")
  where = pathlib.Path(str(result.get("workdir", ".")))
  report = where / "report.md"
  return "\n".join(
    [*shown, f"  report: {report if report.exists() else where}"]
  )


CACHE_VARIABLE = "STABLEATTN_COMPILATION_CACHE"


def use_compilation_cache(folder: str) -> None:
  """JAX's persistent cache in `folder`, for every program: the audit
  compiles hundreds of small ones (0.2 s each on a CPU), each under JAX's
  default threshold of 1 s for caching."""
  import jax

  jax.config.update("jax_compilation_cache_dir", str(folder))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _configs_folder() -> pathlib.Path:
  """Where the command configs are: `configs/` at the top of a checkout,
  or the wheel's `stableattn/configs/` (one package, two homes)."""
  import stableattn.configs

  return pathlib.Path(stableattn.configs.__file__).resolve().parent


CONFIGS = _configs_folder()


def config_argument(
  argv: list[str], config: str, shortcuts: tuple[str, ...] = ()
) -> list[str]:
  """`argv` with a bare variant name given to --config (`--config=smoke`)
  spelled as the command's packaged file (`.../configs/audit.py:smoke`),
  so an installed wheel needs no path; a value naming a `.py` file, with
  or without `:variant`, passes unchanged. `--name=value` for a name in
  `shortcuts` is `--config.name=value` (`--name` alone: True)."""
  out, it = [], iter(argv)
  for arg in it:
    name, _, given = arg.removeprefix("--").partition("=")
    if arg.startswith("--") and name in shortcuts:
      out.append(f"--config.{name}={given if _ else True}")
      continue
    value = None
    if arg.startswith("--config="):
      value = arg.split("=", 1)[1]
    elif arg == "--config":
      value = next(it, "")
    if value is None:
      out.append(arg)
      continue
    if ".py" not in value:
      value = f"{CONFIGS / config}:{value.removeprefix(':')}"
    out.append(f"--config={value}")
  return out


def _define_flags(argv, config: str, workdir: str, workdir_holds: str):
  """Every command's flags, listed by --help as the command's own."""
  from absl import flags
  from ml_collections import config_flags

  # config_flags finds the --config.field overrides to define in sys.argv.
  sys.argv = argv
  config_flags.DEFINE_config_file(
    "config",
    str(CONFIGS / config),
    "Experiment configuration: a variant's name (`smoke`), or a file with"
    " an optional :variant.",
  )
  flags.DEFINE_string("workdir", workdir, f"Directory for {workdir_holds}.")
  flags.DEFINE_bool(
    "restart",
    False,
    "Delete the results of an earlier run in --workdir before running.",
  )
  flags.DEFINE_bool(
    "json",
    False,
    "Print the whole result as JSON on stdout instead of a short summary.",
  )
  flags.DEFINE_string(
    "compilation_cache",
    os.environ.get(CACHE_VARIABLE, ""),
    "A folder for compiled programs, reused by later runs (a CI lane"
    f" caches it between jobs); also ${CACHE_VARIABLE}. Empty: none.",
  )
  # --help lists the main module's flags: these are the command's.
  for name in ("config", "workdir", "restart", "json", "compilation_cache"):
    flags.FLAGS.register_flag_by_module(argv[0], flags.FLAGS[name])


def launch(
  run,
  *,
  config: str,
  workdir: str,
  workdir_holds: str,
  before_run=None,
  failed=None,
  summarize=None,
  argv: list[str] | None = None,
  shortcuts: tuple[str, ...] = (),
  usage: str = "",
) -> None:
  """Defines a launcher's flags and runs it under absl.

  Flags: --config (`configs/<config>`, with an optional
  :variant, a variant's name alone, or another file; --config.field
  overrides), --workdir (default `workdir`; it holds `workdir_holds`) and
  --restart. `before_run(config)` runs after the flags are parsed and
  before the experiment (e.g. to simulate CPU devices before JAX starts);
  `failed` and `summarize` are `run_and_print`'s. --json prints the whole
  result as JSON instead of the summary. `argv` (the program's name
  first) defaults to sys.argv; `shortcuts` are config fields that are
  flags of their own (`--junit=PATH` for `--config.junit=PATH`); `usage`
  heads --help.
  """
  from absl import app, flags

  argv = list(sys.argv if argv is None else argv)
  argv = [argv[0], *config_argument(argv[1:], config, shortcuts)]
  _define_flags(argv, config, workdir, workdir_holds)
  if usage:
    sys.modules["__main__"].__doc__ = usage

  def main(argv):
    del argv
    parsed = flags.FLAGS.config
    if flags.FLAGS.compilation_cache:
      use_compilation_cache(flags.FLAGS.compilation_cache)
    if before_run is not None:
      before_run(parsed)
    return run_and_print(
      run,
      parsed,
      flags.FLAGS.workdir,
      restart=flags.FLAGS.restart,
      failed=failed,
      as_json=flags.FLAGS.json,
      summarize=summarize,
    )

  app.run(main, argv=argv)
