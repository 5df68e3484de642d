"""Why flash backwards miss on a model's own tensors: the shared key
component, measured layer by layer.

For each captured layer and each counterfactual (keys as captured, keys
centred, values centred, both; exact changes: softmax ignores a row
constant, and V's mean only moves O), every kernel's dQ is judged by
FlexAttention's rule against eager attention in the same format, and
its error against FP64 is split into Qiu & Yao's Eq. 1 term (arXiv
2510.04212): with delta taken from the stored O,

    dQ_flash - dQ = -scale diag(D_flash - D) P K,   D = rowsum(dO * O),

and the rest. The Eq. 1 term lies along P K, which a shared key
component dominates; `cos_mean_key` is the median over rows of
|cos(dQ error, mean key)|.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.auditing import captures
from stableattn.auditing.inputs import round_to
from stableattn.auditing.measure import rule_ratio
from stableattn.contract.golden import golden_attention, golden_attention_vjp
from stableattn.contract.options import Options
from stableattn.harness.reporting import table as reporting_table
from stableattn.numerics.rules import flexattention_rule
from stableattn.ops.registry import resolve

# name -> (registry name, options of ours): the kernels judged, in BF16.
KERNELS = {
  "bf16-fa2": ("pallas", {"precision": "bf16-fa2"}),
  "jax_mha": ("jax_mha", {}),
  "bf16-fa2-stable": ("pallas", {"precision": "bf16-fa2-stable"}),
  # FlashAttention-4's and a sparse-MLA backward's O low half, alone.
  "o_lo": ("pallas", {"precision": "bf16-fa2+delta_source=hi_lo"}),
  "center_kv": ("pallas", {"precision": "bf16-fa2", "center_kv": True}),
  "xla": ("xla", {"precision": "bf16-framework"}),
}
BASELINE = ("reference", {"precision": "bf16-framework"})
COUNTERFACTUALS = {
  "captured": (False, False),
  "keys centred": (True, False),
  "values centred": (False, True),
  "both centred": (True, True),
}
FORMAT = "bf16"


def _centred(x):
  """x less its mean over tokens, per (batch row, head)."""
  return x - np.mean(x, axis=1, keepdims=True)


def _run(name_options, q, k, v, d_out, causal):
  name, options = name_options
  fn = resolve(name, Options(**options))
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]

  def forward(q, k, v):
    return fn(q, k, v, causal=causal)

  out, vjp = jax.vjp(forward, *args)
  grads = vjp(jnp.asarray(d_out, out.dtype))
  return [np.asarray(x, np.float64) for x in (out, *grads)]


def eq1_term(q, k, d_out, out, golden_out, causal) -> np.ndarray:
  """-scale diag(D_out - D) P K [B, T, H, D]: the dQ error that delta
  from `out` instead of the exact O makes (P exact, FP64)."""
  s = captures.logits(q, k, causal)
  p = np.exp(s - np.max(s, axis=-1, keepdims=True))
  p /= np.sum(p, axis=-1, keepdims=True)
  k_heads = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  pk = np.einsum("bhts,bshd->bthd", p, k_heads)
  delta = np.sum(d_out * out, -1) - np.sum(d_out * golden_out, -1)
  return -(q.shape[-1] ** -0.5) * delta[..., None] * pk


def _cos_mean_key(error, k, heads: int) -> float:
  mean_k = np.repeat(np.mean(k, axis=1, keepdims=True), heads // k.shape[2], 2)
  dot = np.abs(np.sum(error * mean_k, -1))
  norms = np.linalg.norm(error, axis=-1) * np.linalg.norm(mean_k, axis=-1)
  return float(np.median(dot / np.maximum(norms, 1e-300)))


def layer_rows(layer: captures.CapturedLayer, kernels=None) -> list[dict]:
  """One row per (counterfactual, kernel) of a captured layer."""
  kernels = KERNELS if kernels is None else kernels
  t = layer.tensors
  causal = bool(layer.features.get("causal"))
  d_out = round_to(t["d_out"], FORMAT)
  place = {
    "capture": layer.label,
    "step": layer.step,
    "layer": layer.layer,
    "key_offset": float(np.max(captures.offset_ratios(t["k"]))),
    "value_offset": float(np.max(captures.offset_ratios(t["v"]))),
    "key_offset_per_head": captures.offset_ratios(t["k"]).tolist(),
    "value_offset_per_head": captures.offset_ratios(t["v"]).tolist(),
  }
  rows = []
  for counterfactual, (keys, values) in COUNTERFACTUALS.items():
    q = round_to(t["q"], FORMAT)
    k = round_to(_centred(t["k"]) if keys else t["k"], FORMAT)
    v = round_to(_centred(t["v"]) if values else t["v"], FORMAT)
    golden = [golden_attention(q, k, v, causal=causal)]
    golden += golden_attention_vjp(q, k, v, d_out, causal=causal)
    base = _run(BASELINE, q, k, v, d_out, causal)
    for name, spec in kernels.items():
      found = _run(spec, q, k, v, d_out, causal)
      error = found[1] - golden[1]
      term = eq1_term(q, k, d_out, found[0], golden[0], causal)
      judged = flexattention_rule(golden[1], found[1], base[1], FORMAT, True)
      norm = max(np.linalg.norm(error), 1e-300)
      rows.append(
        {
          **place,
          "counterfactual": counterfactual,
          "kernel": name,
          "dq_flex_ratio": judged.value / judged.limit,
          "dq_mean_error": judged.value,
          "eq1_share": float(np.linalg.norm(term) / norm),
          "rest_share": float(np.linalg.norm(error - term) / norm),
          "cos_mean_key": _cos_mean_key(error, k, q.shape[2]),
          **{
            f"{tensor}_flex_ratio": _flex_ratio(golden[i], found[i], base[i])
            for i, tensor in ((0, "out"), (2, "dk"), (3, "dv"))
          },
        }
      )
  return rows


def _flex_ratio(golden, x, baseline) -> float:
  judged = flexattention_rule(golden, x, baseline, FORMAT, True)
  return judged.value / judged.limit


def _cell(rows, capture, kernel, counterfactual, key="dq_flex_ratio") -> str:
  found = [
    r[key]
    for r in rows
    if r["capture"] == capture
    and r["kernel"] == kernel
    and r["counterfactual"] == counterfactual
  ]
  return f"{found[0]:.2g}" if found else "-"


def table(rows) -> str:
  """Markdown: per captured layer, its offsets and dQ's mean error as a
  multiple of FlexAttention's limit (1.1x eager BF16's) for each kernel
  and counterfactual, with the Eq. 1 share of bf16-fa2's dQ error and
  its alignment with the mean key."""
  header = [
    "capture", "key offset", "value offset",
    "bf16-fa2", "keys centred", "values centred", "both",
    "jax_mha", "keys centred", "bf16-fa2-stable", "o_lo", "center_kv",
    "xla",
    "Eq. 1 share", "cos(error, mean key)",
  ]  # fmt: skip
  body = []
  for capture in dict.fromkeys(r["capture"] for r in rows):
    first = next(r for r in rows if r["capture"] == capture)
    body.append(
      [
        capture,
        f"{first['key_offset']:.3g}",
        f"{first['value_offset']:.3g}",
        *(
          _cell(rows, capture, "bf16-fa2", c)
          for c in (
            "captured",
            "keys centred",
            "values centred",
            "both centred",
          )
        ),  # fmt: skip
        _cell(rows, capture, "jax_mha", "captured"),
        _cell(rows, capture, "jax_mha", "keys centred"),
        *(
          _cell(rows, capture, k, "captured")
          for k in ("bf16-fa2-stable", "o_lo", "center_kv", "xla")
        ),
        _cell(rows, capture, "bf16-fa2", "captured", "eq1_share"),
        _cell(rows, capture, "bf16-fa2", "captured", "cos_mean_key"),
      ]
    )
  return reporting_table(header, body)


def plot(rows, path) -> None:
  """dQ's error (x FlexAttention's limit) against the layer's key offset,
  one series per kernel, keys as captured."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for kernel in dict.fromkeys(r["kernel"] for r in rows):
    mine = [
      r
      for r in rows
      if r["kernel"] == kernel and r["counterfactual"] == "captured"
    ]
    ax.scatter(
      [r["key_offset"] for r in mine],
      [r["dq_flex_ratio"] for r in mine],
      label=kernel,
      s=18,
    )
  ax.axhline(1.0, color="grey", lw=0.8, ls="--")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("key offset: |mean key| / rms spread (largest head)")
  ax.set_ylabel("dQ mean error / FlexAttention's limit")
  ax.set_title("Captured BF16 layers: dQ against the shared key component")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


