"""A bad value on the command line is one line saying what was wrong and
what is valid, with exit code 2 and no traceback, for every command: a
config file that does not exist, an unknown variant, flag or field, an
ill-typed value, and kernel options the chosen path refuses (before any
case runs). The fast tier checks each kind once; the full tier sweeps
every command with every kind."""

import re
import subprocess
import sys

import pytest
from helpers import REPO

from stableattn.commands.main import EXPERIMENTS

# A field every command's config has, with a value of the wrong type.
BAD_VALUES = {
  "missing file": (["--config=configs/no_such_file.py"], "no config file"),
  "unknown variant": (["--config=no_such_variant"], "Unknown config variant"),
  "unknown field": (["--config.no_such_field=1"], "no such config field"),
  "unknown nested field": (
    ["--config=smoke", "--config.no_such_section.field=1"],
    "no such config field",
  ),
  "unknown flag": (["--no_such_flag=1"], "Unknown command line flag"),
}
# Ill-typed: an integer field of each command's config.
INTEGER_FIELDS = {
  "audit": "repeats",
  "forward_deviation": "common.seeds",
  "training_drift": "train.total_steps",
  "drift_scaling": "scaling.fixed_steps",
  "stability": "train.steps",
  "mismatch": "train.steps",
  "benchmark": "repeats",
}
LOG_LINE = re.compile(r"^[IWE]\d{4} ")  # absl's own log lines


def _answer(command: str, args: list[str]) -> tuple[int, list[str]]:
  done = subprocess.run(
    [sys.executable, "-m", "stableattn", command, *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  lines = [
    line
    for line in (done.stdout + done.stderr).splitlines()
    if line.strip() and not LOG_LINE.match(line)
  ]
  return done.returncode, lines


def _check(command, args, words):
  code, lines = _answer(command, args)
  assert code == 2, (command, args, lines[-5:])
  assert len(lines) == 1, (command, args, lines)
  assert lines[0].startswith("error: ") and words in lines[0], lines
  assert "Traceback" not in lines[0]


# The fast tier: three kinds, three commands (a process each: about 2 s);
# the full tier sweeps the rest.
def test_a_missing_config_file_is_one_line_and_exit_2():
  _check("training_drift", *BAD_VALUES["missing file"])


def test_an_unknown_field_is_one_line_listing_the_valid_ones():
  code, lines = _answer("training_drift", ["--config.train.no_such_lr=1"])
  assert code == 2 and len(lines) == 1, lines
  assert "no such config field" in lines[0]
  assert "valid fields of config.train:" in lines[0]
  assert "'learning_rate'" in lines[0]


def test_kernel_options_the_path_refuses_are_one_line_before_any_case():
  _check(
    "audit",
    ["--config.kernel=mosaic_gpu", "--config.kernel_options=block_q=48"],
    "cannot take these options: block_q=48",
  )


@pytest.mark.slow
def test_refused_options_and_ill_typed_values_in_the_audit():
  _check("audit", ["--config.repeats=abc"], "invalid literal for int()")
  _check(
    "audit",
    ["--config.kernel=xla", "--config.kernel_options=center_kv=True"],
    "option of our flash kernels",
  )


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(EXPERIMENTS))
@pytest.mark.parametrize("kind", [*BAD_VALUES, "ill-typed field"])
def test_every_command_answers_every_bad_value_in_one_line(command, kind):
  if kind == "ill-typed field":
    field = INTEGER_FIELDS[command]
    _check(command, [f"--config.{field}=abc"], "invalid literal for int()")
  else:
    _check(command, *BAD_VALUES[kind])
