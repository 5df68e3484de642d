"""Each defect found by trying to break the tool on purpose, held fixed."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import stableattn as sa
from stableattn.configs import benchmark as benchmark_config
from stableattn.configs import forward_deviation as forward_config
from stableattn.configs import training_drift as drift_config
from stableattn.experiments import benchmark, forward, training_drift
from stableattn.harness.rundir import RunDir

REPO = pathlib.Path(__file__).resolve().parent.parent


def _forward_config(**changes):
  """The smoke config, Fig. 3 only; `changes` by dotted field name."""
  config = forward_config.get_config("smoke")
  config.studies = "format_sweep"
  config.common.formats = "fp32,bf16"
  config.common.seeds = 1
  for key, value in changes.items():
    block = config
    *parents, name = key.split(".")
    for parent in parents:
      block = block[parent]
    block[name] = value
  return config


def _rows(workdir):
  return RunDir(workdir).read_metrics()


@pytest.mark.slow  # trains or measures end to end
def test_forward_rerun_with_another_config_is_refused_naming_the_fields(
  tmp_path,
):
  forward.run(_forward_config(), tmp_path)
  head_dim = {"common.head_dim": 32}
  with pytest.raises(ValueError, match=r"head_dim: 16 there, 32 now"):
    forward.run(_forward_config(**head_dim), tmp_path)
  # The way out: --restart measures afresh, with nothing of the old run.
  forward.run(_forward_config(**head_dim), tmp_path, restart=True)
  keys = {
    json.loads(r["point_key"].split(":", 1)[1])["head_dim"]
    for r in _rows(tmp_path)
  }
  assert keys == {32}


def test_forward_rerun_may_add_seeds_and_the_report_says_so(tmp_path):
  first = forward.run(_forward_config(), tmp_path)
  more = forward.run(_forward_config(**{"common.seeds": 2}), tmp_path)
  assert more["points_skipped"] == first["points_measured"]
  assert more["points_measured"] == first["points_measured"]
  report = (tmp_path / "report.md").read_text()
  assert "*Extended run:*" in report and "seeds 1 -> 2" in report


def test_point_identity_holds_every_setting_that_changes_a_measurement(
  tmp_path,
):
  forward.run(_forward_config(), tmp_path)
  identity = json.loads(_rows(tmp_path)[0]["point_key"].split(":", 1)[1])
  for name in ("batch", "heads", "kv_heads", "head_dim", "block_q", "scale"):
    assert name in identity


def test_a_second_run_in_the_same_workdir_is_refused(tmp_path):
  with RunDir(tmp_path).lock():
    with pytest.raises(RuntimeError, match="Another run is writing"):
      forward.run(_forward_config(), tmp_path)


def test_a_line_cut_in_the_middle_loses_only_itself(tmp_path):
  run_dir = RunDir(tmp_path)
  run_dir.append_metrics([{"step": 1}, {"step": 2}])
  text = run_dir.metrics_path.read_text()
  run_dir.metrics_path.write_text(text[:-4])  # the last row cut mid-line
  run_dir.append_metrics([{"step": 3}, {"step": 4}])  # appended after a crash
  middle = run_dir.metrics_path.read_text().splitlines()
  middle[0] = middle[0][:5]  # and a row damaged in the middle
  run_dir.metrics_path.write_text("\n".join(middle) + "\n")
  assert [r["step"] for r in run_dir.read_metrics()] == [3, 4]
  assert [r["step"] for r in run_dir.read_metrics()] == [3, 4]  # repaired


def _tiny_drift(pairs="identical_rerun", **train):
  config = drift_config.get_config("smoke")
  config.pairs = pairs
  config.train.total_steps = 4
  config.train.warmup_steps = 1
  config.train.log_every = 2
  config.train.checkpoint_every = 2
  for key, value in train.items():
    config.train[key] = value
  return config


@pytest.mark.slow  # trains or measures end to end
def test_drift_with_only_the_control_pair_writes_its_report(tmp_path):
  result = training_drift.run(_tiny_drift(), tmp_path)
  assert result["identical_rerun_max_abs"] == 0.0
  assert (tmp_path / "fig8_all_pairs.png").stat().st_size > 0
  assert (
    "exactly 0 at every logging step" in (tmp_path / "report.md").read_text()
  )


@pytest.mark.slow  # trains or measures end to end
def test_lost_drift_metrics_are_measured_again_not_lost(tmp_path):
  training_drift.run(_tiny_drift(), tmp_path)
  logged = sorted({r["step"] for r in _rows(tmp_path) if r["kind"] == "drift"})
  (tmp_path / "metrics.jsonl").unlink()  # checkpoints stay
  training_drift.run(_tiny_drift(), tmp_path)
  again = sorted({r["step"] for r in _rows(tmp_path) if r["kind"] == "drift"})
  assert again == logged == [0, 2, 4]


@pytest.mark.slow  # trains or measures end to end
def test_drift_rerun_with_another_schedule_or_width_is_refused(tmp_path):
  config = _tiny_drift(stop_at_step=2)
  training_drift.run(config, tmp_path)
  config.train.learning_rate = 1e-3
  with pytest.raises(ValueError, match="train.learning_rate"):
    training_drift.run(config, tmp_path)
  wider = _tiny_drift(stop_at_step=2)
  wider.model.width = 64
  with pytest.raises(ValueError, match="model.width: 32 there, 64 now"):
    training_drift.run(wider, tmp_path)
  # Stopping later is not a change of result: the run resumes.
  assert "seconds" in training_drift.run(_tiny_drift(), tmp_path)


def test_check_refuses_to_pass_over_zero_rows():
  fn = lambda q, k, v: q  # noqa: E731
  with pytest.raises(ValueError, match="seeds must be an integer >= 1"):
    sa.check(fn, seeds=0)
  with pytest.raises(ValueError, match="at least one\\)"):
    sa.check(fn, distributions=())
  with pytest.raises(ValueError, match="at least one shape"):
    sa.check(fn, shapes=())


@pytest.mark.parametrize("precision", ["fp16", "fp16-fa2", "fp16-framework"])
def test_xla_with_fp16_inputs_on_cpu_says_why_not(precision):
  q = np.ones((1, 8, 1, 16), np.float32)
  with pytest.raises(ValueError, match="no FP16 x FP16 -> FP32 dot"):
    sa.attention(q, q, q, implementation="xla", precision=precision)


def test_drift_with_xla_attention_in_fp16_fails_before_training(tmp_path):
  config = _tiny_drift(pairs="fp16_vs_fp32")
  config.attention.baseline = "xla"
  with pytest.raises(ValueError, match="run 'fp16'.*no FP16 x FP16"):
    training_drift.run(config, tmp_path)


def test_benchmark_refuses_an_unknown_mode():
  config = benchmark_config.get_config("smoke")
  config.modes = "nope"
  with pytest.raises(ValueError, match=r"config.modes: unknown \['nope'\]"):
    benchmark.run(config, "/nonexistent/never/written")


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"studies": ""}, "config.studies: unknown none given"),
    (
      {"studies": "tied_maxima", "tied_maxima.margins": "1e-1,abc"},
      "config.tied_maxima.margins must be a number",
    ),
    (
      {"studies": "seq_len", "seq_len.lengths": (32, -4)},
      "config.seq_len.lengths must be >= 1",
    ),
    ({"common.distributions": "normal,cauchy"}, "unknown 'cauchy'"),
    ({"common.formats": ""}, "config.common.formats is empty"),
    (
      {"studies": "tiles", "tiles.swap": ((16, 32), (32, 16))},
      "config.tiles.swap must be one",
    ),
    (
      {"studies": "seq_len", "seq_len.precisions": "bf16,bf17"},
      "config.seq_len.precisions: .*bf17",
    ),
  ],
)
def test_bad_forward_values_name_their_field(changes, message):
  with pytest.raises(ValueError, match=message):
    forward.run(_forward_config(**changes), "/nonexistent/x")


@pytest.mark.slow  # a launcher process end to end (CI's slow tier)
def test_launcher_prints_the_error_line_not_a_traceback(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      str(REPO / "launch" / "forward_deviation.py"),
      f"--workdir={tmp_path}",
      "--config=smoke",
      "--config.studies=format_sweep,fig9",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=REPO,
  )
  assert out.returncode == 2
  assert "error: config.studies: unknown ['fig9']" in out.stderr
  assert "Traceback" not in out.stderr


def test_every_experiment_opens_its_run_directory_one_way(tmp_path):
  """`opened` (what every experiment's `run` starts with) on synthetic
  configs: a rerun resumes and reports an extended field, refuses one that
  changes results (naming it), starts afresh on `restart`, and a run
  measured anew each time keeps no rows."""
  import ml_collections

  from stableattn.harness.rundir import opened

  def config(seeds, width):
    return ml_collections.ConfigDict(
      {"seeds": seeds, "model": {"width": width}}
    )

  with opened(tmp_path, config(1, 8), restart=False, extendable=("seeds",)) as (
    run_dir,
    extended,
  ):
    run_dir.append_metrics([{"seed": 0}])
    assert extended == {}
  with opened(tmp_path, config(2, 8), restart=False, extendable=("seeds",)) as (
    run_dir,
    extended,
  ):
    assert extended == {"seeds": (1, 2)}
    assert run_dir.read_metrics() == [{"seed": 0}]
  with pytest.raises(ValueError, match=r"model.width: 8 there, 16 now"):
    with opened(tmp_path, config(2, 16), restart=False, extendable=("seeds",)):
      pass
  with opened(tmp_path, config(2, 16), restart=True, extendable=("seeds",)) as (
    run_dir,
    _,
  ):
    assert run_dir.read_metrics() == []
    run_dir.append_metrics([{"seed": 1}])
  with opened(tmp_path, config(3, 16), restart=False) as (run_dir, _):
    assert run_dir.read_metrics() == []  # measured anew: no rows kept
