"""The mismatch experiment's report: every pair with intervals, subjects
against references, verdicts from rows, figures."""

from __future__ import annotations

import json

import numpy as np

from stableattn.experiments.mismatch.pairs import PAIRS, REFERENCE, SUBJECT
from stableattn.experiments.mismatch.policy_gradient import collapse_step
from stableattn.experiments.monitor_report import (
  attention_section,
  trained_model_verdict,
)
from stableattn.harness import environment
from stableattn.harness.plotting import Series, interval_plot, line_plot
from stableattn.harness.reporting import (
  Interval,
  mean_interval,
  num,
  resolution,
  table,
)
from stableattn.harness.rundir import RunDir

# Bins of |log(p_train / p_sample)| for the importance-ratio figure: exact
# zeros, then two bins per decade from 1e-10 to 10, then beyond.
HISTOGRAM_EDGES = np.concatenate([[0.0], np.logspace(-10, 1, 23), [np.inf]])
# The metric subjects are divided by references with.
RATIO_METRIC = "rollout_probs_diff_mean"
SUMMARY_METRICS = (
  "rollout_probs_diff_max",
  "rollout_probs_diff_mean",
  "kl_k3",
  "tis_share",
  "greedy_divergence",
)
# The per-sequence metrics a row keeps (`mismatch.token_metrics`' names),
# each 0 where the two paths agree (the control's test).
SEQUENCE_METRICS = (
  "rollout_probs_diff_max",
  "rollout_probs_diff_mean",
  "kl_k1",
  "kl_k3",
  "log_ratio_p01",
  "log_ratio_p99",
  "tis_share",
)


def histogram(log_ratio) -> list[int]:
  """Counts of |log ratio|: [exactly 0, then the bins of HISTOGRAM_EDGES
  above 1e-10 ...]; values in (0, 1e-10) join the first decade's bin."""
  magnitude = np.abs(np.asarray(log_ratio, np.float64))
  zero = int(np.sum(magnitude == 0))
  positive = np.clip(magnitude[magnitude > 0], 1e-10, None)
  counts, _ = np.histogram(positive, HISTOGRAM_EDGES[1:])
  return [zero, *counts.tolist()]


def _values(rows, pair: str, metric: str) -> list[float]:
  """Every sequence's value, in (seed, sequence) order."""
  chosen = sorted(
    (r for r in rows if r["pair"] == pair), key=lambda r: r["seed"]
  )
  return [v for r in chosen for v in r[metric]]


def pair_intervals(rows) -> dict:
  """{pair: {metric: Interval}} over prompts and seeds."""
  pairs = list(dict.fromkeys(r["pair"] for r in rows))
  return {
    p: {m: mean_interval(_values(rows, p, m)) for m in SUMMARY_METRICS}
    for p in pairs
  }


def ratio(rows, subject: str, reference: str) -> Interval | None:
  """Geometric mean of subject / reference of the mean |p_s - p_t| per
  sequence, paired by prompt and seed; None where no pair of positive
  values exists."""
  a, b = (
    _values(rows, subject, RATIO_METRIC),
    _values(rows, reference, RATIO_METRIC),
  )
  paired = [x / y for x, y in zip(a, b) if x > 0 and y > 0]
  return mean_interval(paired, geometric=True) if paired else None


def _side(interval: Interval | None, below: str, above: str) -> str:
  if interval is None:
    return "not measured"
  if interval.high is not None and interval.high < 1:
    return below
  if interval.low is not None and interval.low > 1:
    return above
  return "cannot be told apart"


def _ratio_verdict(r: Interval | None, below: str, above: str) -> dict:
  return {
    "verdict": _side(r, below, above),
    "ratio": None if r is None else r.as_dict(),
    "resolution": resolution(r, geometric=True),
  }


