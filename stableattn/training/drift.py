"""Weight drift between two training runs (Golden et al., Figs. 7-8).

For every parameter tensor: max |a - b|, Wasserstein-1 between the two
value distributions, and relative L2; then the same over each layer's
tensors together and over the whole model.
"""

from __future__ import annotations

import re

import jax
import numpy as np

from stableattn.numerics.metrics import wasserstein_1d


def named_leaves(params) -> dict[str, np.ndarray]:
  """Parameter tensors by path, e.g. 'blocks/0/attention/query/kernel'."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    parts = []
    for key in path:
      name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
      parts.append(str(name))
    name = "/".join(p for p in parts if p != "value")
    out[name] = np.asarray(leaf, dtype=np.float64)
  return out


def layer_of(name: str) -> str:
  match = re.match(r"blocks/(\d+)/", name)
  return f"layer_{int(match.group(1))}" if match else "embeddings_and_norm"


def _drift(a: np.ndarray, b: np.ndarray) -> dict:
  diff = b - a
  norm = np.linalg.norm(a)
  return {
    "max_abs": float(np.max(np.abs(diff))) if diff.size else 0.0,
    "wasserstein": wasserstein_1d(a, b),
    "rel_l2": float(np.linalg.norm(diff) / norm) if norm else 0.0,
  }


def param_drift(params_a, params_b) -> list[dict]:
  """Rows {scope, name, max_abs, wasserstein, rel_l2}: per tensor, per
  layer ("layer" scope) and for the whole model ("model" scope)."""
  a, b = named_leaves(params_a), named_leaves(params_b)
  if a.keys() != b.keys():
    raise ValueError("the two parameter trees have different tensors")
  rows = [{"scope": "tensor", "name": n, **_drift(a[n], b[n])} for n in a]
  layers: dict[str, list[str]] = {}
  for name in a:
    layers.setdefault(layer_of(name), []).append(name)
  for layer, names in sorted(layers.items()):
    cat_a = np.concatenate([a[n].ravel() for n in names])
    cat_b = np.concatenate([b[n].ravel() for n in names])
    rows.append({"scope": "layer", "name": layer, **_drift(cat_a, cat_b)})
  all_a = np.concatenate([x.ravel() for x in a.values()])
  all_b = np.concatenate([b[n].ravel() for n in a])
  rows.append({"scope": "model", "name": "model", **_drift(all_a, all_b)})
  return rows


def cosine(a: np.ndarray, b: np.ndarray) -> float:
  """Cosine similarity of two arrays taken as vectors (0 if either is 0)."""
  norm = float(np.linalg.norm(a) * np.linalg.norm(b))
  return float(np.sum(a * b) / norm) if norm else 0.0


def top_singular_share(matrix: np.ndarray) -> float:
  """sigma_1^2 / sum sigma_i^2: the energy of a matrix's top direction.

  1 for a rank-one matrix; about 4/n for an n x n Gaussian one.
  """
  sigma = np.linalg.svd(np.asarray(matrix, np.float64), compute_uv=False)
  energy = float(np.sum(sigma**2))
  return float(sigma[0] ** 2 / energy) if energy else 0.0


def attention_grad_error_rows(
  run: str,
  step: int,
  errors: dict,
  exact: dict,
  previous: dict | None,
  running: dict | None = None,
) -> list[dict]:
  """One row per attention weight: the flash run's gradient error.

  Qiu & Yao (arXiv 2510.04212) trace failing BF16 training to gradient
  errors that point the same way step after step and are low-rank, so they
  accumulate instead of averaging out. Per weight: the error's size
  relative to the exact gradient, its cosine with the previous logged
  error (None at the first) and with `running`, the sum of every earlier
  logged error (a bias that keeps one direction grows this towards 1),
  and its top singular value's energy share.
  """
  rows = []
  for weight, error in errors.items():
    norm = float(np.linalg.norm(exact[weight]))
    rows.append(
      {
        "kind": "grad_error",
        "run": run,
        "step": step,
        "weight": weight,
        "shape": list(error.shape),
        "rel_error": float(np.linalg.norm(error)) / norm if norm else 0.0,
        "cos_previous": (
          cosine(error, previous[weight])
          if previous is not None and weight in previous
          else None
        ),
        "cos_running_sum": (
          cosine(error, running[weight])
          if running is not None and weight in running
          else None
        ),
        "top_singular_share": top_singular_share(error),
      }
    )
  return rows