SHIFT_REGIMES = ("key_offset", "key_shift", "value_shift")


def audit_cells(rows, regime: str, policy: str) -> str:
  """The worst dQ (or any tensor's) value / limit of FlexAttention's rule
  (BF16) or FlashAttention's (FP32) over a regime's rows at a policy,
  with the tensor; "-" where none ran."""
  rule = "flexattention" if policy.startswith("bf16") else "flashattention"
  mine = [
    r
    for r in rows
    if r.get("regime") == regime and r["policy"] == policy and "error" not in r
  ]
  if not mine:
    return "-"
  worst = max(mine, key=lambda r: rule_ratio(r, rule))
  return f"{rule_ratio(worst, rule):.2g}x ({worst['tensor']})"


def kernels_table(audits: dict) -> str:
  """Markdown: per audited kernel ({name: (headline, rows)}), pass or
  fail and, per regime, the worst ratio to FlexAttention's limit in
  BF16 and to FlashAttention's in FP32."""
  header = ["kernel", "verdict"]
  header += [f"{r} BF16" for r in SHIFT_REGIMES]
  header += [f"{r} FP32" for r in SHIFT_REGIMES]
  body = []
  for name, (headline, rows) in audits.items():
    body.append(
      [
        name,
        headline.get("verdict", "-"),
        *(audit_cells(rows, r, "bf16-framework") for r in SHIFT_REGIMES),
        *(audit_cells(rows, r, "fp32") for r in SHIFT_REGIMES),
      ]
    )
  return reporting_table(header, body)


