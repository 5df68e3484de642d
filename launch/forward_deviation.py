r"""Forward-deviation experiment launcher.

  python launch/forward_deviation.py --workdir=runs/forward \
      [--config=paper|smoke] [--config.seq_len.lengths=256,1024]

The same as `stableattn forward_deviation`.
"""

import sys

from stableattn.commands.main import run_experiment

if __name__ == "__main__":
  run_experiment("forward_deviation", sys.argv)
