"""`stableattn <command> [flags]`: the audit and the experiments from an
installed wheel (also `python -m stableattn`, and `launch/<command>.py`
from a checkout, which run the same code with the same flags).

  stableattn audit --config.kernel=mypackage.kernels:attention
  stableattn audit --config=edges --config.kernel=xla --junit=audit.xml
  stableattn compare runs/audit_v1 runs/audit_v2
  stableattn forward_deviation --config=smoke

`--config=<variant>` picks one of the command's packaged variants
(`configs/<command>.py`); `--config=path/to/file.py[:variant]`
reads another file. The current directory is importable, so a kernel in
`./mymodule.py` is `--config.kernel=mymodule:fn`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A command that runs `module.run(config, workdir)` under its config
  file's flags (commands.launcher.launch)."""

  module: str
  config: str
  workdir: str
  workdir_holds: str
  about: str
  before_run: str | None = None  # a function of commands.device_setup
  # Set (unless already set) before the experiment's module imports JAX.
  environment: tuple[tuple[str, str], ...] = ()
  audit: bool = False  # exit 1 on a failed verdict; the audit's summary
  shortcuts: tuple[str, ...] = ()  # --name for --config.name
  # LLVM's level under XLA:CPU's quicker compiles (`harness.compile_flags`)
  # for a command that compiles many small programs and does not time
  # them; None: XLA's defaults. 0 where each program runs a few times on
  # small tensors (training a small model).
  optimization_level: int | None = 0


