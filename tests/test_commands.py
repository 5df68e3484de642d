"""`stableattn <command>`: variants by name, the audit's CI flags as flags
of their own, the command table, and `stableattn compare`."""

import importlib.util
import json
import pathlib
import types

import pytest

from stableattn.commands import compare, launcher
from stableattn.commands import main as commands


def test_a_variant_name_is_the_commands_packaged_file():
  packaged = f"--config={launcher.CONFIGS / 'audit.py'}"
  assert launcher.config_argument(["--config=smoke"], "audit.py") == [
    f"{packaged}:smoke"
  ]
  assert launcher.config_argument(["--config", ":edges", "-x"], "audit.py") == [
    f"{packaged}:edges",
    "-x",
  ]
  own = ["--config=my/file.py:fast", "--config.kernel=m:f"]
  assert launcher.config_argument(own, "audit.py") == own


def test_shortcuts_are_config_fields():
  got = launcher.config_argument(
    ["--junit=a.xml", "--update_baseline", "--junitx=1", "-junit"],
    "audit.py",
    ("junit", "update_baseline"),
  )
  assert got == [
    "--config.junit=a.xml",
    "--config.update_baseline=True",
    "--junitx=1",
    "-junit",
  ]


def test_every_command_has_its_module_and_config():
  for name, spec in commands.EXPERIMENTS.items():
    assert importlib.util.find_spec(spec.module), name
    assert (launcher.CONFIGS / spec.config).exists(), name
    assert spec.workdir.startswith("runs/"), name


def test_the_configs_are_one_copy_at_the_top_of_the_checkout():
  repo = pathlib.Path(__file__).resolve().parent.parent
  assert launcher.CONFIGS == repo / "configs"
  assert not (repo / "stableattn" / "configs").exists()
  own = {spec.config for spec in commands.EXPERIMENTS.values()}
  assert own <= {p.name for p in launcher.CONFIGS.glob("*.py")}


def test_every_package_of_the_tree_is_in_the_wheels_list():
  tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
  repo = pathlib.Path(__file__).resolve().parent.parent
  setuptools = tomllib.loads((repo / "pyproject.toml").read_text())["tool"][
    "setuptools"
  ]
  in_tree = {
    ".".join(init.parent.relative_to(repo).parts)
    for root in ("stableattn", "stableattn_pytest")
    for init in (repo / root).rglob("__init__.py")
  }
  assert set(setuptools["packages"]) == in_tree | {"stableattn.configs"}
  assert setuptools["package-dir"] == {"stableattn.configs": "configs"}


def test_a_commands_help_names_its_variants_and_shortcuts():
  audit = commands.command_usage("audit")
  assert "(default, smoke, paper, edges, search, decode, stable_grid)" in audit
  assert "--junit, --baseline, --update_baseline" in audit
  assert "--junit" not in commands.command_usage("benchmark")


def test_usage_and_an_unknown_command(capsys):
  assert commands.main(["stableattn", "--help"]) == 0
  listed = capsys.readouterr().out
  assert all(name in listed for name in [*commands.EXPERIMENTS, "compare"])
  assert commands.main(["stableattn"]) == 2
  assert commands.main(["stableattn", "audti"]) == 2
  said = capsys.readouterr().err
  assert "unknown command 'audti'" in said and "audit, " in said


def _audit_dir(path, ratios: dict):
  path.mkdir()
  (path / "headline.json").write_text(json.dumps({"gate": ["flashattention"]}))
  rows = [
    {
      "kernel": "k",
      "policy": "fp32",
      "regime": "none",
      "features": "none",
      "shape": "B1",
      "tensor": tensor,
      "flashattention_applies": True,
      "flashattention_passed": value <= 1,
      "flashattention_value": value,
      "flashattention_limit": 1.0,
      "nonfinite": 0,
      "deterministic": True,
    }  # fmt: skip
    for tensor, value in ratios.items()
  ]
  (path / "metrics.jsonl").write_text(
    "".join(json.dumps(r) + "\n" for r in rows)
  )
  return str(path)


def _settings(fail_on=("regressions",), growth=1.25):
  return types.SimpleNamespace(fail_on=list(fail_on), growth=growth)


def test_compare_fails_on_what_it_is_told(tmp_path, capsys):
  old = _audit_dir(tmp_path / "old", {"out": 0.2, "dq": 0.5, "dk": 0.5})
  new = _audit_dir(tmp_path / "new", {"out": 0.6, "dq": 0.5})
  assert compare.compare_folders([old, new], _settings()) == 0
  assert compare.compare_folders([old, new], _settings(["growth"])) == 1
  said = capsys.readouterr().out
  assert "growth: 1" in said and "0.2 -> 0.6" in said
  assert compare.compare_folders([old, new], _settings(["missing"])) == 1
  assert "failed on: missing" in capsys.readouterr().out
  worse = _audit_dir(tmp_path / "worse", {"out": 1.5, "dq": 0.5, "dk": 0.5})
  assert compare.compare_folders([old, worse], _settings()) == 1
  assert compare.compare_folders([worse, old], _settings()) == 0
  assert "improvements: 1" in capsys.readouterr().out


@pytest.mark.parametrize(
  "folders, fail_on, said",
  [
    (["a"], ["regressions"], "takes two audit run directories"),
    (["a", "b"], ["typo"], "unknown --fail_on"),
    (["a", "b"], ["regressions"], "holds no audit"),
  ],
)
def test_compare_says_what_was_wrong(tmp_path, capsys, folders, fail_on, said):
  folders = [str(tmp_path / f) for f in folders]
  assert compare.compare_folders(folders, _settings(fail_on)) == 2
  assert said in capsys.readouterr().out


@pytest.mark.slow
def test_the_compilation_cache_is_written_and_read(tmp_path):
  import os
  import subprocess
  import sys

  cache = tmp_path / "cache"
  command = [
    sys.executable, "-m", "stableattn", "audit", "--config=smoke",
    "--config.kernel=xla", "--config.precisions=fp32",
    f"--workdir={tmp_path / 'run'}", f"--compilation_cache={cache}",
  ]  # fmt: skip
  env = {k: v for k, v in os.environ.items() if "JAX_COMPILATION" not in k}
  env["JAX_DEBUG_LOG_MODULES"] = "jax._src.compiler"  # logs each cache hit
  hits = []
  for _ in range(2):
    done = subprocess.run(
      command, capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    hits.append(done.stderr.lower().count("cache hit"))
    command.append("--restart")
  assert len(list(cache.iterdir())) >= 8  # programs below JAX's 1 s, too
  assert hits[1] >= 8 and hits[1] > hits[0], hits
