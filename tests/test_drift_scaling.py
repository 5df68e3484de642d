"""The drift-scaling sweep: sizes and their plans, the log-log trend and
its verdicts, and (slow) the smoke sweep end to end, killed and resumed."""

import numpy as np
import pytest

from stableattn.configs import drift_scaling as scaling_config
from stableattn.experiments import drift_scaling
from stableattn.experiments.drift_scaling import report, trend
from stableattn.experiments.drift_scaling.sizes import (
  FIXED_STEPS,
  TOKENS_PER_PARAMETER,
  ModelSize,
  plan,
  plans_of,
)
from stableattn.experiments.training_drift.lockstep import Lockstep


def _scaling(**changes):
  c = scaling_config.get_config().scaling
  for k, v in changes.items():
    c[k] = v
  return c


def test_every_size_trains_the_same_tokens_per_parameter_and_per_step():
  scaling = _scaling()
  plans = [plan(ModelSize.parse(s), scaling) for s in scaling.sizes.split(",")]
  for p in plans:
    assert p.batch_size * p.size.context == scaling.tokens_per_step
    per_parameter = p.tokens / p.size.parameters
    step_tokens = scaling.tokens_per_step / p.size.parameters
    assert 0 <= per_parameter - scaling.tokens_per_parameter < step_tokens
  computes = [p.compute for p in plans]
  assert max(computes) / min(computes) >= 30
  contexts = [p.size.context for p in plans]
  assert max(contexts) / min(contexts) >= 4


def test_the_default_drift_studys_model_has_kaplans_parameter_count():
  # 4 layers of (4 + 2 * 4) * 128^2: the default drift config's model.
  assert ModelSize.parse("w128-d4-s64").parameters == 786_432


@pytest.mark.parametrize(
  "size, changes, message",
  [
    ("w64-d2", {}, "w<width>-d<depth>-s<context>"),
    ("w64-d2-s48", {}, "multiple of every size's context"),
    ("w40-d2-s64", {}, "multiple of scaling.head_dim"),
    ("w32-d1-s64", {"tokens_per_parameter": 0.01}, "fewer than scaling.logs"),
  ],
)
def test_bad_sizes_are_refused_with_what_is_valid(size, changes, message):
  with pytest.raises(ValueError, match=message):
    plan(ModelSize.parse(size), _scaling(**changes))


def _points(slope_n, slope_c, noise, sizes, replicates=5, seed=0):
  rng = np.random.default_rng(seed)
  return [
    {
      "parameters": n,
      "context": c,
      "ratio": 0.5
      * (n / 1e5) ** slope_n
      * (c / 64) ** slope_c
      * 10 ** (noise * rng.standard_normal()),
    }
    for n, c in sizes
    for _ in range(replicates)
  ]


GRID = [(1e5, 64), (3e5, 64), (8e5, 64), (3e5, 128), (3e5, 256)]


def test_the_fit_recovers_planted_slopes_and_judges_them():
  fitted = trend.fit(_points(0.3, -0.2, 0.02, GRID))
  n, c = fitted.slopes["parameters"], fitted.slopes["context"]
  assert n.low < 0.3 < n.high and n.verdict == "grows"
  assert c.low < -0.2 < c.high and c.verdict == "shrinks"
  mean, low, high = fitted.at(parameters=1e7, context=64)
  assert low < 0.5 * 100**0.3 < high and low < mean < high


def test_a_flat_ratio_is_no_trend_and_noise_widens_the_interval():
  flat = trend.fit(_points(0.0, 0.0, 0.05, GRID))
  assert {s.verdict for s in flat.slopes.values()} == {"no trend told apart"}
  noisier = trend.fit(_points(0.0, 0.0, 0.5, GRID))
  width = {
    k: s.high - s.low for k, s in noisier.slopes.items()
  }  # same seed: only the noise's scale differs
  for axis, slope in flat.slopes.items():
    assert width[axis] > 5 * (slope.high - slope.low)


def test_no_verdict_from_fewer_than_three_values_of_an_axis():
  two_contexts = [(1e5, 64), (3e5, 64), (8e5, 64), (3e5, 128)]
  fitted = trend.fit(_points(0.3, 0.5, 0.01, two_contexts))
  assert fitted.slopes["parameters"].verdict == "grows"
  assert fitted.slopes["context"].verdict.startswith("no verdict: 2 distinct")


def test_axes_that_move_together_are_refused():
  together = [(1e5, 64), (2e5, 128), (4e5, 256)]
  with pytest.raises(ValueError, match="moves context with parameters"):
    trend.fit(_points(0.1, 0.1, 0.01, together))


