"""The machine and software a result came from, and the same machine one
instruction set down.

XLA compiles for the host: its vector width and instruction selection
(fused multiply-add or not, the order of a vectorized reduction) decide
how a program rounds, so the same training run gives other bits on
another CPU or GPU. Every run records what it ran on (`describe`), and
the training experiments rerun their base run compiled for another
instruction set (`other_machine_flags`) as a reference pair: the
deviation practitioners already accept when they move a job to other
hardware.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import subprocess
import sys

import jax
import numpy as np

# XLA's CPU instruction sets (`--xla_cpu_max_isa`), lowest first. Only
# the steps that change code generation on x86 are listed.
X86_ISAS = ("SSE4_2", "AVX", "AVX2", "AVX512")
# /proc/cpuinfo flag that marks each of them.
_ISA_FLAGS = {
  "SSE4_2": "sse4_2",
  "AVX": "avx",
  "AVX2": "avx2",
  "AVX512": "avx512f",
}
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes")
_MAX_ISA = re.compile(r"--xla_cpu_max_isa=(\w+)")


def _cpuinfo() -> str:
  try:
    return pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return ""


def cpu_model() -> str:
  """The CPU's model name ('' where the platform does not say)."""
  for line in _cpuinfo().splitlines():
    if line.lower().startswith("model name"):
      return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine()


def host_isa() -> str | None:
  """The highest x86 instruction set of `X86_ISAS` the CPU has; None off
  x86 or where /proc/cpuinfo is unreadable."""
  flags: set[str] = set()
  for line in _cpuinfo().splitlines():
    if line.lower().startswith("flags"):
      flags = set(line.split(":", 1)[1].split())
      break
  have = [isa for isa in X86_ISAS if _ISA_FLAGS[isa] in flags]
  return have[-1] if have else None


def xla_flags() -> str:
  return os.environ.get("XLA_FLAGS", "").strip()


def compiled_isa(flags: str | None = None) -> str | None:
  """The instruction set XLA compiles CPU code for: the host's, capped by
  `--xla_cpu_max_isa` in `flags` (default: this process's XLA_FLAGS)."""
  host = host_isa()
  if host is None:
    return None
  capped = _MAX_ISA.findall(xla_flags() if flags is None else flags)
  if not capped or capped[-1].upper() not in X86_ISAS:
    return host
  return min(host, capped[-1].upper(), key=X86_ISAS.index)


def other_machine_flags() -> tuple[str | None, str]:
  """(XLA_FLAGS of the same run on another machine, its label), or
  (None, why not).

  On a CPU: the highest instruction set below the one XLA compiles for
  now whose program rounds otherwise (AVX2 -> AVX: no fused
  multiply-add), found by compiling a probe training step under each; None
  with "identical on this host" if none does. On a GPU: autotuning off, so
  XLA takes its default algorithms instead of the fastest it measured.
  """
  backend = jax.default_backend()
  current = xla_flags()
  if backend == "gpu":
    return f"{current} --xla_gpu_autotune_level=0".strip(), "no autotuning"
  if backend != "cpu":
    return None, f"no other-machine setting is known for {backend!r}"
  isa = compiled_isa()
  if isa is None:
    return None, (
      f"the instruction set of this CPU ({platform.machine()}) is not one "
      f"XLA's --xla_cpu_max_isa orders ({', '.join(X86_ISAS)})"
    )
  position = X86_ISAS.index(isa)
  if position == 0:
    return None, f"XLA already compiles for the lowest instruction set, {isa}"
  kept = _MAX_ISA.sub("", current).strip()
  here = program_digest(current)
  same = []
  # Down from the next instruction set until the program changes: on an
  # AVX-512 host XLA can compile the same arithmetic for AVX2.
  for lower in reversed(X86_ISAS[:position]):
    flags = f"{kept} --xla_cpu_max_isa={lower}".strip()
    if program_digest(flags) != here:
      return flags, lower
    same.append(lower)
  return None, (
    f"identical on this host: XLA compiles the same program for "
    f"{', '.join(same)} as for {isa} (a probe training step, bit for bit)"
  )


# The probe's program, run in a process of its own.
PROBE_MODULE = "stableattn.experiments.machine_probe"
# Digests the probe gave in this process, by the instruction set it ran
# for (recorded by `describe`).
PROBED: dict[str, str] = {}


@functools.cache
def program_digest(flags: str) -> str:
  """The bits of a small training step (`machine_probe`) compiled under
  XLA_FLAGS `flags`, in a fresh process (flags act when JAX starts); kept
  beside JAX's compilation cache, where one is set, for the next process
  on this machine and software (a probe costs 1.3 s)."""
  key = _probe_key(flags)
  stored = _stored_probes()
  digest = stored.get(key) or _run_probe(flags)
  if key not in stored:
    _store_probe(key, digest)
  PROBED[compiled_isa(flags) or flags] = digest[:16]
  return digest


