"""Context parallelism: ring attention's output and gradients against FP64
and against the same kernel on one device.

Each point shards one attention over n devices (`stableattn.ring_attention`)
and measures the output and dQ, dK, dV: the error against FP64 next to the
same-policy Baseline's (FlashAttention's rule: 2x forward, 3x gradients,
plus a few ulps), and the difference from our kernel on one device, in
ulps of the output format and as a share of TransformerEngine's
context-parallel test tolerance (`tests/pytorch/attention/
run_attention_with_cp.py`: |cp - single| <= atol + rtol |single| with
atol = rtol = 2.5e-2 in BF16 and 5e-3 in FP16).

Axes: device count for each layout (causal with load balance, causal
contiguous, no mask), and at one device count the merge schedule
("final"), the ring direction and the partials' format (the input format
instead of FP32), one at a time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.auditing.invariance import ulp_at
from stableattn.experiments.engine import Case
from stableattn.experiments.forward.study import (
  Claim,
  Section,
  Study,
  baseline,
  claim_findings,
  flash,
  policies,
  require,
  row,
  verdict,
)
from stableattn.harness.config_values import spec
from stableattn.harness.plotting import Series, line_plot
from stableattn.harness.reporting import num, table
from stableattn.numerics.metrics import rounding_floor, safe_ratio
from stableattn.numerics.precision import Precision
from stableattn.ops.ring import ring_attention
from stableattn.ops.ring_plan import CONTEXT_AXIS, context_mesh

# layout -> (causal, balanced)
LAYOUTS = {
  "causal_balanced": (True, True),
  "causal": (True, False),
  "full": (False, False),
}
# One change at a time from (online merge, forward ring, FP32 partials).
VARIATIONS = {
  "none": {},
  "final_merge": {"merge": "final"},
  "reverse_ring": {"reverse": True},
  "input_partials": {"partials": "input"},
}
TENSORS = ("out", "dq", "dk", "dv")
# TransformerEngine's context-parallel test tolerance (atol = rtol).
TE_TOLERANCE = {"bf16": 2.5e-2, "fp16": 5e-3}
# "Bits, not accuracy": the ring's error against FP64 stays within this
# factor of the one-device kernel's.
SAME_ACCURACY = 1.25


@dataclasses.dataclass(frozen=True)
class Config:
  policies: tuple[str, ...] = spec(parse=policies)
  layouts: tuple[str, ...] = spec(choices=tuple(LAYOUTS))
  device_counts: tuple[int, ...] = spec(minimum=1)
  # The device count at which merge, direction and partials vary.
  vary_at: int = spec(minimum=0)  # 0: no variations
  seq_len: int = spec(minimum=2)
  seeds: int = spec(minimum=1)


def _check_devices(c: Config) -> None:
  context_mesh(max((*c.device_counts, c.vary_at)))  # raises if too few
  for n in (*c.device_counts, c.vary_at):
    if n and c.seq_len % (2 * n):
      raise ValueError(
        f"context_parallel: seq_len {c.seq_len} must be divisible by "
        f"2 x {n} devices (two chunks per device when balanced)."
      )


def _ring_policy(policy: str, partials: str) -> Precision:
  p = Precision.from_name(policy)
  return p.with_stage(partials=p.inputs if partials == "input" else partials)


def _values(name, fmt, ring, single, base, golden) -> dict:
  gradient = name != "out"
  error = float(np.max(np.abs(ring - golden)))
  single_error = float(np.max(np.abs(single - golden)))
  base_error = float(np.max(np.abs(base - golden)))
  factor = 3.0 if gradient else 2.0
  floor = rounding_floor(golden, fmt)
  diff = np.abs(ring - single)
  tolerance = TE_TOLERANCE[fmt] * (1.0 + np.abs(single))
  ulp = ulp_at(np.max(np.abs(golden)), fmt)
  return {
    "error": error,
    "single_error": single_error,
    "baseline_error": base_error,
    "ratio_to_baseline": safe_ratio(error, base_error),
    "ratio_to_single": safe_ratio(error, single_error),
    "fa_rule": float(error <= factor * base_error + floor),
    "diff_max_abs": float(diff.max()),
    "diff_ulps": float(diff.max() / ulp),
    "bitwise": float(np.array_equal(ring, single)),
    "te_share": float((diff / tolerance).max()),
    "finite": float(np.isfinite(ring).all()),
  }


def _by_layout(rows) -> dict:
  out: dict = {}
  for r in rows:
    if r["variation"] == "none" and r["tensor"] == "out":
      out.setdefault((r["policy"], r["layout"]), []).append(r)
  return out


def _rows(rows, claim):
  return require(rows, claim, "context_parallel")


def fa_rule(rows) -> dict:
  """Ring attention passes FlashAttention's rule against FP64 (2x the
  Baseline's error forward, 3x for gradients) at every point."""
  rows = _rows(rows, "cp_fa_rule")
  failing = [
    f"{r['policy']} {r['layout']} {r['variation']} n={r['devices']} "
    f"{r['tensor']}"
    for r in rows
    if r["fa_rule_min"] < 1.0
  ]
  return {
    "verdict": verdict(len(rows) - len(failing), len(rows)),
    "rows": len(rows),
    "failing": failing,
    "worst": max(r["ratio_to_baseline_max"] for r in rows),
  }