def test_the_fixed_step_arm_adds_units_and_shares_the_size_it_matches():
  plans = plans_of(_scaling(), mlp_ratio=4)
  by_name = {p.name: p for p in plans}
  assert by_name["w96-d3-s64"].arms == (TOKENS_PER_PARAMETER, FIXED_STEPS)
  fixed = [p for p in plans if FIXED_STEPS in p.arms]
  assert [p.name for p in fixed] == [
    "w96-d3-s64",
    "w64-d2-s64-steps162",
    "w128-d4-s64-steps162",
  ]
  assert {p.steps for p in fixed} == {162}
  assert len({p.name for p in plans}) == len(plans) == 7
  none = plans_of(_scaling(fixed_step_sizes=""), mlp_ratio=4)
  assert [p.name for p in none] == [p.name for p in plans[:5]]
  with pytest.raises(ValueError, match="set fixed_steps >= 1"):
    plans_of(_scaling(fixed_steps=0), mlp_ratio=4)


def _arm_points(slope_n, slope_t, units, replicates=5, seed=0):
  rng = np.random.default_rng(seed)
  return [
    {
      "parameters": n,
      "context": 64,
      "steps": t,
      "ratio": 0.5
      * (n / 1e5) ** slope_n
      * (t / 100) ** slope_t
      * 10 ** (0.02 * rng.standard_normal()),
    }
    for n, t in units
    for _ in range(replicates)
  ]


def test_steps_that_move_with_parameters_are_named_not_fitted():
  one_arm = [(1e5, 48), (3e5, 162), (8e5, 384)]  # steps = parameters / 2K
  fitted = trend.fit(_arm_points(0.0, 0.4, one_arm))
  assert fitted.moves_with == {"steps": ["parameters"]}
  # The parameters slope holds the steps' effect: 0.4 of it per log step.
  assert fitted.slopes["parameters"].verdict == "grows"


def test_the_fixed_step_arm_separates_the_slopes_of_size_and_steps():
  both_arms = [(1e5, 48), (3e5, 162), (8e5, 384), (1e5, 162), (8e5, 162)]
  fitted = trend.fit(_arm_points(0.0, 0.4, both_arms))
  n, t = fitted.slopes["parameters"], fitted.slopes["steps"]
  assert n.low < 0 < n.high and n.verdict == "no trend told apart"
  assert t.low < 0.4 < t.high and t.verdict == "grows"
  assert not fitted.moves_with
  mean, low, high = fitted.at(parameters=1e8, context=64, steps=400)
  assert low < 0.5 * 4**0.4 < high


def _drift_rows(subject, reference):
  """Drift rows of two pairs: {replicate: ([subject], [reference])}."""
  rows = []
  for replicate, (a, b) in enumerate(zip(subject, reference)):
    for step, (x, y) in enumerate(zip(a, b), start=1):
      for pair, value in (("flash_vs_baseline", x), ("seed", y)):
        rows.append(
          {"kind": "drift", "pair": pair, "scope": "model", "step": step,
           "replicate": replicate, "wasserstein": value}
        )  # fmt: skip
  return rows


def test_a_reference_identical_in_some_replicates_gives_no_ratio():
  size = {"size": "w", "parameters": 1, "context": 1, "compute": 1}
  rows = _drift_rows([[1.0, 2.0], [1.0, 2.0]], [[0.0, 0.0], [4.0, 4.0]])
  (row,) = report.ratio_rows(size, rows, ["seed"], "wasserstein")
  assert row["kind"] == "unbounded" and row["replicates"] == [0]
  rows = _drift_rows([[1.0, 4.0], [2.0, 2.0]], [[4.0, 4.0], [4.0, 4.0]])
  ratios = report.ratio_rows(size, rows, ["seed"], "wasserstein")
  assert [r["ratio"] for r in ratios] == pytest.approx([0.5, 0.5])


