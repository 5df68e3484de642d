"""The same run on another machine: a child process whose XLA compiles
for another instruction set (or, on a GPU, without autotuning).

XLA reads its flags once, when the backend starts, so the other machine
must be another process. The parent writes its config to the run
directory, starts `python -m <module> <config.json> <workdir> <label>`
with the other machine's XLA_FLAGS, and waits; the child trains what the
experiment asks of it and writes into the run directory. On Linux the
child dies with its parent (a killed run leaves no orphan writing to the
directory).
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys

import ml_collections

from stableattn.harness import environment

CONFIG_NAME = "machine_twin_config.json"


def _die_with_parent() -> None:
  """Asks Linux to kill this process when its parent dies (elsewhere a
  killed run's child may outlive it). Called by the child itself: a hook
  between fork and exec would run Python in a copy of a multithreaded
  process."""
  if sys.platform != "linux":
    return
  parent = os.getppid()
  pr_set_pdeathsig = 1
  ctypes.CDLL("libc.so.6", use_errno=True).prctl(
    pr_set_pdeathsig, signal.SIGKILL
  )
  if os.getppid() != parent:  # the parent died before the request
    os._exit(1)


class Child:
  """A running child: `module`'s `main` with XLA_FLAGS=`flags`, started
  at once; `wait` raises with the end of its output when it failed."""

  def __init__(
    self,
    module: str,
    config_dict: dict,
    workdir: pathlib.Path,
    flags: str,
    label: str,
  ):
    config_path = pathlib.Path(workdir) / CONFIG_NAME
    config_path.write_text(json.dumps(config_dict, sort_keys=True))
    env = {**os.environ, "XLA_FLAGS": flags}
    # The child must import this package the way the parent does.
    env["PYTHONPATH"] = os.pathsep.join(
      p
      for p in [str(pathlib.Path(__file__).parents[2]), env.get("PYTHONPATH")]
      if p
    )
    self.flags, self.label = flags, label
    self.process = subprocess.Popen(
      [sys.executable, "-m", module, str(config_path), str(workdir), label],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )

  def wait(self) -> None:
    output, _ = self.process.communicate()
    if self.process.returncode:
      tail = "\n".join(output.strip().splitlines()[-15:])
      raise RuntimeError(
        f"The other-machine run ({self.label}, XLA_FLAGS={self.flags!r}) "
        f"failed with exit code {self.process.returncode}:\n{tail}"
      )


def run_child(
  module: str, config_dict: dict, workdir: pathlib.Path, flags: str, label: str
) -> None:
  """Runs `module`'s `main` in a child with XLA_FLAGS=`flags`; raises with
  the end of its output when it fails."""
  Child(module, config_dict, workdir, flags, label).wait()


def child_arguments(argv) -> tuple[ml_collections.ConfigDict, str, str]:
  """(config, workdir, label) of a child; refuses to run on the wrong
  machine (flags that did not take effect would make the pair a rerun)."""
  _die_with_parent()
  if len(argv) != 4:
    raise SystemExit(
      f"usage: python -m {argv[0]} CONFIG.json WORKDIR LABEL (started by "
      "the experiment, not by hand)"
    )
  config_path, workdir, label = argv[1:]
  config = ml_collections.ConfigDict(
    json.loads(pathlib.Path(config_path).read_text())
  )
  isa = environment.compiled_isa()
  if label in environment.X86_ISAS and isa != label:
    raise SystemExit(
      f"the other-machine run should compile for {label}, but XLA compiles "
      f"for {isa} (XLA_FLAGS={environment.xla_flags()!r})."
    )
  return config, workdir, label
