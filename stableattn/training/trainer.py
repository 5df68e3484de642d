"""Training a `Transformer` with Optax in FP32, BF16 or FP16.

Master weights and optimizer state stay FP32; the forward and backward
passes run in the compute format, by one of two conventions
(`RunSpec.mixed_precision`, `compute_format.ComputeFormat`): every
activation in it (parameters cast on the way in), or only the matmuls'
operands, as PyTorch autocast does. The loss is FP32. FP16 adds dynamic
loss scaling: a step whose gradients overflow is skipped and the scale
halved; after `loss_scale_period` good steps the scale doubles. Data
parallelism: the batch is sharded over a 1-D `Mesh` ("data" axis),
parameters replicated.
Context parallelism (`AttentionSpec.context_parallel`): every device of
the ring holds the whole batch and the parameters, and attention runs as
ring attention over a shard of the sequence per device.

Several processes (one per host, `stableattn.training.distributed`): the
mesh spans every process's devices; each process builds the same global
batch and contributes its devices' rows, so the run is the one-process run
on the same global batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from stableattn.numerics.formats import to_dtype
from stableattn.ops.ring_plan import context_mesh
from stableattn.training.compute_format import TRAINING_FORMATS, ComputeFormat
from stableattn.training.model import AttentionSpec, ModelSpec, Transformer

COMPUTE_DTYPES = {name: to_dtype(name) for name in TRAINING_FORMATS}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  total_steps: int = 400
  end_learning_rate_fraction: float = 0.1
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.95


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """Everything that defines one training run."""

  attention: AttentionSpec
  precision: str = "fp32"  # compute format: fp32 | bf16 | fp16
  # "activations" (MaxText, jmp) or "autocast" (PyTorch): ComputeFormat
  mixed_precision: str = "activations"
  # Tensor classes kept in FP32 (`compute_format.FP32_CLASSES`): an
  # ablation of where a low-precision run's drift comes from.
  fp32_classes: tuple[str, ...] = ()
  init_seed: int = 0
  devices: int = 1
  replica: int = 0  # distinguishes an identical rerun from its original
  init_loss_scale: float = 2.0**15
  loss_scale_period: int = 200
  # Weight of the z-loss, mean(log Z)^2 of the output logits (PaLM;
  # Wortsman et al. use 1e-4 against output-logit divergence); 0: none.
  z_loss: float = 0.0

  def __post_init__(self):
    self.compute_format  # noqa: B018 - validates both fields

  @property
  def compute_format(self) -> ComputeFormat:
    return ComputeFormat(
      self.precision, self.mixed_precision, tuple(self.fp32_classes)
    )

  @property
  def dynamic_loss_scale(self) -> bool:
    return self.precision == "fp16"


class TrainState(NamedTuple):
  params: nnx.State
  opt_state: optax.OptState
  loss_scale: jax.Array  # float32 scalar; 1 without loss scaling
  good_steps: jax.Array  # int32: finite steps since the last scale change
  step: jax.Array  # int32: updates applied or skipped so far


def make_optimizer(spec: OptimizerSpec) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=spec.learning_rate,
    warmup_steps=spec.warmup_steps,
    decay_steps=spec.total_steps,
    end_value=spec.learning_rate * spec.end_learning_rate_fraction,
  )
  return optax.chain(
    optax.clip_by_global_norm(spec.clip_norm),
    optax.adamw(
      schedule, b1=spec.b1, b2=spec.b2, weight_decay=spec.weight_decay
    ),
  )


def make_mesh(devices: int) -> Mesh:
  """A 1-D mesh of the first `devices` devices of every process (with
  several processes, all of them: each must hold a part of the batch)."""
  available = jax.devices()
  if devices > len(available):
    raise ValueError(
      f"{devices} devices requested, but only {len(available)} are "
      "available (on CPU, simulate more with XLA_FLAGS="
      "--xla_force_host_platform_device_count=N)."
    )
  if jax.process_count() > 1 and devices != len(available):
    raise ValueError(
      f"{devices} devices requested of the {len(available)} that "
      f"{jax.process_count()} processes hold; with several processes the "
      "mesh spans every device (train.devices=0)."
    )
  return Mesh(np.asarray(available[:devices]), ("data",))


class Trainer:
  """Initializes, steps and evaluates one run; compiled once per run."""

  def __init__(
    self,
    model_spec: ModelSpec,
    run: RunSpec,
    optimizer: OptimizerSpec,
    batch_size: int,
    eval_attention: AttentionSpec | None = None,
  ):
    context = run.attention.context_parallel
    if context > 1 and run.devices != 1:
      raise ValueError(
        f"A context-parallel run (context_parallel={context}) has no data "
        f"parallelism here: devices must be 1, got {run.devices}."
      )
    if batch_size % run.devices:
      raise ValueError(
        f"batch_size {batch_size} is not divisible by the {run.devices} "
        "devices of the data-parallel mesh."
      )
    self.run = run
    self.replicated, self.batch_sharding = self._shardings(run)
    self.model_spec = model_spec
    self.optimizer = optimizer
    self.batch_size = batch_size
    self.graphdef = self.graph_with(run.attention)
    self.tx = make_optimizer(optimizer)
    self.compute_dtype = COMPUTE_DTYPES[run.precision]
    self._step = jax.jit(self._step_impl, donate_argnums=0)
    self._eval = jax.jit(self._eval_impl)
    self._deltas = jax.jit(self._deltas_impl)
    self._capture = jax.jit(self._capture_impl)
    # Evaluation may run another attention on the same parameters (the
    # drift experiment evaluates a flash run through "shadow" attention,
    # which also computes the baseline and reports their deviation).
    self.eval_graphdef = (
      self.graphdef
      if eval_attention is None
      else self.graph_with(eval_attention)
    )

  def program_key(self) -> tuple:
    """What this trainer's compiled programs depend on: everything but the
    initialization (init seed, replica)."""
    run = dataclasses.replace(self.run, init_seed=0, replica=0)
    return (
      run,
      self.model_spec,
      self.optimizer,
      self.batch_size,
      self.eval_graphdef,
    )

  def share_programs(self, other: Trainer) -> None:
    """Runs with `other`'s compiled step, evaluation and probes: for a run
    that differs from it only in how it starts (another seed, an identical
    rerun), the same executables, compiled once."""
    if self.program_key() != other.program_key():
      raise ValueError(
        f"run {self.run} differs from {other.run} in more than its "
        "initialization; its programs are its own."
      )
    self.graphdef, self.eval_graphdef = other.graphdef, other.eval_graphdef
    self._step, self._eval = other._step, other._eval
    self._deltas, self._capture = other._deltas, other._capture

  def _shardings(self, run: RunSpec):
    """(parameters', batch's): over the data-parallel mesh; for a
    context-parallel run both are replicated over its ring, whose devices
    each attend over a shard of the sequence."""
    context = run.attention.context_parallel
    if context > 1:
      self.mesh = context_mesh(context)
      return NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P())
    self.mesh = make_mesh(run.devices)
    return NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P("data"))

  def graph_with(self, attention: AttentionSpec):
    """The model's graph with another attention; the same parameters fit."""
    model = Transformer(
      self.model_spec,
      attention,
      rngs=nnx.Rngs(0),
      compute=self.run.compute_format,
    )
    return nnx.split(model, nnx.Param)[0]

  def init_params(self, replicate: int = 0) -> nnx.State:
    """Initial parameters of one replicate: a key folded from the run's
    init seed and the replicate number, so replicates start apart and the
    runs of one replicate (except `different_seed`) start together."""
    if replicate < 0:
      raise ValueError(f"replicate must be >= 0, got {replicate}.")
    key = jax.random.fold_in(jax.random.key(self.run.init_seed), replicate)
    model = Transformer(self.model_spec, self.run.attention, rngs=nnx.Rngs(key))
    return nnx.split(model, nnx.Param)[1]

  def init_state(self, replicate: int = 0) -> TrainState:
    params = self.init_params(replicate)
    state = TrainState(
      params=params,
      opt_state=self.tx.init(params),
      loss_scale=jnp.asarray(
        self.run.init_loss_scale if self.run.dynamic_loss_scale else 1.0,
        jnp.float32,
      ),
      good_steps=jnp.asarray(0, jnp.int32),
      step=jnp.asarray(0, jnp.int32),
    )
    return self.place(state)

  def place(self, state: TrainState) -> TrainState:
    return jax.device_put(state, self.replicated)

  def shard_batch(self, batch: np.ndarray) -> jax.Array:
    """The global batch (the same on every process) as a sharded array;
    each process hands over the rows of its own devices."""
    batch = np.asarray(batch)
    return jax.make_array_from_callback(
      batch.shape, self.batch_sharding, lambda index: batch[index]
    )

  def model(self, params, graphdef=None) -> Transformer:
    """The model on `params` as a step computes with it (through this run's
    attention, or `graphdef`'s): the parameters in the compute format where
    the run's convention casts them."""
    compute = self.run.compute_format
    if compute.casts_parameters:

      def cast(path, x):
        if Transformer.parameter_classes(path) & set(compute.fp32_classes):
          return x
        return x.astype(self.compute_dtype)

      params = jax.tree_util.tree_map_with_path(cast, params)
    return nnx.merge(self.graphdef if graphdef is None else graphdef, params)

  def _apply(self, graphdef, params, tokens, collect_stats=False, taps=None):
    return self.model(params, graphdef)(
      tokens, collect_stats=collect_stats, probe_taps=taps
    )

  def _next_token_loss(
    self, graphdef, params, batch, collect_stats=False, taps=None
  ):
    """(mean next-token cross-entropy, (logits, per-layer statistics))."""
    logits, stats = self._apply(
      graphdef, params, batch[:, :-1], collect_stats=collect_stats, taps=taps
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch[:, 1:]
    ).mean()
    return loss, (logits, stats)

  def _loss(self, params, batch, loss_scale):
    loss, (logits, _) = self._next_token_loss(self.graphdef, params, batch)
    objective = loss
    if self.run.z_loss:
      log_z = jax.nn.logsumexp(logits, axis=-1)
      objective = loss + self.run.z_loss * jnp.mean(log_z**2)
    return objective * loss_scale, loss

  def _step_impl(self, state: TrainState, batch, lr_scale):
    grads, loss = jax.grad(self._loss, has_aux=True)(
      state.params, batch, state.loss_scale
    )
    grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
    finite = jnp.all(
      jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
    )
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u: u * lr_scale, updates)
    params = optax.apply_updates(state.params, updates)
    loss_scale, good_steps = state.loss_scale, state.good_steps
    if self.run.dynamic_loss_scale:
      keep = lambda new, old: jax.tree.map(  # noqa: E731
        lambda n, o: jnp.where(finite, n, o), new, old
      )
      params = keep(params, state.params)
      opt_state = keep(opt_state, state.opt_state)
      grow = jnp.logical_and(
        finite, good_steps + 1 >= self.run.loss_scale_period
      )
      loss_scale = jnp.where(
        finite,
        jnp.where(grow, loss_scale * 2, loss_scale),
        jnp.maximum(loss_scale / 2, 1.0),
      )
      good_steps = jnp.where(finite & ~grow, good_steps + 1, 0)
    metrics = {
      "loss": loss,
      "grad_norm": optax.tree.norm(grads),
      "finite_grads": finite,
      "finite_params": jnp.all(
        jnp.asarray([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)])
      ),
      "loss_scale": state.loss_scale,
    }
    return TrainState(
      params, opt_state, loss_scale, good_steps, state.step + 1
    ), metrics

  def step(self, state: TrainState, batch: jax.Array, lr_scale: float = 1.0):
    """One update; `lr_scale` multiplies the learning rate (a traced
    value: a learning-rate sweep compiles the step once)."""
    return self._step(state, batch, jnp.asarray(lr_scale, jnp.float32))

  def _eval_impl(self, params, batch):
    loss, (logits, stats) = self._next_token_loss(
      self.eval_graphdef, params, batch, collect_stats=True
    )
    return logits, loss, stats

  def _deltas_impl(self, params, batch):
    d_outs, stats = self._taps_and_grads(params, batch)
    pairs = []
    for d_out, layer in zip(d_outs, stats):
      d_out = d_out.astype(self.compute_dtype).astype(jnp.float32)
      pairs.append(
        tuple(
          jnp.sum(d_out * layer[name].astype(jnp.float32), axis=-1)
          for name in ("out_fp32", "out")
        )
      )
    return pairs

  def _taps_and_grads(self, params, batch):
    """(dO per layer, per-layer statistics with arrays) of the loss on
    `batch`: zero taps on every attention output, differentiated."""
    spec = self.model_spec
    tap = jnp.zeros(
      (
        batch.shape[0],
        batch.shape[1] - 1,
        spec.heads,
        spec.width // spec.heads,
      ),
      jnp.float32,
    )

    def loss_of(taps):
      loss, (_, stats) = self._next_token_loss(
        self.graphdef, params, batch, taps=taps
      )
      return loss, stats

    return jax.grad(loss_of, has_aux=True)([tap] * spec.depth)

  def _capture_impl(self, params, batch):
    d_outs, stats = self._taps_and_grads(params, batch)
    return [
      {
        "q": layer["q"],
        "k": layer["k"],
        "v": layer["v"],
        # dO as the kernel's backward receives it: in the compute format.
        "d_out": d_out.astype(self.compute_dtype),
      }
      for d_out, layer in zip(d_outs, stats)
    ]

  def capture(self, state: TrainState, batch: jax.Array) -> list[dict]:
    """Per layer, q, k and v as this run's attention kernel receives them
    on `batch` and the loss's cotangent dO of its output (compute format;
    `stableattn.auditing.captures` saves and audits them)."""
    return self._capture(state.params, batch)

  def deltas(self, state: TrainState, batch: jax.Array):
    """Per layer, (delta = rowsum(dO * O) with FP32 attention's O, the same
    with this run's O), [B, T, H] each: dO is this run's gradient of the
    loss with respect to the attention output (in the compute format).
    Qiu & Yao (arXiv 2510.04212) trace biased low-precision training to a
    one-signed error of delta."""
    return self._deltas(state.params, batch)

  def gradients(self, graphdef, params, batch):
    """Gradient of the unscaled loss through `graphdef` (same params), in
    the run's compute format."""
    return jax.grad(lambda p: self._next_token_loss(graphdef, p, batch)[0])(
      params
    )

  def evaluate(self, state: TrainState, batch: jax.Array):
    """Logits and loss on a batch, and per-layer attention statistics
    (through `eval_attention` when one was given)."""
    return self._eval(state.params, batch)