@pytest.mark.slow
def test_shards_train_each_size_once_resume_and_the_last_one_reports(
  tmp_path, monkeypatch
):
  trained = []  # (size's seq_len, width, step) of every optimizer step
  original = Lockstep.step

  def counted(self, step):
    trained.append((self.s.seq_len, self.s.model.width, step))
    return original(self, step)

  monkeypatch.setattr(Lockstep, "step", counted)
  config = scaling_config.get_config("smoke")
  # Units 0..4 (w16-d1-s16, w32-d1-s32, w32-d2-s64, w16-d1-s64 and the
  # fixed-step arm's w32-d1-s32-steps6): shard 1/2 takes 0, 2 and 4,
  # shard 2/2 takes 1 and 3. Shard 2 is killed first.
  config.shard = "2/2"
  config.drift.train.stop_at_step = 3
  stopped = drift_scaling.run(config, tmp_path)
  assert stopped["stopped_in"] == "w32-d1-s32"
  assert trained == [(32, 32, 1), (32, 32, 2), (32, 32, 3)]
  config.drift.train.stop_at_step = 0
  config.shard = "1/2"
  waiting = drift_scaling.run(config, tmp_path)
  assert waiting["waiting_for"] == ["w32-d1-s32", "w16-d1-s64"]
  first = [(c, w, s) for c, w, s in trained[3:]]
  assert {(c, w) for c, w, _ in first} == {(16, 16), (64, 32), (32, 32)}
  assert max(s for c, w, s in first if (c, w) == (32, 32)) == 6
  config.shard = "2/2"  # started again: resumes its size, then reports
  headline = drift_scaling.run(config, tmp_path)
  resumed = [s for c, w, s in trained[3 + len(first) :] if (c, w) == (32, 32)]
  assert resumed[0] == 4
  total = sum(r["steps"] for r in headline["sizes"])
  assert len(trained) == total  # no size, no step trained twice
  for ref, fitted in headline["trends"].items():
    assert set(fitted["slopes"]) == {"parameters", "context", "steps"}
    for axis, slope in fitted["slopes"].items():
      assert slope["low"] <= slope["estimate"] <= slope["high"]
      assert slope["verdict"] in VERDICTS, (ref, axis)
    assert fitted["prediction"]["low"] < fitted["prediction"]["high"]
  text = (tmp_path / "report.md").read_text()
  assert "## The trend" in text and (tmp_path / "drift_scaling.png").exists()
  config.shard = "1/1"
  again = drift_scaling.run(config, tmp_path)
  assert len(trained) == total  # a finished sweep trains nothing
  assert again["trends"] == headline["trends"]


def test_a_bad_shard_is_one_line():
  config = scaling_config.get_config("smoke")
  for shard, message in [("3/2", "i must be in 1..n"), ("2", "is not 'i/n'")]:
    config.shard = shard
    with pytest.raises(ValueError, match=message):
      drift_scaling.run(config, "unused")
  config.shard, config.workers = "1/2", 2
  with pytest.raises(ValueError, match="a shard neither restarts"):
    drift_scaling.run(config, "unused")


VERDICTS = ("grows", "shrinks", "no trend told apart")


def test_a_sweep_from_before_the_fixed_step_arm_extends_into_it(tmp_path):
  """Units recorded without arms (before the fixed-step arm) are tagged
  from their plans, so both arms are fitted."""
  from stableattn.harness.environment import describe
  from stableattn.harness.rundir import RunDir

  scaling = _scaling(
    sizes="w64-d2-s64,w96-d3-s64,w128-d4-s64",
    fixed_step_sizes="w64-d2-s64,w128-d4-s64",
  )
  plans = plans_of(scaling, mlp_ratio=4)
  size_rows = []
  for i, p in enumerate(plans):
    drifts = [[0.1 * (i + 1), 0.2 * (i + 1)]] * 2
    references = [[0.4, 0.4], [0.5, 0.6]]
    RunDir(tmp_path / "sizes" / p.name).rewrite_metrics(
      _drift_rows(drifts, references)
    )
    size_rows.append(
      {"kind": "size", "size": p.name, "parameters": p.size.parameters,
       "context": p.size.context, "steps": p.steps, "compute": p.compute,
       "batch_size": p.batch_size, "tokens": p.tokens, "seconds": 1.0}
    )  # fmt: skip
  headline = report.write_report(
    RunDir(tmp_path),
    plans,
    size_rows,
    references=["seed"],
    metric="wasserstein",
    target=ModelSize.parse("w768-d12-s1024"),
    target_steps=400,
    notes=[],
    env=describe(),
  )
  assert set(headline["arm_trends"]) == {TOKENS_PER_PARAMETER, FIXED_STEPS}
  assert set(headline["trends"]["seed"]["slopes"]) == {"parameters", "steps"}


def test_the_docs_quote_the_stored_sweeps_side_by_side():
  from helpers import results_page, stored_headline

  now = stored_headline("drift-scaling-2026-11-27")
  before = stored_headline("drift-scaling-2026-11-26")
  assert report.before_after_tables(now, before) in results_page(folded=False)
  steps = now["trends"]["bf16_vs_fp32"]["slopes"]["steps"]
  assert steps["verdict"] == "grows"
  quoted = (
    f"{steps['estimate']:+.3f} [{steps['low']:+.3f}, {steps['high']:+.3f}]"
  )
  assert quoted in results_page(folded=True)