def te_tolerance(rows) -> dict:
  """Ring attention stays within TransformerEngine's context-parallel test
  tolerance of the one-device kernel; how much of it is used."""
  rows = _rows(rows, "cp_te_tolerance")
  within = [r for r in rows if r["te_share_max"] <= 1.0]
  worst = max(rows, key=lambda r: r["te_share_max"])
  return {
    "verdict": verdict(len(within), len(rows)),
    "rows": len(rows),
    "largest_share": worst["te_share_max"],
    "largest_ulps": max(r["diff_ulps_max"] for r in rows),
  }


def bits_not_accuracy(rows) -> dict:
  """With FP32 partials the ring changes bits, not accuracy: its output's
  error against FP64 stays within SAME_ACCURACY of one device's."""
  rows = _rows(
    [
      r
      for r in rows
      if r["tensor"] == "out" and r["variation"] != "input_partials"
    ],
    "cp_bits_not_accuracy",
  )
  worst: dict = {}
  for r in rows:
    worst[r["policy"]] = max(
      worst.get(r["policy"], 0.0), r["ratio_to_single_max"]
    )
  same = [p for p, v in worst.items() if v <= SAME_ACCURACY]
  changed = sum(1 for r in rows if r["bitwise_min"] < 1.0)
  return {
    "verdict": verdict(len(same), len(worst)),
    "worst_ratio": worst,
    "changed_bits": changed,
    "rows": len(rows),
    "factor": SAME_ACCURACY,
  }


