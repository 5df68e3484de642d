"""stableattn's pytest plugin (the `pytest11` entry point `stableattn`).

It imports nothing beyond pytest until a test asks for its fixture, so
it costs nothing in a suite that does not use it:

  def test_my_kernel(attention_audit):
    attention_audit(my_attention, precision="bf16-framework",
                    features="causal")

`--stableattn-baseline=PATH` (or the ini option `stableattn_baseline`)
judges every audit against a file of known findings;
`--stableattn-update-baseline` records the current failures there
instead (run it without -n: the tests share the file).
"""

from __future__ import annotations

import os
import pathlib

import pytest

# Read by stableattn.testing.AttentionAuditTestBase (which also runs
# under absltest, outside pytest).
BASELINE_VARIABLE = "STABLEATTN_BASELINE"
UPDATE_VARIABLE = "STABLEATTN_UPDATE_BASELINE"


def pytest_addoption(parser):
  group = parser.getgroup("stableattn", "attention kernel audits")
  group.addoption(
    "--stableattn-baseline",
    default=None,
    help="A file of known audit findings: only new or worse ones fail.",
  )
  group.addoption(
    "--stableattn-update-baseline",
    action="store_true",
    default=False,
    help="Record the audits' current failures in the baseline file.",
  )
  parser.addini(
    "stableattn_baseline",
    "A file of known audit findings, relative to the rootdir.",
    default="",
  )


def baseline_path(config) -> pathlib.Path | None:
  given = config.getoption("stableattn_baseline")
  if given:
    return pathlib.Path(given)
  ini = config.getini("stableattn_baseline")
  return pathlib.Path(config.rootpath, ini) if ini else None


def pytest_configure(config):
  """The options reach `stableattn.testing.AttentionAuditTestBase`
  suites too, which read them from the environment (they run under
  absltest as well)."""
  settings = {}
  baseline = baseline_path(config)
  if baseline is not None:
    settings[BASELINE_VARIABLE] = str(baseline)
  if config.getoption("stableattn_update_baseline"):
    settings[UPDATE_VARIABLE] = "1"
  before = {name: os.environ.get(name) for name in settings}
  os.environ.update(settings)

  def restore():  # a session run inside another (pytester) leaves no trace
    for name, value in before.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value

  config.add_cleanup(restore)


@pytest.fixture
def attention_audit(request):
  """`attention_audit(fn, **keywords)`: `stableattn.testing.
  assert_audit_passes` under the session's baseline options."""
  from stableattn.testing import assert_audit_passes

  baseline = baseline_path(request.config)
  update = request.config.getoption("stableattn_update_baseline")
  if update and baseline is None:
    raise pytest.UsageError(
      "--stableattn-update-baseline needs --stableattn-baseline=PATH "
      "(or the ini option stableattn_baseline)."
    )

  def run(fn, **keywords):
    keywords.setdefault("baseline", baseline)
    keywords.setdefault("update_baseline", update)
    return assert_audit_passes(fn, **keywords)

  return run
