"""The worked example of docs/audit.md: a kernel project outside this
repository installs stableattn's wheel and gates its kernel with the
audit and a baseline of known findings."""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "docs" / "kernel_project"
BROKEN = """
    acc = acc * rescale[..., None] + pv"""
NEW_BUG = """
    acc = acc + pv  # the running max's rescale forgotten"""


def _run(command, cwd, env, timeout=600):
  done = subprocess.run(
    command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
  )
  return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """A new virtual environment outside the repository with stableattn's
  wheel installed (its dependencies are this environment's, reached by a
  path file, so nothing is downloaded), and the example project copied."""
  root = tmp_path_factory.mktemp("outside")
  wheels = root / "wheels"
  code, said = _run(
    [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
     "-q", "-w", str(wheels), str(REPO)],
    cwd=root, env=dict(os.environ),
  )  # fmt: skip
  assert code == 0, said[-3000:]
  (wheel,) = wheels.glob("stableattn-*.whl")
  venv = root / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  python = venv / "bin" / "python"
  purelib = subprocess.run(
    [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    capture_output=True, text=True, check=True,
  ).stdout.strip()  # fmt: skip
  deps = sysconfig.get_paths()["purelib"]
  pathlib.Path(purelib, "deps_of_the_test.pth").write_text(deps + "\n")
  code, said = _run(
    [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
     str(wheel)],
    cwd=root, env=dict(os.environ),
  )  # fmt: skip
  assert code == 0, said[-3000:]
  project = root / "project"
  shutil.copytree(EXAMPLE, project)
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("PYTHONPATH", "STABLEATTN_BASELINE")
  }
  env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
  return {"python": str(python), "project": project, "env": env, "wheel": wheel}


@pytest.mark.slow
def test_the_wheel_carries_the_checkouts_configs_unchanged(installed):
  with zipfile.ZipFile(installed["wheel"]) as wheel:
    packaged = {
      pathlib.PurePosixPath(name).name: wheel.read(name)
      for name in wheel.namelist()
      if name.startswith("stableattn/configs/")
    }
  own = {p.name: p.read_bytes() for p in (REPO / "configs").glob("*.py")}
  assert "audit.py" in own and packaged == own


@pytest.mark.slow
def test_the_wheel_runs_outside_the_repository(installed):
  python, env = installed["python"], installed["env"]
  code, said = _run(
    [python, "-c", "import stableattn; print(stableattn.__file__)"],
    cwd=installed["project"], env=env,
  )  # fmt: skip
  assert "site-packages" in said and str(REPO) not in said, said
  for command in (["stableattn"], [python, "-m", "stableattn"]):
    code, said = _run(
      [*command, "audit", "--config.kernel=xla", "--workdir=runs/xla"],
      cwd=installed["project"], env=env,
    )  # fmt: skip
    assert code == 0, said[-3000:]
    assert "xla: PASSED" in said
  # A variant by name finds the wheel's configs, with no checkout about.
  code, said = _run(
    ["stableattn", "audit", "--config=smoke", "--config.kernel=xla",
     "--workdir=runs/xla_smoke"],
    cwd=installed["project"], env=env,
  )  # fmt: skip
  assert code == 0 and "xla: PASSED" in said, said[-3000:]


@pytest.mark.slow
def test_the_example_passes_with_its_baseline_and_fails_on_a_new_bug(
  installed, tmp_path
):
  python, env = installed["python"], installed["env"]
  project = tmp_path / "project"
  shutil.copytree(installed["project"], project)
  code, said = _run([python, "-m", "pytest", "-q"], cwd=project, env=env)
  assert code == 0, said[-3000:]
  code, said = _run(
    [python, "-m", "pytest", "-q", "--stableattn-baseline=none.json"],
    cwd=project, env=env,
  )  # fmt: skip
  assert code == 1 and "no baseline at none.json" in said, said[-3000:]
  audit = [
    "stableattn", "audit", "--config=smoke",
    "--config.kernel=tiny_attention:attention",
    "--config.precisions=bf16-framework", "--config.regimes=tied_maxima",
    "--baseline=audit_baseline.json", "--junit=audit.xml",
  ]  # fmt: skip
  code, said = _run(audit, cwd=project, env=env)
  assert code == 0 and "1 known" in said, said[-3000:]
  kernel = project / "tiny_attention.py"
  source = kernel.read_text()
  assert BROKEN in source
  kernel.write_text(source.replace(BROKEN, NEW_BUG))
  code, said = _run(
    [python, "-m", "pytest", "-q", "-x", "test_tiny_attention.py"],
    cwd=project, env=env,
  )  # fmt: skip
  assert code == 1, said[-3000:]
  assert "new and 0 worse failures against" in said
  assert "reproduce: stableattn audit" in said
  code, said = _run(audit, cwd=project, env=env)
  assert code == 1 and "new" in said, said[-3000:]
