"""`python -m stableattn <command> [flags]`: see stableattn.commands.main."""

import sys

from stableattn.commands.main import main

sys.exit(main())
