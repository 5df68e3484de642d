"""implementation="flash" where a run asks for our flash kernel: the Flax
drop-in's and the training runs' default, recorded as the path it took."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from stableattn.configs import stability as stability_config
from stableattn.configs import training_drift as drift_config
from stableattn.contract.options import Options
from stableattn.experiments import stability, training_drift
from stableattn.experiments.training_drift.probes import shadow_of
from stableattn.harness import environment
from stableattn.ops import flash_choice
from stableattn.ops.flax_attention import make_attention_fn
from stableattn.training.attention_spec import SHADOW, AttentionSpec


@pytest.fixture
def fresh_record(monkeypatch):
  monkeypatch.setattr(flash_choice, "_TAKEN", type(flash_choice._TAKEN)())


def test_flax_drop_in_runs_flash_and_the_record_says_which_path(fresh_record):
  rng = np.random.default_rng(0)
  q, k, v = (
    jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.bfloat16)
    for _ in range(3)
  )
  assert "flash_paths" not in environment.describe()
  out = make_attention_fn(precision="bf16-fa2")(q, k, v, is_causal=True)
  pallas = make_attention_fn(precision="bf16-fa2", implementation="pallas")
  # On a CPU "flash" is the Triton path in interpret mode, bit for bit.
  np.testing.assert_array_equal(out, pallas(q, k, v, is_causal=True))
  env = environment.describe()
  assert env["flash_paths"] == {"pallas": 1}
  assert "'flash' ran pallas (1 calls)" in environment.summary_line(env)


def test_monitor_statistics_come_from_the_kernel_only_where_it_is_triton(
  monkeypatch,
):
  bf16 = Options(precision="bf16-fa2")
  flash = AttentionSpec(kind="flash", options=bf16)
  shadow = dataclasses.replace(flash, kind=SHADOW, shadow_flash="flash")
  pallas = dataclasses.replace(flash, kind="pallas")
  assert flash.kernel_monitors and shadow.kernel_monitors
  # On a Hopper GPU "flash" may take the Hopper path, whose pass keeps no
  # statistics: the monitor then reads q and k, not another kernel's pass.
  monkeypatch.setattr(flash_choice, "hopper_or_later", lambda: True)
  assert not flash.kernel_monitors and not shadow.kernel_monitors
  assert pallas.kernel_monitors


def test_ring_runs_take_flash_and_refuse_the_hopper_path_by_name():
  assert AttentionSpec(kind="flash", context_parallel=2).context_parallel == 2
  with pytest.raises(ValueError, match="needs kind 'pallas' or 'flash'"):
    AttentionSpec(kind="mosaic_gpu", context_parallel=2)
  with pytest.raises(ValueError, match="shadow_flash must be one of"):
    AttentionSpec(kind=SHADOW, shadow_flash="reference")


def test_drift_and_stability_runs_ask_for_flash_by_default():
  config = drift_config.get_config("smoke")
  # Not the other-machine pair, whose probe compiles a training step.
  config.pairs = "flash_vs_baseline,flash_fix_vs_flash"
  settings = training_drift.settings_from_config(config)
  assert settings.flash_runs
  for name in settings.flash_runs:
    attention = settings.physical_runs[name].attention
    assert attention.kind == "flash"
    # Its shadow computes the run's own kernel beside the baseline.
    assert shadow_of(attention).shadow_flash == "flash"
  s = stability.settings_from_config(stability_config.get_config("smoke"))
  kinds = {arm.variant: run.attention.kind for arm, (_, run) in s.runs.items()}
  assert kinds["flash"] == "flash" and kinds["baseline"] == "reference"