def _probe_file() -> pathlib.Path | None:
  folder = jax.config.jax_compilation_cache_dir
  return pathlib.Path(folder) / "machine_probe.json" if folder else None


def _probe_key(flags: str) -> str:
  """What a probe's bits depend on: the flags, the CPU, the software and
  the probe's own source."""
  spec = importlib.util.find_spec(PROBE_MODULE)  # found, not imported
  source = pathlib.Path(spec.origin).read_bytes()
  parts = [
    flags,
    cpu_model(),
    host_isa() or platform.machine(),
    *(f"{p}={_version(p)}" for p in ("jax", "jaxlib", "numpy")),
    hashlib.sha256(source).hexdigest(),
  ]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _stored_probes() -> dict:
  path = _probe_file()
  try:
    return json.loads(path.read_text()) if path else {}
  except (OSError, ValueError):  # none yet, or a write cut short
    return {}


def _store_probe(key: str, digest: str) -> None:
  path = _probe_file()
  if path is None:
    return
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {**_stored_probes(), key: digest}
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(kept, indent=1) + "\n")
    os.replace(partial, path)  # whole or not at all for a reader
  except OSError:  # a read-only cache folder: probe again next time
    pass


def _run_probe(flags: str) -> str:
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    [sys.executable, "-m", PROBE_MODULE],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  if done.returncode != 0:
    raise RuntimeError(
      f"the machine probe failed under XLA_FLAGS={flags!r}: "
      f"{done.stderr.strip().splitlines()[-1:]}"
    )
  return done.stdout.strip().splitlines()[-1]


def corpus_digest(*arrays: np.ndarray) -> str:
  """SHA-256 of token arrays' bytes (the standard-library corpus is the
  running interpreter's library, which changes between Python releases)."""
  digest = hashlib.sha256()
  for array in arrays:
    digest.update(np.ascontiguousarray(array).tobytes())
  return digest.hexdigest()


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _gpu_driver() -> str | None:
  try:
    text = pathlib.Path("/proc/driver/nvidia/version").read_text()
  except OSError:
    return None
  found = re.search(r"Kernel Module\s+([\d.]+)", text)
  return found.group(1) if found else text.splitlines()[0].strip()


def describe(corpus: str | None = None) -> dict:
  """What this process computes on: the machine, the instruction set XLA
  compiles for (or the GPU and its driver), Python and package versions,
  XLA flags, device counts, and the corpus digest when given."""
  devices = jax.devices()
  env = {
    "backend": jax.default_backend(),
    "cpu": cpu_model(),
    "xla_cpu_isa": compiled_isa(),
    "python": platform.python_version(),
    **{p: _version(p) for p in PACKAGES},
    "xla_flags": xla_flags(),
    "device_count": len(devices),
    "process_count": jax.process_count(),
    "platform": sys.platform,
  }
  if env["backend"] == "gpu":
    env["gpu"] = devices[0].device_kind
    env["gpu_driver"] = _gpu_driver()
  if PROBED:
    # Which instruction sets compile the same program (equal digests).
    env["isa_probe"] = dict(PROBED)
  from stableattn.ops.flash_choice import paths_taken  # imports kernels

  taken = paths_taken()
  if taken:
    # implementation="flash" picks its kernel per call: which ones ran.
    env["flash_paths"] = taken
  if corpus is not None:
    env["corpus_sha256"] = corpus
  return env


def summary_line(env: dict) -> str:
  """The environment in one Markdown line, for a report's head."""
  if env.get("backend") == "gpu":
    machine = f"{env.get('gpu')} (driver {env.get('gpu_driver')})"
  else:
    machine = f"{env.get('cpu')} (XLA compiles for {env.get('xla_cpu_isa')})"
  parts = [
    machine,
    f"Python {env.get('python')}",
    f"jax {env.get('jax')}, jaxlib {env.get('jaxlib')}",
    f"flax {env.get('flax')}, optax {env.get('optax')}, "
    f"numpy {env.get('numpy')}",
    f"{env.get('device_count')} device(s)",
    f"XLA_FLAGS {env.get('xla_flags') or 'unset'}",
  ]
  if env.get("flash_paths"):
    taken = ", ".join(f"{p} ({n} calls)" for p, n in env["flash_paths"].items())
    parts.append(f"'flash' ran {taken}")
  if env.get("corpus_sha256"):
    parts.append(f"corpus sha256 {env['corpus_sha256'][:16]}")
  return "*Environment:* " + "; ".join(parts) + "."