def verdicts(rows) -> dict:
  present = {r["pair"] for r in rows}
  out = {}
  if "control" in present:
    control = [r for r in rows if r["pair"] == "control"]
    zero = all(v == 0 for r in control for m in SEQUENCE_METRICS for v in r[m])
    # ... and greedy decoding with it never parts from itself.
    zero = zero and all(
      v == r["new_tokens"] for r in control for v in r["greedy_divergence"]
    )
    out["control"] = {
      "verdict": "exactly 0" if zero else "NOT 0: the measurement is broken",
    }
  if {"flash_decode_vs_train_bf16", "head_bf16_vs_fp32"} <= present:
    out["attention_vs_head"] = _ratio_verdict(
      ratio(rows, "flash_decode_vs_train_bf16", "head_bf16_vs_fp32"),
      "attention's mismatch is below the head's",
      "attention's mismatch is above the head's",
    )
  activations = "flash_decode_vs_train_bf16_activations"
  if {activations, "flash_decode_vs_train_bf16"} <= present:
    out["bf16_activations"] = _ratio_verdict(
      ratio(rows, activations, "flash_decode_vs_train_bf16"),
      "BF16 activations lower the same kernel's mismatch",
      "BF16 activations raise the same kernel's mismatch",
    )
  if {activations, "model_bf16_activations_vs_fp32"} <= present:
    out["attention_vs_bf16_model"] = _ratio_verdict(
      ratio(rows, activations, "model_bf16_activations_vs_fp32"),
      "in a BF16 model, attention's mismatch is below the model's own",
      "in a BF16 model, attention's mismatch is above the model's own",
    )
  if {"flash_decode_vs_train_fp16", "flash_decode_vs_train_bf16"} <= present:
    r = ratio(rows, "flash_decode_vs_train_fp16", "flash_decode_vs_train_bf16")
    out["fp16_vs_bf16"] = _ratio_verdict(
      r,
      "FP16 lowers the mismatch (Qi et al.'s direction holds)",
      "FP16 raises the mismatch (against Qi et al.)",
    )
    out["fp16_vs_bf16"]["removed_share"] = None if r is None else 1 - r.mean
  return out


def _ratio_table(rows) -> str:
  present = list(dict.fromkeys(r["pair"] for r in rows))
  subjects = [p for p in present if PAIRS[p].role == SUBJECT]
  references = [p for p in present if PAIRS[p].role == REFERENCE]
  body = []
  for s in subjects:
    cells = []
    for ref in references:
      r = ratio(rows, s, ref)
      cells.append("-" if r is None else r.text("x"))
    body.append([s, *cells])
  return table(["subject / reference", *references], body)


# The final reward of a policy-gradient run: its mean over the last steps.
FINAL_STEPS = 5
# Fewer replicates give no verdict: two runs that happen to differ by the
# same token count would give a zero-width interval.
MIN_REPLICATES = 3


def final_reward(run: dict) -> float:
  return float(np.mean(run["reward"][-FINAL_STEPS:]))


def _difference(rl_rows, arm: str, against: str) -> Interval | None:
  """Final reward of `arm` minus `against`'s, paired by replicate."""
  by = {(r["arm"], r["replicate"]): r for r in rl_rows}
  diffs = [
    final_reward(by[(arm, i)]) - final_reward(by[(against, i)])
    for (name, i) in by
    if name == arm and (against, i) in by
  ]
  return mean_interval(diffs) if diffs else None


def _sign(interval: Interval | None, what: str) -> dict:
  if interval is None:
    return {"verdict": "not measured"}
  if interval.count < MIN_REPLICATES:
    verdict = (
      f"{interval.count} replicate(s): too few to tell (at least "
      f"{MIN_REPLICATES})"
    )
  elif interval.low > 0:
    verdict = f"{what} raises the final reward"
  elif interval.high < 0:
    verdict = f"{what} lowers the final reward"
  else:
    verdict = "no effect told apart from 0"
  return {
    "verdict": verdict,
    "difference": interval.as_dict(),
    "resolution": resolution(interval),
  }


def policy_collapse(run: dict) -> int | None:
  """The step a run collapsed at (non-finite weights: its last), or None."""
  if not run["finite"]:
    return len(run["reward"])
  return collapse_step(run["reward"])