def load_audits(root) -> dict:
  """{run directory name: (headline, rows)} of the audits under `root`
  (`launch/offset_audits.sh`), by name."""
  import json
  import pathlib

  out = {}
  for folder in sorted(p for p in pathlib.Path(root).iterdir() if p.is_dir()):
    headline = folder / "headline.json"
    if headline.exists():
      rows = [
        json.loads(line)
        for line in (folder / "metrics.jsonl").read_text().splitlines()
      ]
      out[folder.name] = (json.loads(headline.read_text()), rows)
  return out


TRAINING_RUNS = {
  "flash": "bf16-fa2",
  "flash_fixed": "center_kv",
  "flash_stable": "bf16-fa2-stable",
}


def _median(values) -> float:
  values = [v for v in values if v is not None]
  return float(np.median(values)) if values else float("nan")


def _spikes(losses_by_step) -> int:
  """Logged steps whose eval loss rose by more than 10% over the last."""
  steps = sorted(losses_by_step)
  return sum(
    losses_by_step[b] > 1.1 * losses_by_step[a]
    for a, b in zip(steps, steps[1:])
  )


def training_table(runs: dict) -> str:
  """Markdown: per training run ({label: metrics rows}) and flash arm,
  the W_Q gradient error against FP32 attention's (relative norm, first
  and second half of the logged steps), its cosine with the previous
  logged error and with the sum of every earlier one (median, largest),
  the layers' largest key offset, loss spikes and the final eval loss
  (mean over replicates)."""
  header = [
    "run", "arm", "W_Q error (1st half)", "(2nd half)", "cos previous",
    "cos running sum", "largest", "key offset (max)", "loss spikes",
    "final eval loss",
  ]  # fmt: skip
  body = []
  for label, rows in runs.items():
    end = max(r["step"] for r in rows if r.get("kind") == "run")
    for run, arm in TRAINING_RUNS.items():
      offsets = [
        r["key_offset_ratio"]
        for r in rows
        if r.get("kind") == "attention" and r["run"] == run
      ]
      errors = [
        r
        for r in rows
        if r.get("kind") == "grad_error"
        and r["run"] == run
        and r["weight"].endswith("query")
      ]
      steps = sorted({r["step"] for r in errors})
      half = set(steps[: len(steps) // 2])
      evals = [r for r in rows if r.get("kind") == "run" and r["run"] == run]
      spikes = 0
      for replicate in {r["replicate"] for r in evals}:
        mine = {
          r["step"]: r["eval_loss"]
          for r in evals
          if r["replicate"] == replicate
        }
        spikes += _spikes(mine)
      summed = [r["cos_running_sum"] for r in errors]
      first = [r["rel_error"] for r in errors if r["step"] in half]
      second = [r["rel_error"] for r in errors if r["step"] not in half]
      body.append(
        [
          label,
          arm,
          f"{_median(first):.2g}",
          f"{_median(second):.2g}",
          f"{_median(r['cos_previous'] for r in errors):.2f}",
          f"{_median(summed):.2f}",
          f"{max(v for v in summed if v is not None):.2f}",
          f"{max(offsets):.3g}",
          spikes,
          f"{np.mean([r['eval_loss'] for r in evals if r['step'] == end]):.3f}",
        ]
      )
  return reporting_table(header, body)


def price_table(rows) -> str:
  """Markdown: the fixes' time against the base preset's, per mode and
  masking, from the price stage's rows (`launch/gpu_stage.py`)."""
  points: dict = {}
  for r in rows:
    if "median_ms" not in r:
      continue
    name = r["implementation"]
    if name == "pallas":
      name = "stable" if r["precision"].endswith("-stable") else "base"
    key = (r["mode"], r["causal"], r["seq_len"], r["pair"])
    points.setdefault(key, {})[name] = r["median_ms"]
  body = []
  for (mode, causal, length, pair), times in sorted(points.items()):
    base = times.get("base")
    body.append(
      [
        mode.replace("_", "+"),
        "yes" if causal else "no",
        length,
        pair,
        f"{base:.1f}" if base else "-",
        *(
          f"{times[n]:.1f} ({times[n] / base:.2f}x)"
          if base and n in times
          else "-"
          for n in ("stable", "center_kv")
        ),
      ]
    )
  header = ["mode", "causal", "length", "base preset", "base ms", "stable ms",
            "center_kv ms"]  # fmt: skip
  return reporting_table(header, body)
