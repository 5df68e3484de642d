"""Reading list-valued config fields, given in a file or on the command line."""

from __future__ import annotations


def as_tuple(value, kind=str) -> tuple:
  """A tuple from a tuple/list, a comma-separated string, or one value.

  `--config.seq_lens=256,1024` arrives as a string or a tuple depending on
  the field's default; both read the same here.
  """
  if isinstance(value, str):
    value = [v for v in value.split(",") if v.strip()]
  elif not isinstance(value, (list, tuple)):
    value = [value]
  return tuple(kind(v.strip() if isinstance(v, str) else v) for v in value)