def rl_verdicts(rl_rows) -> dict:
  out = {
    "mismatch_effect": _sign(
      _difference(rl_rows, "fp8_sampler", "on_policy"),
      "an FP8 sampler (against on-policy)",
    ),
    "tis_effect": _sign(
      _difference(rl_rows, "fp8_sampler_tis", "fp8_sampler"),
      "TIS (with the FP8 sampler)",
    ),
  }
  collapsed = {
    f"{r['arm']}#{r['replicate']}": policy_collapse(r) for r in rl_rows
  }
  out["collapse"] = {
    "verdict": (
      "some runs collapse"
      if any(v is not None for v in collapsed.values())
      else "no run collapses"
    ),
    "at_step": collapsed,
  }
  return out


def _rl_section(run_dir: RunDir, rl_rows, found: dict) -> list[str]:
  if not rl_rows:
    return []
  arms = list(dict.fromkeys(r["arm"] for r in rl_rows))
  body = []
  reward_series, kl_series = [], []
  for arm in arms:
    runs = [r for r in rl_rows if r["arm"] == arm]
    finals = mean_interval([final_reward(r) for r in runs])
    collapsed = [policy_collapse(r) for r in runs]
    body.append(
      [
        arm,
        len(runs),
        finals.text(),
        num(max(max(r["kl_k3"]) for r in runs)),
        num(max(max(r["rollout_probs_diff_max"]) for r in runs)),
        num(float(np.mean([np.mean(r["tis_share"]) for r in runs]))),
        ", ".join("no" if c is None else f"step {c}" for c in collapsed),
      ]
    )
    steps = min(len(r["reward"]) for r in runs)
    x = list(range(1, steps + 1))
    reward_series.append(
      Series(arm, x, np.mean([r["reward"][:steps] for r in runs], 0).tolist())
    )
    kl_series.append(
      Series(arm, x, np.mean([r["kl_k3"][:steps] for r in runs], 0).tolist())
    )
  reward_png = line_plot(
    run_dir.path / "rl_reward.png",
    reward_series,
    title="Policy gradient: mean reward per step (mean over replicates)",
    xlabel="step",
    ylabel="share of the target byte",
    logx=False,
    logy=False,
  )
  kl_png = line_plot(
    run_dir.path / "rl_mismatch.png",
    kl_series,
    title="Sampler-trainer KL (k3) per step",
    xlabel="step",
    ylabel="KL k3",
    logx=False,
  )
  lines = [
    f"- **{name}**: {v['verdict']}"
    + (
      f" (difference {Interval(**v['difference']).text()})"
      if v.get("difference")
      else ""
    )
    for name, v in found.items()
  ]
  header = ["arm", "replicates", "final reward", "max KL k3"]
  header += ["max |p_s - p_t|", "TIS share", "collapse"]
  return [
    "",
    "## Does it matter: a policy-gradient run",
    "",
    f"Final reward: the mean over the last {FINAL_STEPS} steps, 95% interval "
    "over replicates; differences paired by replicate. A run collapses "
    "where its reward, averaged over 5 steps, falls below half its best "
    "average after rising (or where its weights stop being finite).",
    "",
    *lines,
    "",
    table(header, body),
    "",
    f"![reward]({reward_png.name})",
    f"![mismatch over steps]({kl_png.name})",
  ]


def _figures(run_dir: RunDir, rows, stats, labels):
  """The mismatch per pair with intervals, and the distribution of
  |log importance ratio| per token; their paths."""
  mismatch_png = interval_plot(
    run_dir.path / "mismatch.png",
    labels,
    [stats[p][RATIO_METRIC] for p in labels],
    title="Mean |p_sample - p_train| per sequence, 95% interval",
    ylabel="mean |p_sample - p_train|",
  )
  # Geometric bin centres; the last (open) bin is drawn at 30.
  edges = HISTOGRAM_EDGES[1:]
  centers = np.sqrt(edges[:-2] * edges[1:-1]).tolist() + [30.0]
  series = []
  for p in labels:
    counts = np.sum(
      [r["log_ratio_histogram"] for r in rows if r["pair"] == p], 0
    )
    if counts.sum():
      exact = counts[0] / counts.sum()
      label = p if exact == 1 else f"{p} ({exact:.0%} exactly 0)"
      series.append(
        Series(label, centers, (counts[1:] / counts.sum()).tolist())
      )
  ratio_png = line_plot(
    run_dir.path / "importance_ratio.png",
    series,
    title="|log(p_train / p_sample)| per token",
    xlabel="|log importance ratio| (the rightmost point: above 10)",
    ylabel="share of tokens",
  )
  return mismatch_png, ratio_png


