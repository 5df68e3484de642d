r"""Training-stability experiment launcher (learning-rate sensitivity).

  python launch/stability.py --workdir=runs/stability \
      [--config=smoke|paper|gpu]

A stopped sweep resumes: rerun the same command. The same as
`stableattn stability`.
"""

import sys

from stableattn.commands.main import run_experiment

if __name__ == "__main__":
  run_experiment("stability", sys.argv)
