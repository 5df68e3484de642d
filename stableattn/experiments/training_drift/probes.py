"""What is measured at a logging step, as rows for metrics.jsonl.

Each probe takes the evaluated runs of one replicate and returns plain
dict rows: a run's losses and per-layer attention statistics, a flash
run's attention-gradient error (Qiu & Yao), and a pair's drift.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from stableattn.numerics import monitor
from stableattn.training.drift import attention_grad_error_rows, param_drift
from stableattn.training.model import FP32, SHADOW, AttentionSpec


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
      **monitor.plain(stats),
    }
    for i, stats in enumerate(layer_stats)
  ]


def shadow_of(attention: AttentionSpec) -> AttentionSpec:
  """Evaluation attention of a flash run: flash passed on, the baseline
  (its `shadow_baseline`) computed beside it on the same inputs (Golden
  et al. did the same)."""
  return dataclasses.replace(
    attention,
    kind=SHADOW,
    shadow_downstream="pallas",
    shadow_flash=attention.kind,
  )


# The projection matrices of each SelfAttention layer.
ATTENTION_WEIGHTS = ("query", "key", "value", "out")


class AttentionGradError:
  """A flash run's attention-projection gradients beside the same
  gradients with FP32 Baseline attention (same parameters and batch)."""

  def __init__(self, trainer):
    self.trainer = trainer
    exact = dataclasses.replace(
      trainer.run.attention, kind="reference", options=FP32
    )
    self.exact_graphdef = trainer.graph_with(exact)
    self._pairs = jax.jit(self._pairs_impl)

  def _pairs_impl(self, params, batch):
    flash = self.trainer.gradients(self.trainer.graphdef, params, batch)
    exact = self.trainer.gradients(self.exact_graphdef, params, batch)
    return {
      f"layer{i}.{name}": (
        getattr(flash_block.attention, name).kernel[...],
        getattr(exact_block.attention, name).kernel[...],
      )
      for i, (flash_block, exact_block) in enumerate(
        zip(flash["blocks"].values(), exact["blocks"].values())
      )
      for name in ATTENTION_WEIGHTS
    }

  def __call__(self, state, batch) -> dict:
    """{"layer{i}.{query,key,value,out}": (flash grad, FP32 grad)}."""
    return self._pairs(state.params, batch)


def grad_error_rows(probe, state, batch, name, tag, previous, running=None):
  """(rows, errors): the flash kernel's attention-gradient error against
  FP32 attention on `batch`, and its cosine with the `previous` errors
  and with `running`, their sum over every earlier log."""
  grads = jax.device_get(probe(state, batch))
  exact = {w: np.asarray(g, np.float64) for w, (_, g) in grads.items()}
  errors = {
    w: np.asarray(flash, np.float64) - exact[w]
    for w, (flash, _) in grads.items()
  }
  rows = attention_grad_error_rows(
    name, tag["step"], errors, exact, previous, running
  )
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
