"""The stability sweep across sizes: sizes and their configs, the trend of
each change with size, and the sweep's units spread over shards (with a
stand-in for the one-model sweep, so nothing trains)."""

import json

import numpy as np
import pytest

from stableattn.configs import stability as stability_config
from stableattn.experiments import stability
from stableattn.experiments.stability import across_sizes


def _config(**changes):
  c = stability_config.get_config("sizes_smoke")
  for k, v in changes.items():
    c[k] = v
  return c


def test_a_size_is_the_one_model_sweep_with_that_model():
  config = _config(sizes="w16-d1,w32-d2")
  (_, small), (name, large) = across_sizes.sizes_of(config)
  assert name == "w32-d2" and large.parameters == 8 * small.parameters
  unit = across_sizes.unit_config(config, large)
  assert (unit.model.width, unit.model.depth, unit.model.heads) == (32, 2, 2)
  assert unit.sizes == "" and unit.model.seq_len == config.model.seq_len
  unit.model.width = config.model.width  # nothing else changed
  unit.model.depth, unit.model.heads = config.model.depth, config.model.heads
  unit.sizes = config.sizes
  assert unit.to_dict() == config.to_dict()


@pytest.mark.parametrize(
  "sizes, message",
  [
    ("w16-d1,w16", "is not 'w<width>-d<depth>'"),
    ("w16-d1,w24-d1", "multiple of config.size_head_dim"),
    ("w16-d1,w16-d1", "names a size twice"),
  ],
)
def test_bad_sizes_are_refused_with_what_is_valid(sizes, message):
  with pytest.raises(ValueError, match=message):
    across_sizes.sizes_of(_config(sizes=sizes))


def test_one_size_or_a_shard_without_sizes_is_refused():
  with pytest.raises(ValueError, match="needs two or more"):
    stability.run(_config(sizes="w16-d1"), "unused")
  with pytest.raises(ValueError, match="spread a sweep over sizes"):
    stability.run(_config(sizes="", shard="1/2"), "unused")


def _points(slope, noise, seed=0):
  rng = np.random.default_rng(seed)
  return [
    (
      n,
      (0.01 + slope * np.log10(n / 1e5)) * (1 + noise * rng.standard_normal()),
    )
    for n in (1e5, 3e5, 8e5)
    for _ in range(5)
  ]


def test_the_size_trend_judges_growth_and_its_absence():
  grows = across_sizes.size_trend(_points(0.02, 0.05))
  assert grows["low"] < 0.02 < grows["high"] and grows["verdict"] == "grows"
  flat = across_sizes.size_trend(_points(0.0, 0.3))
  assert flat["verdict"] == "no trend told apart"
  assert across_sizes.size_trend(_points(0.0, 0.1)[:2]) is None
  two_sizes = [p for p in _points(0.02, 0.05) if p[0] < 5e5]
  assert across_sizes.size_trend(two_sizes)["verdict"].startswith(
    "no verdict: 2 distinct parameters values"
  )


def _comparison(per_replicate):
  mean = float(np.mean(per_replicate))
  return {
    "lr_sensitivity_per_replicate": per_replicate,
    "lr_sensitivity_difference": {
      "mean": mean,
      "low": mean - 0.01,
      "high": mean + 0.01,
      "count": 5,
    },  # fmt: skip
    "spread_ratio": {"BF16-vs-FP32": {"mean": 1.0, "low": 0.5, "high": 2.0}},
  }


def _fake_sweep(trained):
  """A one-model sweep that writes a headline whose Flash change grows
  with the width, and records what it trains (a finished one resumes to
  nothing)."""

  def run_one(config, workdir, *, restart=False):
    width = int(config.model.width)
    if (workdir / "headline.json").exists():
      return json.loads((workdir / "headline.json").read_text())
    trained.append(width)
    workdir.mkdir(parents=True, exist_ok=True)
    flash = [0.001 * width * (1 + 0.01 * r) for r in range(5)]
    headline = {
      "learning_rates": [0.01, 1.0],
      "replicates": 5,
      "arms": {"flash/bf16/none": {"largest_stable_lr": {"mean": 0.3}}},
      "verdicts": {
        "variants": {"flash (none)": _comparison(flash)},
        "precision": {"none": _comparison([0.01, -0.01, 0.01, -0.01, 0.0])},
        "machine": {},
      },
    }
    (workdir / "headline.json").write_text(json.dumps(headline))
    return headline

  return run_one


def test_shards_sweep_each_size_once_and_the_last_one_reports(tmp_path):
  trained = []
  run_one = _fake_sweep(trained)
  config = _config(sizes="w16-d1,w32-d1,w64-d1", shard="2/2")
  config.train.reference_precision = "fp32"  # the precision reference
  waiting = across_sizes.run(config, tmp_path, run_one)
  assert trained == [32] and waiting["waiting_for"] == ["w16-d1", "w64-d1"]
  config.shard = "1/2"
  headline = across_sizes.run(config, tmp_path, run_one)
  assert sorted(trained) == [16, 32, 64]  # each size once
  trend = headline["trends"]["flash (none)"]
  assert trend["verdict"] == "grows" and trend["points"] == 15
  reference = headline["trends"]["BF16 vs FP32 training (none)"]
  assert reference["verdict"] == "no trend told apart"
  text = (tmp_path / "report.md").read_text()
  assert "## Does the change grow with size?" in text and "**grows**" in text
  assert (tmp_path / "stability_sizes.png").exists()
  config.shard = "1/1"
  again = across_sizes.run(config, tmp_path, run_one)
  assert (
    sorted(trained) == [16, 32, 64] and again["trends"] == headline["trends"]
  )
