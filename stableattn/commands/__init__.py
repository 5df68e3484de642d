"""The command line: `stableattn <command>` and the launchers beside it."""