EXPERIMENTS = {
  "audit": Experiment(
    "stableattn.auditing.grid",
    "audit.py",
    "runs/audit",
    "config.json, metrics.jsonl, the report and headline.json",
    "is this attention kernel accurate? (exit 0 pass, 1 fail, 2 bad config)",
    audit=True,
    shortcuts=("junit", "baseline", "update_baseline"),
    # The kernel under audit compiled as its users compile it.
    optimization_level=None,
  ),
  "forward_deviation": Experiment(
    "stableattn.experiments.forward",
    "forward_deviation.py",
    "runs/forward_deviation",
    "config.json, metrics.jsonl and the report",
    "the forward-deviation report (the paper's forward claims)",
    before_run="forward_ring_devices",
    # Interpret-mode kernels at length 2,048 run long at level 0: the
    # default run takes 0.79x the time of XLA's defaults at level 1, 1.1x
    # at 0; at 1 its 1,844 summary rows are bit for bit those at XLA's
    # default level 3.
    optimization_level=1,
  ),
  "training_drift": Experiment(
    "stableattn.experiments.training_drift",
    "training_drift.py",
    "runs/training_drift",
    "config.json, metrics.jsonl, checkpoints and the report",
    "weight drift of flash against baseline training, beside seeds",
    before_run="drift_ring_devices",
  ),
  "drift_scaling": Experiment(
    "stableattn.experiments.drift_scaling",
    "drift_scaling.py",
    "runs/drift_scaling",
    "config.json, metrics.jsonl, sizes/ and the report",
    "the drift study at several model sizes, and the trend",
  ),
  "stability": Experiment(
    "stableattn.experiments.stability",
    "stability.py",
    "runs/stability",
    "config.json, metrics.jsonl, the report and figures",
    "learning-rate sensitivity of flash against baseline training",
    before_run="stability_ring_devices",
  ),
  "mismatch": Experiment(
    "stableattn.experiments.mismatch",
    "mismatch.py",
    "runs/mismatch",
    "config.json, metrics.jsonl, the report and figures",
    "training-inference mismatch of the kernels a model trains and serves",
  ),
  "benchmark": Experiment(
    "stableattn.experiments.benchmark",
    "benchmark.py",
    "runs/benchmark",
    "config.json, metrics.jsonl, the report and plots",
    "time and memory of the kernels and presets",
    # Memory is measured per program, not as XLA's preallocated pool.
    environment=(("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),),
    optimization_level=None,
  ),
}
OTHER_COMMANDS = {
  "compare": "two audits key by key: regressions and improvements",
}


def usage() -> str:
  width = max(map(len, [*EXPERIMENTS, *OTHER_COMMANDS]))
  rows = [(n, e.about) for n, e in EXPERIMENTS.items()]
  rows += list(OTHER_COMMANDS.items())
  lines = [f"  {name:<{width}}  {about}" for name, about in rows]
  return "\n".join(
    [
      "usage: stableattn <command> [flags]  (stableattn <command> --help)",
      "",
      "commands:",
      *lines,
    ]
  )


def command_usage(name: str) -> str:
  spec = EXPERIMENTS[name]
  config = importlib.import_module(f"stableattn.configs.{spec.config[:-3]}")
  lines = [
    f"stableattn {name} [flags]: {spec.about}.",
    "",
    f"--config=<variant> picks a variant of configs/{spec.config}",
    f"({', '.join(config.VARIANTS)}), --config=path/to/file.py[:variant]",
    "reads another file, and --config.<field>=value sets a field",
    "(--helpfull lists them).",
  ]
  if spec.shortcuts:
    shortcuts = ", ".join(f"--{s}" for s in spec.shortcuts)
    lines.append(f"{shortcuts}: the same as --config.<name>.")
  return "\n".join(lines)


def use_quick_compiles(level: int) -> None:
  """XLA_FLAGS for quicker CPU compiles at LLVM's `level`, unless JAX's
  backends have started (the flags would not act, and the run would
  record them)."""
  from jax._src import xla_bridge

  from stableattn.harness.compile_flags import quick_cpu_compiles

  if xla_bridge.backends_are_initialized():
    return
  os.environ["XLA_FLAGS"] = quick_cpu_compiles(
    os.environ.get("XLA_FLAGS", ""), level=level
  )


def run_experiment(name: str, argv: list[str]) -> None:
  """Runs EXPERIMENTS[name] with `argv` (the program's name first)."""
  from stableattn.commands import device_setup
  from stableattn.commands.launcher import launch

  if os.getcwd() not in sys.path:  # a kernel beside the user, as `python -m`
    sys.path.insert(0, os.getcwd())
  spec = EXPERIMENTS[name]
  for variable, value in spec.environment:
    os.environ.setdefault(variable, value)
  if spec.optimization_level is not None:
    use_quick_compiles(spec.optimization_level)
  hook = spec.before_run and getattr(device_setup, spec.before_run)

  def run(config, workdir, *, restart: bool = False):
    # Imported once the flags are good: a bad value answers at once.
    module = importlib.import_module(spec.module)
    return module.run(config, workdir, restart=restart)

  extra = {}
  if spec.audit:
    from stableattn.auditing.report import summary_text

    extra = {
      "failed": lambda result: not result["passed"],
      "summarize": summary_text,
    }
  launch(
    run,
    config=spec.config,
    workdir=spec.workdir,
    workdir_holds=spec.workdir_holds,
    before_run=hook,
    argv=argv,
    shortcuts=spec.shortcuts,
    usage=command_usage(name),
    **extra,
  )


def main(argv: list[str] | None = None) -> int:
  """The console script: `stableattn <command> [flags]`."""
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(usage())
    return 0 if len(argv) >= 2 else 2
  name, rest = argv[1], argv[2:]
  program = f"stableattn {name}"
  if name == "compare":
    from stableattn.commands import compare

    return compare.main([program, *rest])
  if name not in EXPERIMENTS:
    valid = ", ".join([*EXPERIMENTS, *OTHER_COMMANDS])
    print(f"error: unknown command {name!r}; valid: {valid}", file=sys.stderr)
    return 2
  run_experiment(name, [program, *rest])
  return 0  # not reached: absl's app.run exits with the command's code


if __name__ == "__main__":
  sys.exit(main())
