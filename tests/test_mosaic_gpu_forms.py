"""The Hopper path's FlashAttention-3 forms (`Options.hopper_form`):
each lowers for sm_90; in interpret mode a form runs bit for bit with
the interpreter's where jax's GPU interpreter can run it, and is refused
naming what it lacks where not. And why FP8 is refused there: wgmma's
e4m3 operands must be K-major."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, mosaic_lowered_text, with_races_found

import stableattn as sa
from stableattn.contract.options import HOPPER_SWITCHES
from stableattn.contract.options import hopper_switches as switches
from stableattn.experiments import hopper_check
from stableattn.harness.cuda_lowering import lowered_for_cuda
from stableattn.kernels import mosaic_attention

CASES = hopper_check.CASES
_inputs = hopper_check.inputs


@pytest.mark.parametrize(
  "form",
  [
    "warp_specialized",
    "two_consumers",
    "k_as_stored",
    "p_in_registers",
    "accumulate_in_place",
    "fa3",
  ],
)
def test_fa3_forms_lower_for_sm90_and_run_where_the_interpreter_can(
  form,
):
  """Each switch of FlashAttention-3's form (and all of them) builds the
  forward for CUDA beside the unchanged backward, with key lengths (each
  warpgroup reading block ranges through its own barrier). In interpret
  mode a form the installed jax's interpreter runs equals the interpreter
  form bit for bit at batch 2 with key lengths, with no race under the
  interpreter's detector; any other is refused in one line naming what
  it lacks."""
  lengths = np.array([150, 200], np.int32)
  text = mosaic_lowered_text(
    causal=True, hopper_form=form, key_value_seq_lengths=lengths
  )
  assert text.count("custom_call @mosaic_gpu") == 3
  # Batch 2 with key lengths: one query block of one head per example,
  # so that the interpreter's warpgroups stay few.
  ragged = {"key_value_seq_lengths": np.array([50, 96])}
  (q, k, v, _), features = _inputs(("bf16-fa2", 64, 96, 1, 1, 48, ragged))
  assert q.shape[0] == 2

  def out(form):
    return sa.attention(
      q, k, v, implementation="mosaic_gpu", precision="bf16-fa2",
      hopper_form=form, **features,
    )  # fmt: skip

  lacking = set(switches(form)) & set(mosaic_attention.interpreter_lacks())
  if lacking:
    with pytest.raises(ValueError, match=r"hopper_form=.*GPU interpreter"):
      out(form)
  else:
    ours, raced = with_races_found(lambda: out(form))
    assert raced is False
    np.testing.assert_array_equal(ours, out("interpreter"))


@pytest.mark.parametrize(
  "form, case_name",
  [
    # The fast tier runs both forms' forward at this case under the
    # detector (above); the gradients beside it run in the slow tier.
    pytest.param("warp_specialized", "key-lengths-d48", marks=pytest.mark.slow),
    pytest.param("two_consumers", "key-lengths-d48", marks=pytest.mark.slow),
  ],
)
def test_the_warp_specialized_forward_is_race_free_at_batch_2_with_lengths(
  form, case_name
):
  """FlashAttention-3's producer and consumers (a copy warpgroup filling
  the K/V ring, slots released by barriers every compute warpgroup
  arrives at; with `two_consumers`, two of them on 64 rows each, meeting
  at a rendezvous barrier one step apart: the ping-pong) on both
  examples' key lengths: no race under the interpreter's detector, and
  the interpreter form's values and gradients bit for bit. (The test
  session's XLA_FLAGS hold `SEQUENTIAL_SCHEDULE_FLAG`, without which the
  interpreter can deadlock on more than one warpgroup.)"""
  case = CASES[case_name]
  assert _inputs(case)[0][1].shape[0] == 2
  ours, raced = with_races_found(
    lambda: hopper_check.value_and_grads("mosaic_gpu", case, hopper_form=form)
  )
  assert raced is False
  for a, b in zip(ours, hopper_check.value_and_grads("mosaic_gpu", case)):
    np.testing.assert_array_equal(a, b)


def test_the_race_detector_catches_a_read_before_its_copys_barrier():
  _, raced = with_races_found(_racy_copy)
  assert raced is True


def _racy_copy():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def body(x_ref, o_ref, smem, barrier):
    plgpu.copy_gmem_to_smem(x_ref, smem, barrier.at[0])
    early = smem[...]  # before the copy's barrier: a race
    plgpu.barrier_wait(barrier.at[0])
    smem[...] = early + 1
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  shape = jax.ShapeDtypeStruct((128,), jnp.float32)
  kernel = plgpu.kernel(
    body,
    out_type=shape,
    scratch_types=[
      plgpu.SMEM((128,), jnp.float32),
      plgpu.Barrier(num_barriers=1),
    ],
    interpret=InterpretGPUParams(detect_races=True),
  )
  jax.block_until_ready(kernel(jnp.ones((128,), jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("case_name", ["key-lengths-d48", "causal-gqa"])
def test_two_consumers_compiled_is_the_one_warpgroup_kernel_bit_for_bit(
  case_name,
):
  """FlashAttention-3's two compute warpgroups in ping-pong, compiled:
  each row's arithmetic is the one-warpgroup kernel's, so values and
  gradients are bit for bit. Causal: the first warpgroup's 64 rows need
  fewer key blocks than the second's, so it waits for, meets at and
  releases the rest."""
  case = CASES[case_name]
  ours = hopper_check.value_and_grads(
    "mosaic_gpu", case, hopper_form="two_consumers", interpret=False
  )
  base = hopper_check.value_and_grads("mosaic_gpu", case, interpret=False)
  for a, b in zip(ours, base):
    np.testing.assert_array_equal(a, b)


def test_more_than_one_warpgroup_needs_the_sequential_schedule(monkeypatch):
  """Without `SEQUENTIAL_SCHEDULE_FLAG` in XLA_FLAGS interpret mode
  refuses the forms with more than one warpgroup, naming the flag
  (`launch/interpreter_stall.py` shows jax's own pipeline deadlocking
  without it); with it, it runs them."""
  flag = mosaic_attention.SEQUENTIAL_SCHEDULE_FLAG
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  lacks = mosaic_attention.interpreter_lacks()
  for form in ("warp_specialized", "two_consumers"):
    assert flag in lacks[form]
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"two_consumers.*deadlocking.*" + flag):
    sa.attention(
      q, q, q, implementation="mosaic_gpu", hopper_form="two_consumers"
    )
  monkeypatch.setenv("XLA_FLAGS", f"--xla_backend_optimization_level=0 {flag}")
  lacks = mosaic_attention.interpreter_lacks()
  assert not {"warp_specialized", "two_consumers"} & set(lacks)


def test_the_forms_differ_in_their_lowered_kernels():
  """The switches change the program: each form's forward module differs
  from the interpreter form's (the forward alone: the backward is the
  same kernel under every form, lowered beside each form above)."""
  base = mosaic_lowered_text(gradients=False, causal=True)
  for form in HOPPER_SWITCHES:
    text = mosaic_lowered_text(gradients=False, causal=True, hopper_form=form)
    assert text != base, form


def test_hopper_form_is_checked_and_belongs_to_the_hopper_path():
  with pytest.raises(ValueError, match=r"unknown \['p_in_smem'\]; valid"):
    sa.Options(hopper_form="p_in_smem")
  assert sa.Options(hopper_form="p_in_registers+k_as_stored").hopper_form == (
    "k_as_stored+p_in_registers"
  )
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"the Hopper path's option"):
    sa.attention(q, q, q, implementation="pallas", hopper_form="fa3")


def _fp8_wgmma(b_transposed: bool, interpret: bool):
  """One 64x64x64 wgmma of e4m3 operands, B as stored or read through a
  transposed view: lowered for CUDA, or run in interpret mode."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from stableattn.kernels.mosaic_support import smem_tile

  dtype = jnp.float8_e4m3fn
  tile = plgpu.SMEM(
    (64, 64),
    dtype,
    transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64)),
  )

  def body(a_ref, b_ref, o_ref, a_smem, b_smem, o_smem, bar):
    for src, dst in ((a_ref, a_smem), (b_ref, b_smem)):
      plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
      plgpu.barrier_wait(bar.at[0])
    b = plgpu.transpose_ref(b_smem, (1, 0)) if b_transposed else b_smem

    def product(acc_ref):
      plgpu.wgmma(acc_ref, a_smem, b)
      return acc_ref[...]

    o_smem[...] = pl.run_scoped(product, plgpu.ACC((64, 64), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
    scratch_types=[
      tile,
      tile,
      smem_tile((64, 64), jnp.float32),
      plgpu.Barrier(num_barriers=1),
    ],
    interpret=InterpretGPUParams() if interpret else False,
  )
  x = jax.ShapeDtypeStruct((64, 64), dtype)
  if interpret:
    return kernel(jnp.ones((64, 64), dtype), jnp.ones((64, 64), dtype))
  return lowered_for_cuda(kernel, x, x)


def test_fp8_wgmma_needs_k_major_operands_the_interpreter_cannot_read():
  """Why a compiled FP8 plan reads K and V through transposed views and
  jax 0.10's interpreter runs the other form (docs/performance.md):
  wgmma takes e4m3 operands K-major only when compiled, and those views
  lower for sm_90, but jax 0.10's GPU interpreter cannot run them (jax
  0.11's can). A jax that changes either fails this test."""
  with pytest.raises(ValueError, match="Only f16 WGMMA supports transposes"):
    _fp8_wgmma(b_transposed=False, interpret=False)
  assert (
    "mosaic_gpu" in _fp8_wgmma(b_transposed=True, interpret=False).as_text()
  )
  if jax.__version_info__ < (0, 11):
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    try:
      with pytest.raises(Exception, match="'TransposeTransform' object has"):
        _fp8_wgmma(b_transposed=True, interpret=True)
    finally:
      # A kernel that raised mid-interpretation leaves its barriers
      # allocated: the next interpreted kernel would fail on them.
      gpu_callbacks.reset_gpu_interpret_mode_state()
  else:  # jax 0.11's interpreter reads the view: 64 ones summed, exactly
    np.testing.assert_array_equal(_fp8_wgmma(True, interpret=True), 64.0)
  # Both interpreters read e4m3 N-major, the form the FP8 plans take there.
  np.testing.assert_array_equal(_fp8_wgmma(False, interpret=True), 64.0)


@pytest.mark.slow
def test_the_interpreter_stall_launcher_finishes_with_the_flag():
  """`launch/interpreter_stall.py` (docs/findings.md): jax's own
  warp-specialized pipeline, pinned to one core, finishes exactly under
  the sequential schedule (whether the default one stalls is a race); a
  bad count is one line and exit 2."""
  launcher = [sys.executable, str(REPO / "launch" / "interpreter_stall.py")]
  done = subprocess.run(
    [*launcher, "--runs=1", "--seconds=20"],
    capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert done.returncode == 0, done.stdout + done.stderr[-2000:]
  flag = mosaic_attention.SEQUENTIAL_SCHEDULE_FLAG
  assert f"{flag}: 0 of 1 stalled, 1 finished" in done.stdout
  assert "default schedule: " in done.stdout
  bad = subprocess.run(
    [*launcher, "--runs=0"], capture_output=True, text=True, timeout=120
  )
  lines = [x for x in bad.stdout.splitlines() if x.strip()]
  assert bad.returncode == 2 and len(lines) == 1
  assert lines[0].startswith("error: --runs=0: ")
