"""Random attention inputs for tests, one shared experiment run, and the
stored runs whose rows the docs quote."""

import fcntl
import json
import os
import pathlib

import numpy as np


def random_qkv(
  seed, *, batch=2, q_len=64, kv_len=None, heads=4, kv_heads=2, head_dim=64
):
  """Standard-normal float64 q [B,T,H,D], k and v [B,S,Hkv,D]."""
  rng = np.random.default_rng(seed)
  kv_len = q_len if kv_len is None else kv_len
  q = rng.standard_normal((batch, q_len, heads, head_dim))
  k = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
  v = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
  return q, k, v


def random_features(rng, batch, q_len, kv_len):
  """Random causal/window/lengths/segments settings for `sa.Features`
  on [batch, q_len] queries and [batch, kv_len] keys."""
  from stableattn.contract import masking

  kw = {}
  if rng.random() < 0.5:
    kw["causal"] = True
  if rng.random() < 0.5:
    kw["local_window_size"] = (
      int(rng.integers(0, 20)) if rng.random() < 0.8 else None,
      int(rng.integers(0, 20)) if rng.random() < 0.8 else None,
    )
  kw["causal_alignment"] = str(rng.choice(masking.ALIGNMENTS))
  if rng.random() < 0.5:
    kw["query_seq_lengths"] = rng.integers(0, q_len + 1, batch)
  if rng.random() < 0.5:
    kw["key_value_seq_lengths"] = rng.integers(0, kv_len + 1, batch)
  if rng.random() < 0.5:
    kw["segment_ids"] = (
      np.sort(rng.integers(0, 3, (batch, q_len)), axis=1),
      rng.integers(0, 3, (batch, kv_len)),  # unsorted: the hull is used
    )
  return kw


def offset_inputs(
  seed=0, key_offset=30.0, value_offset=5.0, dtype=None, batch=1
):
  """q, k, v [B, 80, 2, 32] / [B, 72, 2, 32] with a shared key and value
  component of `key_offset` (`value_offset`) x sigma sqrt(d): the geometry
  of trained models' keys (a massive activation, a sink, per-channel
  offsets)."""
  rng = np.random.default_rng(seed)
  d = 32
  u = rng.standard_normal(d)
  u /= np.linalg.norm(u)
  q = rng.standard_normal((batch, 80, 2, d))
  k = key_offset * np.sqrt(d) * u + rng.standard_normal((batch, 72, 2, d))
  v = value_offset * np.sqrt(d) * u + rng.standard_normal((batch, 72, 2, d))
  if dtype is None:
    return q, k, v
  import jax.numpy as jnp

  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def value_and_grads(q, k, v, d_out, **attention_kwargs):
  """`sa.attention` output and its (dq, dk, dv) for cotangent d_out, in f64."""
  import jax
  import jax.numpy as jnp

  import stableattn as sa

  def fn(q, k, v):
    return sa.attention(q, k, v, **attention_kwargs)

  out, vjp = jax.vjp(fn, q, k, v)
  grads = vjp(jnp.asarray(d_out).astype(out.dtype))
  return np.asarray(out.astype(jnp.float64)), [
    np.asarray(g.astype(jnp.float64)) for g in grads
  ]


def golden_value_and_grads(q, k, v, d_out, causal):
  import stableattn as sa

  return (
    sa.golden_attention(q, k, v, causal),
    sa.golden_attention_vjp(q, k, v, d_out, causal),
  )


def run_once(tmp_path_factory, name: str, run):
  """(workdir, result) of `run(workdir)`, computed once per test session
  even across xdist workers: the first worker to take the lock runs it in
  a directory all workers see, the others read its result.json."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # the session's directory, above each worker's
  workdir = base / name
  with open(base / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = base / f"{name}.result.json"
    if not done.exists():
      workdir.mkdir(exist_ok=True)
      done.write_text(json.dumps(run(workdir), default=str))
  return workdir, json.loads(done.read_text())


def sampled(cases, keep: int, *, seed: int = 0, ids=None, unpack=False):
  """`cases` as pytest params, all but a fixed-seed sample of `keep` of
  them marked slow: the fast tier (`-m "not slow"`) runs the sample, the
  full tier (`-m slow`) the rest, so CI runs every case (as jax's
  `sample_product` does between its test tiers).

  With `unpack`, each case is a tuple that fills several argnames; `ids`
  names a case (a function of it).
  """
  import random

  import pytest

  cases = list(cases)
  chosen = set(
    random.Random(seed).sample(range(len(cases)), min(keep, len(cases)))
  )
  params = []
  for i, case in enumerate(cases):
    values = case if unpack else (case,)
    marks = () if i in chosen else (pytest.mark.slow,)
    params.append(
      pytest.param(*values, marks=marks, id=None if ids is None else ids(case))
    )
  return params


def smoke_audit_config(kernel: str, **changes):
  """The audit launcher's `smoke` config for `kernel`, with fields set."""
  from stableattn.configs import audit as audit_config

  config = audit_config.get_config("smoke")
  config.kernel = kernel
  for name, value in changes.items():
    setattr(config, name, value)
  return config


REPO = pathlib.Path(__file__).resolve().parent.parent


def stored_run(name: str) -> pathlib.Path:
  """A run kept under results/cpu/ (too long for the tests to repeat)."""
  return REPO / "results" / "cpu" / name


def stored_headline(name: str) -> dict:
  return json.loads((stored_run(name) / "headline.json").read_text())


def results_page(*, folded: bool) -> str:
  """docs/results.md; `folded`: each run of whitespace one space, so a
  quoted number may wrap a line (tables keep their lines unfolded)."""
  text = (REPO / "docs" / "results.md").read_text()
  return " ".join(text.split()) if folded else text


def with_races_found(run):
  """(run(), whether jax's GPU interpreter's race detector saw a race in
  the shared-memory accesses of the kernels run() interpreted); the
  detector's state is cleared before and after."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  gpu_callbacks.reset_gpu_interpret_mode_state()
  try:
    return run(), gpu_callbacks.get_races().races_found
  finally:
    gpu_callbacks.reset_gpu_interpret_mode_state()


def mosaic_lowered_text(precision="bf16-fa2", gradients=True, **features):
  """The Hopper path's forward and backward (value and gradients of a
  sum of squares; the forward alone without `gradients`) lowered for
  CUDA, at ragged GQA shapes, as text."""
  import jax
  import jax.numpy as jnp

  import stableattn as sa
  from stableattn.harness.cuda_lowering import lowered_for_cuda
  from stableattn.numerics.formats import to_dtype

  dtype = to_dtype(sa.Precision.from_name(precision).inputs)
  q = jax.ShapeDtypeStruct((2, 200, 4, 64), dtype)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 64), dtype)

  def loss(q, k, v):
    out = sa.attention(
      q,
      k,
      v,
      implementation="mosaic_gpu",
      precision=precision,
      interpret=False,
      **features,
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  fn = jax.value_and_grad(loss, argnums=(0, 1, 2)) if gradients else loss
  return lowered_for_cuda(jax.jit(fn), q, kv, kv).as_text()
