r"""Two audits compared key by key; the same as `stableattn compare`
(stableattn/commands/compare.py says what it prints and when it fails).

  python launch/audit_compare.py runs/audit_v1 runs/audit_v2
"""

import sys

from stableattn.commands import compare

if __name__ == "__main__":
  sys.exit(compare.main(sys.argv))