class ContextParallel(Study):
  name = "context_parallel"
  title = "Context parallelism: ring attention vs one device and FP64"
  Config = Config
  extendable = ("seeds",)
  claims = {
    "cp_fa_rule": Claim(
      "ring attention passes FlashAttention's rule against FP64",
      fa_rule,
      lambda c: (
        f"{c['rows'] - len(c['failing'])} of {c['rows']} rows pass; worst "
        f"error / Baseline's {num(c['worst'])}"
        + (f"; failing: {', '.join(c['failing'][:4])}" if c["failing"] else "")
      ),
    ),
    "cp_te_tolerance": Claim(
      "ring attention is within TransformerEngine's CP test tolerance of one "
      "device",
      te_tolerance,
      lambda c: (
        f"{c['rows']} rows; at most {num(c['largest_share'])} of the "
        f"tolerance used ({num(c['largest_ulps'])} ulps of the format)"
      ),
    ),
    "cp_bits_not_accuracy": Claim(
      "with FP32 partials the ring changes bits, not accuracy",
      bits_not_accuracy,
      lambda c: (
        f"outputs differ from one device's in {c['changed_bits']} of "
        f"{c['rows']} rows; worst error / one device's: "
        + ", ".join(f"{p} {num(v)}" for p, v in c["worst_ratio"].items())
        + f" (same: <= {c['factor']})"
      ),
    ),
  }

  def seeds(self, common, config) -> int:
    return config.seeds

  def points(self, s, c):
    _check_devices(c)
    points = [
      {"policy": p, "layout": layout, "devices": n, "variation": "none"}
      for p in c.policies
      for layout in c.layouts
      for n in c.device_counts
    ]
    if c.vary_at:
      points += [
        {"policy": p, "layout": layout, "devices": c.vary_at, "variation": v}
        for p in c.policies
        for layout in c.layouts
        for v in VARIATIONS
        if v != "none"
      ]
    return points

  def measure(self, engine, s, c, p, seed):
    causal, balanced = LAYOUTS[p["layout"]]
    variation = {"merge": "online", "reverse": False, "partials": "fp32"}
    variation |= VARIATIONS[p["variation"]]
    fmt = Precision.from_name(p["policy"]).inputs
    case = Case(s.distributions[0], s.shape(c.seq_len), fmt, seed, causal)
    q, k, v = engine.inputs(case)
    d_out = engine.d_out(case)
    policy = _ring_policy(p["policy"], variation["partials"])
    mesh = context_mesh(p["devices"])

    def ring(q, k, v):
      return ring_attention(
        q,
        k,
        v,
        mesh=mesh,
        axis=CONTEXT_AXIS,
        options=flash(policy, s.block_q, s.block_k).options,
        causal=causal,
        balanced=balanced,
        merge=variation["merge"],
        reverse=variation["reverse"],
      )

    out, vjp = jax.vjp(ring, q, k, v)
    grads = vjp(jnp.asarray(d_out).astype(out.dtype))
    ring_values = [np.asarray(x.astype(jnp.float64)) for x in (out, *grads)]
    single_kernel = flash(p["policy"], s.block_q, s.block_k)
    single = [
      engine.output(single_kernel, case),
      *engine.grads(single_kernel, case),
    ]
    base_kernel = baseline(p["policy"])
    base = [engine.output(base_kernel, case), *engine.grads(base_kernel, case)]
    golden = [engine.golden(case), *engine.golden_grads(case)]
    return [
      row(
        {"tensor": name},
        _values(name, fmt, r, one, b, g),
      )
      for name, r, one, b, g in zip(TENSORS, ring_values, single, base, golden)
    ]

  def ran(self, s, c):
    return (
      f"one attention of length {c.seq_len} ({s.shape_text()}, tiles "
      f"{s.block_q}x{s.block_k}) sharded over {list(c.device_counts)} "
      f"devices, layouts {list(c.layouts)}, policies {list(c.policies)}; "
      + (
        f"at {c.vary_at} devices also a final merge, the reverse ring and "
        "partials in the input format; "
        if c.vary_at
        else ""
      )
      + f"output and dQ, dK, dV (standard-normal dO); {c.seeds} seed(s)."
    )

  def report(self, ctx):
    rows = ctx.rows
    if not rows:
      return None
    ordered = sorted(
      rows,
      key=lambda r: (
        r["policy"],
        r["layout"],
        r["variation"],
        r["devices"],
        TENSORS.index(r["tensor"]),
      ),
    )
    header = [
      "policy",
      "layout",
      "change",
      "devices",
      "tensor",
      "error / Baseline's",
      "FA rule",
      "error / one device's",
      "diff from one device (ulps)",
      "share of TE tolerance",
    ]
    body = [
      [
        r["policy"],
        r["layout"],
        r["variation"],
        r["devices"],
        r["tensor"],
        num(r["ratio_to_baseline_max"]),
        "passes" if r["fa_rule_min"] == 1.0 else "**fails**",
        num(r["ratio_to_single_max"]),
        num(r["diff_ulps_max"]),
        num(r["te_share_max"]),
      ]
      for r in ordered
    ]
    findings = claim_findings(self.claims, ctx)
    series = []
    for (policy, layout), group in _by_layout(rows).items():
      group.sort(key=lambda r: r["devices"])
      series.append(
        Series(
          f"{policy}, {layout}",
          [r["devices"] for r in group],
          [r["diff_ulps_mean"] for r in group],
        )
      )
    plots = []
    if series:
      plot = line_plot(
        ctx.out_dir / "context_parallel.png",
        series,
        title="Ring attention's output against one device's (mean over seeds)",
        xlabel="devices in the ring",
        ylabel="largest difference (ulps of the format)",
        logy=False,
      )
      plots.append(plot.name)
    return Section(table(header, body), findings, plots)


STUDY = ContextParallel()
