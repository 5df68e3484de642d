"""What is measured at a logging step, as rows for metrics.jsonl.

Each probe takes the evaluated runs of one replicate and returns plain
dict rows: a run's losses and per-layer attention statistics, a flash
run's attention-gradient error (Qiu & Yao), and a pair's drift.
"""

from __future__ import annotations

import jax
import numpy as np

from stableattn.drift import attention_grad_error_rows, param_drift


def run_rows(name: str, tag: dict, loss, layer_stats, last_train) -> list:
  """The run's evaluation loss (with its last training metrics) and its
  per-layer attention statistics."""
  rows = [
    {
      "kind": "run",
      "run": name,
      **tag,
      "eval_loss": float(loss),
      **last_train,
    }
  ]
  return rows + [
    {
      "kind": "attention",
      "run": name,
      "replicate": tag["replicate"],
      "step": tag["step"],
      "layer": i,
      **{k: float(v) for k, v in stats.items()},
    }
    for i, stats in enumerate(layer_stats)
  ]


def grad_error_rows(trainer, state, batch, name, tag, previous):
  """(rows, errors): the flash kernel's attention-gradient error against
  FP32 attention on `batch`, and its cosine with the `previous` errors."""
  grads = jax.device_get(trainer.attention_grad_error(state, batch))
  exact = {w: np.asarray(g, np.float64) for w, (_, g) in grads.items()}
  errors = {
    w: np.asarray(flash, np.float64) - exact[w]
    for w, (flash, _) in grads.items()
  }
  rows = attention_grad_error_rows(name, tag["step"], errors, exact, previous)
  return [{**row, "replicate": tag["replicate"]} for row in rows], errors


def pair_rows(
  pair: str, tag: dict, evaluated_a, evaluated_b, params_a, params_b
):
  """The evaluation gap, logit difference and weight drift of one pair.

  evaluated_*: (logits, loss, layer statistics) of the pair's two runs.
  """
  logits_a, logits_b = np.asarray(evaluated_a[0]), np.asarray(evaluated_b[0])
  diff = logits_b.astype(np.float64) - logits_a
  gap = {
    "kind": "pair",
    "pair": pair,
    **tag,
    "eval_loss_gap": float(evaluated_b[1]) - float(evaluated_a[1]),
    "logit_max_abs": float(np.max(np.abs(diff))),
    "logit_rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(logits_a)),
  }
  return [gap] + [
    {"kind": "drift", "pair": pair, **tag, **row}
    for row in param_drift(params_a, params_b)
  ]
