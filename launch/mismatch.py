r"""Training-inference mismatch experiment launcher.

  python launch/mismatch.py --workdir=runs/mismatch \
      [--config=smoke|paper|gpu]

A stopped run resumes: rerun the same command. The same as
`stableattn mismatch`.
"""

import sys

from stableattn.commands.main import run_experiment

if __name__ == "__main__":
  run_experiment("mismatch", sys.argv)
