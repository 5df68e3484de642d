"""What a program computes in, read from its traced jaxpr rather than from
the dtypes its code asks for: type promotion (an FP32 activation times a
BF16 weight computes in FP32) is invisible in the code and plain in the
program."""

from __future__ import annotations

import collections

import jax
from jax.extend import core


def _sub_jaxprs(value):
  if isinstance(value, core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)


def _walk(jaxpr, skip: tuple[str, ...]):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in skip or eqn.params.get("name") in skip:
      continue
    yield eqn
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        yield from _walk(sub, skip)


def dot_operand_formats(
  fn, *args, skip: tuple[str, ...] = ()
) -> collections.Counter:
  """How many of `fn(*args)`'s matrix products (`dot_general`, in every
  nested program: jit, custom derivatives, loops, the backward) take each
  pair of operand dtypes, e.g. {("bfloat16", "bfloat16"): 51}.

  skip: primitives, or names of jitted functions, whose programs are left
  out (`"pallas_call"`, or the attention's own jit: its products follow
  its precision policy, not the model's format).
  """
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return collections.Counter(
    tuple(str(v.aval.dtype) for v in eqn.invars[:2])
    for eqn in _walk(jaxpr, skip)
    if eqn.primitive.name == "dot_general"
  )
