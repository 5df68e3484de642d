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
# The flags every command has (its --help lists them as its own).
COMMON_FLAGS = ("config", "workdir", "restart", "json", "compilation_cache")


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
  for name in COMMON_FLAGS:
    flags.FLAGS.register_flag_by_module(argv[0], flags.FLAGS[name])


def _variants(config: str) -> list[str]:
  import importlib

  module = importlib.import_module(f"stableattn.configs.{config[:-3]}")
  return list(getattr(module, "VARIANTS", ()))


def _config_value(argv) -> str | None:
  return next(
    (a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None
  )


def missing_config_file(argv, config: str) -> str | None:
  """One line when --config names a file that does not exist."""
  value = _config_value(argv)
  if value is None:
    return None
  path = value.split(":", 1)[0]
  if pathlib.Path(path).is_file():
    return None
  return (
    f"--config: no config file {path!r}; valid: a variant of "
    f"configs/{config} ({', '.join(_variants(config))}) or an existing "
    "file.py[:variant]."
  )


def _error_line(error: BaseException) -> str:
  """The line of an error that says what was wrong: the innermost
  "SomethingError: ..." line absl wraps, or the message's first line."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  for line in reversed(lines):
    name, sep, rest = line.partition(": ")
    if sep and name.endswith(("Error", "Exception")) and name.isidentifier():
      return rest
  text = lines[0] if lines else type(error).__name__
  return text.removeprefix("FATAL Flags parsing error: ")


def unknown_field(argv, config: str, error: BaseException) -> str:
  """One line naming the --config.<field> override the config lacks and
  the fields it has there."""
  import ml_collections

  name = str(error).strip("\"'")
  given = [a for a in argv if a.startswith("--config.")]
  culprit = next(
    (a for a in given if name in a.split("=", 1)[0].split(".")),
    given[0] if given else "--config.<field>",
  )
  dotted = culprit.split("=", 1)[0].removeprefix("--config.").split(".")
  valid, found = [], []
  try:
    node = _load_config(argv, config)
    for part in dotted[:-1]:
      if not (isinstance(node, ml_collections.ConfigDict) and part in node):
        break
      node, found = node[part], [*found, part]
    if isinstance(node, ml_collections.ConfigDict):
      valid = sorted(node.keys())
  except Exception:  # noqa: BLE001 - the fields are a hint, not the error
    valid = []
  where = ".".join(["config", *found])
  hint = f"; valid fields of {where}: {valid}" if valid else ""
  return f"{culprit.split('=', 1)[0]}: no such config field{hint}."


def _load_config(argv, config: str):
  """The config --config names, without the command line's overrides."""
  import importlib.util

  value = _config_value(argv) or str(CONFIGS / config)
  path, _, variant = value.partition(":")
  spec = importlib.util.spec_from_file_location("_config_of_command", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant or None)


def parse_flags(argv, config: str, shortcuts=()) -> list[str]:
  """absl's flags of a command, parsed; a bad value (a config file that
  does not exist, an unknown variant, flag or field, an ill-typed value)
  prints one line saying what was wrong and what is valid and exits 2."""
  from absl import flags

  message = missing_config_file(argv[1:], config)
  if message is None:
    try:
      return flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as e:
      valid = [*COMMON_FLAGS, "config.<field>", *shortcuts]
      message = (
        f"{_error_line(e)}; valid: {', '.join('--' + v for v in valid)}."
      )
    except (AttributeError, KeyError) as e:
      message = unknown_field(argv, config, e)
    except (flags.Error, ValueError, TypeError, OSError) as e:
      message = _error_line(e)
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


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
  try:
    # config_flags defines a flag per --config.<field> here, from argv.
    _define_flags(argv, config, workdir, workdir_holds)
  except (AttributeError, KeyError) as e:
    print(f"error: {unknown_field(argv, config, e)}", file=sys.stderr)
    sys.exit(2)
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

  app.run(
    main,
    argv=argv,
    flags_parser=lambda args: parse_flags(args, config, shortcuts),
  )
