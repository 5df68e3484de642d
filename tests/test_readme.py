"""Every code block marked for testing, in the README and in docs/, runs as
written."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks(marker: str, pages=PAGES) -> list[str]:
  pattern = rf"<!-- test: {marker} -->\n```\w+\n(.*?)```"
  return [
    block
    for page in pages
    for block in re.findall(pattern, page.read_text(), flags=re.DOTALL)
  ]


def test_readme_is_a_front_door_that_links_every_page():
  assert len(README.splitlines()) <= 300
  for page in PAGES[1:]:
    assert f"(docs/{page.name})" in README, page.name
  # Every relative link and image of every page resolves.
  for page in PAGES:
    for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
      assert (page.parent / target).exists(), (page.name, target)


def test_every_code_block_is_run_or_says_why_not():
  for page in PAGES:
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
      if re.match(r"^```(python|bash|sh)\s*$", line):
        marker = lines[i - 1] if i else ""
        assert re.match(
          r"<!-- (test: (python|shell)|quickstart|not run: .+) -->", marker
        ), f"{page.name}:{i + 1}: a code block neither tested nor explained"


def test_quickstart_has_the_two_commands():
  block = re.search(
    r"<!-- quickstart -->\n```bash\n(.*?)```", README, flags=re.DOTALL
  ).group(1)
  lines = [line for line in block.splitlines() if line.strip()]
  assert len(lines) == 2
  assert "launch/forward_deviation.py" in lines[0]
  test_command = 'python -m pytest -n 2 -m "not slow"'
  assert lines[1].endswith(test_command)
  ci = (REPO / ".ci" / "run").read_text()
  assert test_command in ci
  assert "python -m pytest -n 2 -m slow" in ci


def _python_blocks():
  """The README's blocks run in the fast tier, the docs pages' in the slow
  one (each is a process that imports JAX and compiles its own shapes)."""
  params = []
  for page in PAGES:
    marks = () if page.name == "README.md" else (pytest.mark.slow,)
    for i, code in enumerate(_blocks("python", [page])):
      params.append(pytest.param(code, marks=marks, id=f"{page.stem}-{i}"))
  return params


@pytest.mark.parametrize("code", _python_blocks())
def test_python_blocks_run(code):
  subprocess.run(
    [sys.executable, "-c", code], check=True, cwd=REPO, timeout=300
  )


def _shell_commands() -> list[str]:
  return [
    line
    for block in _blocks("shell")
    for line in block.splitlines()
    if line.strip()
  ]


def test_the_docs_show_the_launchers_in_shell_blocks():
  assert len(_shell_commands()) >= 3


@pytest.mark.slow  # experiment launchers end to end, one test each
@pytest.mark.parametrize(
  "command",
  _shell_commands(),
  ids=lambda c: re.search(r"(?:launch/|stableattn )(\w+)", c).group(1),
)
def test_shell_commands_run(command):
  env = dict(os.environ)
  env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env['PATH']}"
  workdir = REPO / re.search(r"--workdir=(\S+)", command).group(1)
  try:
    subprocess.run(
      command,
      shell=True,
      check=True,
      cwd=REPO,
      env=env,
      timeout=600,
      capture_output=True,
    )
    assert (workdir / "report.md").exists(), command
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
