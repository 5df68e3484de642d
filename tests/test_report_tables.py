"""The report library's Markdown tables."""

from stableattn.experiments.forward_report import table


def test_a_pipe_inside_a_cell_does_not_open_a_column():
  text = table(["run", "max |Δw|"], [["flash", "|x| = 1"]])
  header, rule, row = text.splitlines()
  # Unescaped pipes are the column separators: 3 per two-column line.
  for line in (header, row):
    assert line.replace("\\|", "").count("|") == 3
  assert rule == "|---|---|"