def _write_data(run_dir: RunDir, found, rl_found, stats, training_log, env):
  """headline.json (verdicts, intervals per pair, the training log, the
  environment) and summary.csv (one line per pair and metric)."""
  headline = {
    "verdicts": found,
    "policy_gradient": rl_found,
    "pairs": {
      p: {m: i.as_dict() for m, i in metrics.items()}
      for p, metrics in stats.items()
    },
    "training": training_log,
    "environment": env,
  }
  run_dir.write_text("headline.json", json.dumps(headline, indent=2) + "\n")
  run_dir.write_csv(
    "summary.csv",
    [
      {"pair": p, "role": PAIRS[p].role, "metric": m, **i.as_dict()}
      for p, metrics in stats.items()
      for m, i in metrics.items()
    ],
  )


def write_report(
  run_dir: RunDir, s, rows, training_log: dict, rl_rows=(), attention=()
) -> dict:
  """report.md and its data; `attention`: the trained model's monitor
  statistics per layer (`stableattn.numerics.monitor`), if measured."""
  if not rows:
    raise ValueError(
      "the mismatch run measured nothing: no verdict from 0 rows."
    )
  stats = pair_intervals(rows)
  found = verdicts(rows)
  rl_found = rl_verdicts(rl_rows) if rl_rows else {}
  env = environment.describe()
  _write_data(run_dir, found, rl_found, stats, training_log, env)
  labels = list(stats)
  mismatch_png, ratio_png = _figures(run_dir, rows, stats, labels)
  pair_rows = [
    [
      p,
      PAIRS[p].role,
      *(stats[p][m].text() for m in SUMMARY_METRICS),
    ]
    for p in labels
  ]
  verdict_lines = [
    f"- **{name}**: {v['verdict']}"
    + (f" (ratio {Interval(**v['ratio']).text('x')})" if v.get("ratio") else "")
    for name, v in found.items()
  ]
  parts = [
    "# Training-inference mismatch",
    "",
    environment.summary_line(env),
    "",
    f"The byte-level model (width {s.model.width}, depth {s.model.depth}, "
    f"{s.model.heads} heads) trained {training_log['steps']} steps in FP32 "
    f"(loss {training_log['first_loss']} -> {training_log['last_loss']}); "
    f"{s.prompts} held-out prompts of {s.prompt_len} bytes, {s.new_tokens} "
    f"sampled bytes each, {s.seeds} seed(s). The sampler decodes over a KV "
    "cache; the trainer scores in one pass (or, where the pair says so, "
    "through the sampler's own decode steps). Means over sequences with 95% "
    "intervals over prompts and seeds.",
    "",
    "## Verdicts",
    "",
    *verdict_lines,
    "",
    "## Every pair",
    "",
    table(["pair", "role", *SUMMARY_METRICS], pair_rows),
    "",
    "Pairs: " + "; ".join(f"`{p}`: {PAIRS[p].meaning}" for p in labels) + ".",
    "",
    "## Subjects against references",
    "",
    f"Geometric mean of the per-sequence ratio of `{RATIO_METRIC}`, paired "
    "by prompt and seed; a sequence where either pair's mismatch is exactly "
    "0 has no ratio and is left out (n counts the rest).",
    "",
    _ratio_table(rows),
    "",
    f"![mismatch per pair]({mismatch_png.name})",
    f"![importance ratios]({ratio_png.name})",
    *_rl_section(run_dir, rl_rows, rl_found),
    *attention_section(attention),
    *trained_model_verdict(run_dir.path, attention, training_log["steps"]),
  ]
  run_dir.write_text("report.md", "\n".join(parts) + "\n")
  return {"verdicts": {**found, **rl_found}, "environment": env}
