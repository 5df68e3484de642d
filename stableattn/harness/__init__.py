"""What every run shares: its run directory, environment record, report
tables, plots and config values."""
