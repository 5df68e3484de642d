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


def _blocks(marker: str) -> list[str]:
  pattern = rf"<!-- test: {marker} -->\n```\w+\n(.*?)```"
  return [
    block
    for page in PAGES
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


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_blocks_run(index):
  code = _blocks("python")[index]
  subprocess.run(
    [sys.executable, "-c", code], check=True, cwd=REPO, timeout=300
  )


@pytest.mark.slow  # three experiment launchers end to end
def test_shell_commands_run(tmp_path):
  commands = [
    line
    for block in _blocks("shell")
    for line in block.splitlines()
    if line.strip()
  ]
  assert len(commands) >= 3
  env = dict(os.environ)
  env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env['PATH']}"
  try:
    for command in commands:
      subprocess.run(
        command,
        shell=True,
        check=True,
        cwd=REPO,
        env=env,
        timeout=600,
        capture_output=True,
      )
      workdir = re.search(r"--workdir=(\S+)", command).group(1)
      assert (REPO / workdir / "report.md").exists(), command
  finally:
    for command in commands:
      workdir = re.search(r"--workdir=(\S+)", command).group(1)
      shutil.rmtree(REPO / workdir, ignore_errors=True)
