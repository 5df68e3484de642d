"""One `stableattn audit` command that audits exactly one case: what the
grid's error rows, the shrinking search and `stableattn.testing` print."""

from __future__ import annotations

import shlex

# A reproducer runs in an installed wheel as in a checkout
# (`python launch/audit.py` takes the same flags).
REPRODUCE = "stableattn audit --workdir=runs/audit_reproduce --restart"


def command(kernel: str, policy: str, shapes, **fields) -> str:
  """The command for `kernel` at format `policy` on `shapes`, two repeats,
  then `--config.<field>=<value>` for each field given (None: left out),
  in the order given."""
  specs = tuple(tuple(int(x) for x in shape) for shape in shapes)
  parts = [
    REPRODUCE,
    f"--config.kernel={shlex.quote(kernel)}",
    f"--config.precisions={policy}",
    f"--config.shapes={shlex.quote(str(specs))}",
    "--config.repeats=2",
  ]
  parts += [
    f"--config.{name}={shlex.quote(str(value))}"
    for name, value in fields.items()
    if value is not None
  ]
  return " ".join(parts)
