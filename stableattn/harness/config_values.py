"""Reading config fields, given in a file or on the command line.

Every reader names the field in its error, with what it got and what is
valid, so a bad `--config.x=...` is answered in one line.
"""

from __future__ import annotations

import dataclasses
import typing

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


def booleans(value, name: str) -> tuple[bool, ...]:
  """A non-empty tuple of True/False from a config field (a tuple, or
  words as the command line gives them)."""
  words = as_tuple(value, lambda x: str(x).strip().lower())
  if not words or any(w not in ("true", "false") for w in words):
    raise ValueError(
      f"config.{name} must hold True/False values, got {value!r}."
    )
  return tuple(w == "true" for w in words)


def _lookup(config, field: str):
  value = config
  for part in field.split("."):
    value = value[part]
  return value


def _convert(field: str, value, kind, minimum):
  if kind is bool:
    words = booleans(value, field)
    if len(words) != 1:
      raise ValueError(f"config.{field} must be True or False, got {value!r}.")
    return words[0]
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


def tile_pairs(value, name: str) -> tuple[tuple[int, int], ...]:
  """(block_q, block_k) pairs of positive sizes, from pairs or one pair."""
  try:
    pairs = [value] if isinstance(value[0], int) else list(value)
    out = tuple((int(a), int(b)) for a, b in pairs)
  except (TypeError, ValueError, IndexError):
    raise ValueError(
      f"config.{name} must be (block_q, block_k) pairs, got {value!r}."
    ) from None
  if not out or min(min(p) for p in out) < 1:
    raise ValueError(f"config.{name} needs positive tile sizes, got {value!r}.")
  return out


def ring_devices(raw, name: str) -> int:
  """A context-parallel ring's size: 0 (no ring) or 2 devices or more."""
  value = int(raw or 0)
  if value == 1 or value < 0:
    raise ValueError(
      f"config.{name} must be 0 (off) or the devices of the ring (>= 2), "
      f"got {raw!r}."
    )
  return value


def spec(*, minimum=None, choices=None, parse=None, allow_empty=False):
  """Metadata of a config dataclass field, read by `from_section`; the
  field's values (default and per variant) live in the config file.

  minimum: the least valid value (of each element for a tuple);
  choices: the valid values (of each element);
  parse: `parse(raw, dotted_name)` for a field no type rule covers.
  """
  return dataclasses.field(
    metadata={
      "minimum": minimum,
      "choices": choices,
      "parse": parse,
      "allow_empty": allow_empty,
    }
  )


def _check_section_fields(cls, config, section: str) -> None:
  """Raises naming the fields the section lacks or has beyond `cls`'s."""
  wanted = {f.name for f in dataclasses.fields(cls)}
  if not wanted:
    return
  try:
    given = set(_lookup(config, section).keys())
  except (KeyError, AttributeError):
    raise ValueError(
      f"config.{section} is missing; it needs the fields {sorted(wanted)}."
    ) from None
  missing, extra = sorted(wanted - given), sorted(given - wanted)
  if missing or extra:
    raise ValueError(
      f"config.{section}: missing fields {missing}, unknown fields {extra}; "
      f"valid: {sorted(wanted)}."
    )


def from_section(cls, config, section: str):
  """A config dataclass built from the ConfigDict section `section`, which
  must hold exactly its fields.

  Each field is read by its annotation (int, float, str, or a tuple of
  one of them) and its `spec` metadata; the error names the dotted field.
  A class with no fields needs no section.
  """
  _check_section_fields(cls, config, section)
  hints = typing.get_type_hints(cls)
  values = {}
  for f in dataclasses.fields(cls):
    name = f"{section}.{f.name}"
    meta = f.metadata
    kind = hints[f.name]
    if meta.get("parse"):
      values[f.name] = meta["parse"](_lookup(config, name), name)
    elif typing.get_origin(kind) is tuple:
      values[f.name] = field_tuple(
        config,
        name,
        typing.get_args(kind)[0],
        minimum=meta.get("minimum"),
        allow_empty=meta.get("allow_empty", False),
      )
    else:
      values[f.name] = field(config, name, kind, minimum=meta.get("minimum"))
    choices = meta.get("choices")
    given = values[f.name]
    for value in given if isinstance(given, tuple) else (given,):
      if choices is not None and value not in choices:
        raise ValueError(
          f"config.{name}: unknown {value!r}; valid: {list(choices)}."
        )
  try:
    return cls(**values)
  except ValueError as e:
    raise ValueError(f"config.{section}: {e}") from None


def with_variant(config, arg: str | None, variants: dict[str, dict]):
  """`config` with the overrides of the variant `arg` ("" or None: the
  default) set; each override names a field by its dotted path, which
  must exist in the default, so a variant changes values, never the
  config's layout."""
  name = arg or "default"
  if name not in variants:
    raise ValueError(
      f"Unknown config variant {arg!r}; valid: {', '.join(variants)}."
    )
  for dotted, value in variants[name].items():
    *sections, key = dotted.split(".")
    target = config
    for section in sections:
      target = target[section]
    if key not in target:
      raise KeyError(f"variant {name!r} sets {dotted!r}, not a config field")
    target[key] = value
  return config
