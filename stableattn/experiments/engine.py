"""Computes attention outputs and gradients for deviation studies, once each.

Studies ask for the same output many times (one flash output is compared
with several baselines, and the default forward run's studies read 591
inputs, outputs and golden values another study computed); the engine
keys every result by what determines it and keeps the most recently used
up to a memory bound.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.auditing.feature_recipes import FeatureRecipe
from stableattn.auditing.inputs import (
  Shape,
  TiedMaximaSpec,
  make_inputs,
  round_to,
)
from stableattn.contract.golden import golden_attention, golden_attention_vjp
from stableattn.contract.options import Options
from stableattn.numerics.precision import Precision
from stableattn.ops.dispatch import attention
from stableattn.ops.triton_limits import gpu_unsupported_reason


@dataclasses.dataclass(frozen=True)
class Case:
  """Inputs of one measurement: distribution, shape, storage format, seed."""

  distribution: str
  shape: Shape
  fmt: str  # inputs are rounded to this format before anything runs
  seed: int
  causal: bool = False
  tied: TiedMaximaSpec | None = None  # the "tied_maxima" construction
  features: FeatureRecipe = FeatureRecipe()
  outlier_std: float = 10.0  # the "outliers" spikes' standard deviation

  def attention_arguments(self) -> dict:
    """The case's features by name (`stableattn.Features.kwargs`)."""
    features = self.features.build(self.shape)
    return features.replace(causal=self.causal).kwargs()


@dataclasses.dataclass(frozen=True)
class Kernel:
  """How attention is computed: an implementation and its options."""

  implementation: str
  options: Options

  @property
  def policy(self) -> Precision:
    return self.options.precision


def _frozen(x) -> np.ndarray:
  """x as a float64 array of its own, read-only: results are shared by
  every study that asks, and `metrics` keeps the sorted values of such
  arrays between comparisons."""
  x = np.array(x, dtype=np.float64)
  x.setflags(write=False)
  return x


def _nbytes(value) -> int:
  return sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(value))


class Engine:
  """Results by what determines them, the least recently used dropped
  beyond `max_bytes`. The default forward run computes 560 MiB of them;
  under 512 MiB it drops only results no later study reads (the paper
  variant's lengths to 8,192 would hold gigabytes)."""

  def __init__(self, *, scale: float = 8.0, max_bytes: int = 512 << 20):
    self._scale = scale
    self._max_bytes = max_bytes
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._sizes: dict = {}
    self._held_bytes = 0

  def clear(self) -> None:
    self._cache.clear()
    self._sizes.clear()
    self._held_bytes = 0

  def _memo(self, key, compute):
    if key in self._cache:
      self._cache.move_to_end(key)
      return self._cache[key]
    value = self._cache[key] = compute()
    self._sizes[key] = _nbytes(value)
    self._held_bytes += self._sizes[key]
    while self._held_bytes > self._max_bytes and len(self._cache) > 1:
      oldest, _ = self._cache.popitem(last=False)
      self._held_bytes -= self._sizes.pop(oldest)
    return value

  def inputs(self, case: Case):
    def compute():
      qkv = make_inputs(
        case.distribution,
        case.seed,
        case.shape,
        scale=self._scale,
        tied=case.tied,
        outlier_std=case.outlier_std,
      )
      return tuple(round_to(x, case.fmt) for x in qkv)

    key = (
      case.distribution,
      case.shape,
      case.fmt,
      case.seed,
      case.tied,
      case.outlier_std,
    )
    return self._memo(("inputs", *key), compute)

  def d_out(self, case: Case, sign: str = "random"):
    """An output cotangent rounded to the case format.

    sign: "random" for N(0, 1); "positive" for |N(0, 1)| + 1/2, a gradient
    of one sign, under which a biased O biases delta = rowsum(dO * O).
    """
    if sign not in ("random", "positive"):
      raise ValueError(f"sign must be 'random' or 'positive', got {sign!r}.")

    def compute():
      rng = np.random.default_rng([case.seed, 7919])
      d_out = rng.standard_normal(case.shape.q_shape)
      if sign == "positive":
        d_out = np.abs(d_out) + 0.5
      return round_to(d_out, case.fmt)

    return self._memo(("d_out", case, sign), compute)

  def golden(self, case: Case):
    return self._memo(
      ("golden", case),
      lambda: _frozen(
        golden_attention(*self.inputs(case), **case.attention_arguments())
      ),
    )

  def golden_grads(self, case: Case, sign: str = "random"):
    return self._memo(
      ("golden_grads", case, sign),
      lambda: tuple(
        _frozen(g)
        for g in golden_attention_vjp(
          *self.inputs(case),
          self.d_out(case, sign),
          **case.attention_arguments(),
        )
      ),
    )

  def _kwargs(self, kernel: Kernel, case: Case):
    # FP64 policies run in interpret mode even on a GPU, whose Triton kernel
    # cannot compile them; every other policy compiles there.
    options = kernel.options
    if gpu_unsupported_reason(kernel.policy):
      options = options.replace(interpret=True)
    return dict(
      implementation=kernel.implementation,
      options=options,
      **case.attention_arguments(),
    )

  def output(self, kernel: Kernel, case: Case) -> np.ndarray:
    """Attention output as float64 (values as the kernel stored them)."""

    def compute():
      out = attention(*self.inputs(case), **self._kwargs(kernel, case))
      return _frozen(out.astype(jnp.float64))

    return self._memo(("output", kernel, case), compute)

  def grads(self, kernel: Kernel, case: Case, sign: str = "random"):
    """(dq, dk, dv) for the case's output cotangent, as float64."""

    def compute():
      kwargs = self._kwargs(kernel, case)
      out, vjp = jax.vjp(
        lambda q, k, v: attention(q, k, v, **kwargs), *self.inputs(case)
      )
      d_out = jnp.asarray(self.d_out(case, sign)).astype(out.dtype)
      return tuple(_frozen(g.astype(jnp.float64)) for g in vjp(d_out))

    return self._memo(("grads", kernel, case, sign), compute)
