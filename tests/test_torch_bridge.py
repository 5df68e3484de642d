"""PyTorch's kernels under the audit's rules, through the bridge: SDPA's
math and CPU flash backends with gradients, FlexAttention forward, any
torch function by import path, and broken kernels that must fail.

Needs the `[torch]` extra; CI installs it. The tests sit in the slow tier
(`python -m pytest -n 2 -m torch` runs them alone)."""

import jax
import numpy as np
import pytest

import stableattn as sa
from stableattn.ops import registry

pytestmark = [pytest.mark.slow, pytest.mark.torch]


@pytest.fixture(autouse=True)
def torch():
  """PyTorch, imported when a test runs (collecting the fast tier does not
  import it); without the extra the tests skip, saying why."""
  return pytest.importorskip("torch", reason="needs the [torch] extra")


GQA = (2, 96, 96, 4, 2, 32)  # batch, q_len, kv_len, heads, kv_heads, head_dim
PRECISIONS = ("fp32", "bf16-framework", "fp16-framework")
RULES = ("flashattention", "flexattention")


@pytest.mark.parametrize("kernel", ["torch_sdpa_math", "torch_sdpa_flash"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("features", [None, "causal"])
def test_sdpa_passes_the_rules_on_output_and_gradients(
  kernel, precision, features
):
  report = sa.audit(
    registry.resolve(kernel),
    precision=precision,
    shapes=[GQA],
    features=features,
    gate=RULES,
    repeats=2,
  )
  assert report.passed, report.failures
  assert {r["tensor"] for r in report.rows} == {"out", "dq", "dk", "dv"}


@pytest.mark.parametrize("features", ["window", "segments", "alibi"])
def test_sdpa_takes_masks_and_biases_as_attn_mask(features):
  report = sa.audit(
    registry.resolve("torch_sdpa_flash"),
    precision="bf16-framework",
    shapes=[GQA],
    features=features,
    gate=RULES,
  )
  assert report.passed, report.failures


def test_flex_passes_forward_with_softcap_and_a_sliding_window():
  flex = registry.resolve("torch_flex")
  for features in ("softcap", "window", "causal,softcap"):
    report = sa.audit(
      flex,
      precision="fp32",
      shapes=[GQA],
      features=features,
      gate=RULES,
      repeats=2,
      tensors="out",
    )
    assert report.passed, (features, report.failures)
  assert "n/a on CPU" in registry.forward_only("torch_flex")
  q = np.ones((1, 32, 2, 16), np.float32)
  with pytest.raises(NotImplementedError, match="no backward on this machine"):
    jax.grad(lambda q: flex(q, q, q).sum())(q)


@pytest.mark.parametrize(
  "kernel, features, message",
  [
    ("wrong_scale", None, "flashattention rule fails on out"),
    ("gradient_ignores_the_mask", "causal", "flashattention rule fails on d"),
  ],
)
def test_broken_torch_kernels_fail_naming_the_rule_and_tensor(
  kernel, features, message
):
  fn = registry.resolve(f"torch:torch_audit_kernels:{kernel}")
  report = sa.audit(
    fn, precision="fp32", shapes=[GQA], features=features, gate=RULES
  )
  assert not report.passed
  assert any(message in failure for failure in report.failures), report
  if kernel == "gradient_ignores_the_mask":
    assert not any("on out" in failure for failure in report.failures)


def test_a_feature_sdpa_cannot_express_is_one_line():
  sdpa = registry.resolve("torch_sdpa_math")
  q = np.zeros((1, 16, 2, 8), np.float32)
  with pytest.raises(ValueError, match="cannot take the feature 'softcap'"):
    sdpa(q, q, q, softcap=30.0)
  with pytest.raises(ValueError, match="cannot take the feature 'sink'"):
    sdpa(q, q, q, sink=np.zeros(2, np.float32))
  with pytest.raises(ValueError, match=r"does not accept the feature\(s\)"):
    sa.audit(sdpa, shapes=[(1, 32, 2, 16)], features="softcap")


def test_bf16_crosses_to_torch_and_back_bit_for_bit(torch):
  from stableattn.ops.torch_bridge import to_numpy, to_torch

  x = (
    np.random.default_rng(0).standard_normal((3, 5)).astype(jax.numpy.bfloat16)
  )
  t = to_torch(x)
  assert t.dtype == torch.bfloat16
  assert np.array_equal(to_numpy(t).view(np.int16), x.view(np.int16))


def test_the_launcher_audits_a_torch_kernel(tmp_path):
  from stableattn.auditing import grid as audit_grid
  from stableattn.configs import audit as audit_config

  config = audit_config.get_config("smoke")
  config.kernel = "torch_sdpa_flash"
  result = audit_grid.run(config, tmp_path / "flash")
  assert result["passed"], result["failures"]
  config.kernel = "torch_flex"
  result = audit_grid.run(config, tmp_path / "flex")
  assert result["passed"], result["failures"]
  report = (tmp_path / "flex" / "report.md").read_text()
  assert "Gradients not audited: FlexAttention has no backward" in report


def test_a_torch_kernel_trains_as_a_subject_in_the_drift_study(tmp_path):
  """Inside jit and grad, through pure_callback: the drift study trains
  with PyTorch's flash kernel and divides its drift by a reference."""
  from stableattn.configs import training_drift as drift_config
  from stableattn.experiments import training_drift

  config = drift_config.get_config("smoke")
  config.attention.candidate = "torch_sdpa_flash"
  config.pairs = "candidate_vs_baseline,different_seed"
  config.train.replicates = 2
  result = training_drift.run(config, tmp_path)
  ratio = result["ratios"]["candidate_vs_baseline"]["different_seed"]
  assert ratio["wasserstein"]["over_replicates"]["count"] == 2
  report = (tmp_path / "report.md").read_text()
  assert "candidate: torch_sdpa_flash attention" in report


def test_a_backend_without_gqa_gets_its_kv_heads_repeated(torch):
  """The memory-efficient backend refuses `enable_gqa` ("No available
  kernel" on an H200): its caller repeats K and V per query head instead,
  which must be the grouped result, gradients summed over each group."""
  from stableattn.ops import torch_kernels

  assert "EFFICIENT_ATTENTION" in torch_kernels.WITHOUT_GQA
  gen = torch.Generator().manual_seed(0)
  q = torch.randn(2, 4, 16, 8, generator=gen, dtype=torch.float64)
  k, v = (torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64)
          for _ in range(2))  # fmt: skip
  outs = []
  for repeat in (False, True):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fn = torch_kernels.sdpa("MATH", repeat_kv_heads=repeat)
    out = fn(*leaves, enable_gqa=True)
    out.sum().backward()
    outs.append([out.detach(), *(x.grad for x in leaves)])
  for grouped, repeated in zip(*outs):
    assert torch.allclose(grouped, repeated, rtol=1e-12, atol=1e-12)
  assert outs[1][2].shape == k.shape  # dK per KV head, not per query head
