"""The forms a list argument takes, the same everywhere in the API and the
configs: a comma-separated string ("normal,uniform"), a list or tuple of
names, or one name; None and "" are empty."""

from __future__ import annotations


def names(value, what: str) -> tuple[str, ...]:
  """`value` as a tuple of stripped, non-empty names, in order.

  Raises a ValueError naming `what` for anything else (a number, a dict),
  so a string is never taken apart into its letters.
  """
  if value is None:
    return ()
  if isinstance(value, str):
    value = value.split(",")
  elif not isinstance(value, (list, tuple)):
    raise ValueError(
      f"{what} must be names: 'a,b', a list or tuple of strings, or one "
      f"string; got {type(value).__name__} {value!r}."
    )
  bad = [v for v in value if not isinstance(v, str)]
  if bad:
    raise ValueError(f"{what} must be strings, got {bad!r} in {value!r}.")
  return tuple(v.strip() for v in value if v.strip())


def chosen(value, what: str, valid: tuple[str, ...]) -> tuple[str, ...]:
  """`value` (names as `names` takes them, "all", "" or None) as a subset
  of `valid`, each once, in the given order; "all" is every valid name.

  Raises a ValueError naming the unknown ones and the valid ones.
  """
  found = names(value, what)
  if found == ("all",):
    return tuple(valid)
  unknown = [n for n in found if n not in valid]
  if unknown:
    raise ValueError(
      f"Unknown {what} {unknown}; valid: {list(valid)} or 'all'."
    )
  return tuple(dict.fromkeys(found))
