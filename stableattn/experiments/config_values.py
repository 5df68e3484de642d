"""Reading config fields, given in a file or on the command line.

Every reader names the field in its error, with what it got and what is
valid, so a bad `--config.x=...` is answered in one line.
"""

from __future__ import annotations

_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


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


def _lookup(config, field: str):
  value = config
  for part in field.split("."):
    value = value[part]
  return value


def _convert(field: str, value, kind, minimum):
  kind_name = _KIND_NAMES.get(kind, kind.__name__)
  try:
    if isinstance(value, bool) and kind is not bool:
      raise TypeError
    out = kind(value.strip() if isinstance(value, str) else value)
  except (TypeError, ValueError):
    raise ValueError(
      f"config.{field} must be {kind_name}, got {value!r}."
    ) from None
  if minimum is not None and out < minimum:
    raise ValueError(f"config.{field} must be >= {minimum}, got {value!r}.")
  return out


def field(config, name: str, kind=int, *, minimum=None):
  """One scalar field, converted to `kind`; >= `minimum` if given."""
  return _convert(name, _lookup(config, name), kind, minimum)


def field_tuple(
  config, name: str, kind=str, *, minimum=None, allow_empty: bool = False
) -> tuple:
  """A list-valued field as a tuple of `kind`; empty only if allowed."""
  raw = _lookup(config, name)
  values = raw.split(",") if isinstance(raw, str) else raw
  if not isinstance(values, (list, tuple)):
    values = [values]
  out = tuple(
    _convert(name, v, kind, minimum)
    for v in values
    if not (isinstance(v, str) and not v.strip())
  )
  if not out and not allow_empty:
    raise ValueError(f"config.{name} is empty; give at least one value.")
  return out
