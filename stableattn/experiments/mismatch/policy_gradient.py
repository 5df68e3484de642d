"""Does the mismatch matter? A small policy-gradient run whose sampler and
trainer differ.

The byte model is fine-tuned with a verifiable reward: the share of a
target byte among the bytes it writes after a prompt. Each step samples a
group of continuations per prompt with the arm's sampler path (decode over
a KV cache), scores them with the trainer (one FP32 pass, with gradients)
and takes a REINFORCE step with a group baseline (GRPO's advantage, r -
mean of the prompt's group). The policy-gradient weight of a token is 1
(the samples are treated as on-policy) or, with truncated importance
sampling (Yao et al. 2025), min(p_train / p_sample, C). The `on_policy`
arm scores its own samples as the sampler (ratio exactly 1): the run
against which the others are read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stableattn.contract.options import Options
from stableattn.experiments.mismatch.pairs import BF16, choose, decoding, flash
from stableattn.training import rollout
from stableattn.training.model import AttentionSpec

TRAINER = rollout.Path(AttentionSpec("reference", Options(precision="fp32")))


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  sampler: rollout.Path | None  # None: the trainer's own probabilities
  tis: bool


ARMS = {
  arm.name: arm
  for arm in (
    Arm("on_policy", None, False),
    Arm("bf16_sampler", decoding(BF16, head="bf16"), False),
    Arm("fp8_sampler", decoding(flash("fp8-fa3"), head="bf16"), False),
    Arm("fp8_sampler_tis", decoding(flash("fp8-fa3"), head="bf16"), True),
  )
}


def resolve_arms(names) -> tuple[Arm, ...]:
  """Arms by name ("all", or a comma list); the on-policy arm always runs."""
  return choose(names, ARMS, "on_policy", "config.rl.arms")


def reward(tokens, prompt_len: int, target: int) -> np.ndarray:
  """Per sequence: the share of written bytes equal to `target`."""
  written = np.asarray(tokens)[:, prompt_len:]
  return np.mean(written == target, axis=1)


def _trainer_log_probs(graphdef, params, tokens, prompt_len):
  model = nnx.merge(graphdef, params)
  logits, _ = model(tokens[:, :-1])
  log_p = jax.nn.log_softmax(logits[:, prompt_len - 1 :], axis=-1)
  return jnp.take_along_axis(log_p, tokens[:, prompt_len:, None], -1)[..., 0]


def make_step(graphdef, tx, prompt_len: int, tis_cap: float):
  """One REINFORCE step: (params, opt_state, tokens, advantages, sampler
  log-probs, use_tis) -> (params, opt_state, trainer log-probs)."""

  def loss(params, tokens, advantages, log_sample, use_tis):
    log_train = _trainer_log_probs(graphdef, params, tokens, prompt_len)
    # NaN sampler log-probs: the trainer's own (an on-policy arm).
    log_sample = jnp.where(
      jnp.isnan(log_sample), jax.lax.stop_gradient(log_train), log_sample
    )
    ratio = jnp.exp(jax.lax.stop_gradient(log_train) - log_sample)
    weight = jnp.where(use_tis, jnp.minimum(ratio, tis_cap), 1.0)
    objective = weight * advantages[:, None] * log_train
    return -jnp.mean(objective), log_train

  @jax.jit
  def step(params, opt_state, tokens, advantages, log_sample, use_tis):
    grads, log_train = jax.grad(loss, has_aux=True)(
      params, tokens, advantages, log_sample, use_tis
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, log_train

  return step


def train_arm(model, arm: Arm, replicate: int, c) -> dict:
  """One arm's run: per step the mean reward and the mismatch between its
  sampler and the trainer on the sampled tokens."""
  graphdef, params = nnx.split(model)  # every variable is a parameter
  tx = optax.adam(c.learning_rate)
  opt_state = tx.init(params)
  step = make_step(graphdef, tx, c.prompt_len, c.tis_cap)
  rng = np.random.default_rng([replicate, 17])
  rewards, kl_k3, diff_max, tis_share, finite = [], [], [], [], True
  for t in range(c.steps):
    current = nnx.merge(graphdef, params)
    prompts = np.repeat(
      rng.integers(32, 127, (c.prompts, c.prompt_len)), c.group, axis=0
    )
    key = jax.random.fold_in(jax.random.key(replicate), t)
    sampler = arm.sampler or dataclasses.replace(TRAINER, mode="decode")
    tokens, log_sample = rollout.generate(
      current, prompts, c.new_tokens, sampler, key=key
    )
    r = reward(tokens, c.prompt_len, c.target_byte)
    grouped = r.reshape(c.prompts, c.group)
    advantages = (grouped - grouped.mean(1, keepdims=True)).ravel()
    if arm.sampler is None:
      log_sample = jnp.full(log_sample.shape, jnp.nan)
    params, opt_state, log_train = step(
      params,
      opt_state,
      tokens,
      jnp.asarray(advantages, jnp.float32),
      jnp.asarray(log_sample, jnp.float32),
      jnp.asarray(arm.tis),
    )
    if arm.sampler is None:
      log_sample = log_train  # the samples' probabilities are the trainer's
    metrics = rollout.token_metrics(log_sample, log_train, c.tis_cap)
    rewards.append(float(r.mean()))
    kl_k3.append(metrics["kl_k3"])
    diff_max.append(metrics["rollout_probs_diff_max"])
    tis_share.append(metrics["tis_share"])
    leaves = jax.tree.leaves(params)
    if not all(bool(jnp.all(jnp.isfinite(x))) for x in leaves):
      finite = False
      break
  return {
    "arm": arm.name,
    "replicate": replicate,
    "reward": rewards,
    "kl_k3": kl_k3,
    "rollout_probs_diff_max": diff_max,
    "tis_share": tis_share,
    "finite": finite,
  }


def collapse_step(rewards, fraction: float = 0.5, window: int = 5):
  """The first step at which the reward, averaged over `window` steps,
  falls below `fraction` of its best average so far after that average
  rose above its first, or None. The average keeps one unlucky group of
  samples from reading as a collapse."""
  values = np.asarray(rewards, np.float64)
  if values.size < window:
    return None
  smooth = np.convolve(values, np.ones(window) / window, mode="valid")
  best = smooth[0]
  for t, value in enumerate(smooth):
    best = max(best, value)
    if best > smooth[0] and value < fraction * best:
      return t + window - 1
  return None
