"""Training–inference mismatch: the sampler's probabilities against the
trainer's, token by token, with the same weights.

Reinforcement-learning fine-tuning samples with one computation (a decode
kernel over a KV cache, often split and batched, in BF16) and trains with
another (the training kernel over the full sequence). With identical
weights they assign different probabilities to the same tokens (Yao et
al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; Qi et al., arXiv 2510.26788). A `Path` names one computation:
the attention (kind, options, features) and the language-model head's
format. `generate` samples with a path over a KV cache; `score` computes
the same tokens' log-probabilities with a path over the full sequence;
`token_metrics` compares the two as verl logs them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stableattn.training.compute_format import ComputeFormat
from stableattn.training.model import HEAD_FORMATS, AttentionSpec, Transformer

# Truncated importance sampling's cap C on pi_train / pi_sample (Yao et
# al. 2025 use 2).
TIS_THRESHOLD = 2.0


MODES = ("full", "decode")
# "bf16-activations": an engine computing in BF16 throughout (weights and
# every activation, MaxText's convention; `ComputeFormat("bf16")`).
WEIGHT_FORMATS = ("fp32", "bf16", "bf16-activations")


@dataclasses.dataclass(frozen=True)
class Path:
  """One way to compute the model's next-token distribution.

  Attributes:
    attention: how every layer's attention computes (kind, options, such
      as split-KV, and features).
    head_format: the language-model head's format (`HEAD_FORMATS`).
    mode: "full" (one pass over the whole sequence, as a trainer scores
      it) or "decode" (the prompt in one prefill, then one step per token
      over a KV cache, as a sampler computes it). `generate` always
      decodes; `score` follows the mode, so scoring with the sampler's
      own path recomputes exactly what the sampler did.
    weights: "fp32"; "bf16": every parameter rounded to BF16 (an
      inference engine's copy of FP32 training weights), activations in
      the model's own format; "bf16-activations": those weights, and
      every activation in BF16 too (an engine computing in BF16).
    decode_batch: in "decode" mode, how many sequences run together:
      None for all of them, or a size that splits them into batches (1:
      each alone), as an engine batches requests.
  """

  attention: AttentionSpec = AttentionSpec()
  head_format: str = "fp32"
  mode: str = "full"
  weights: str = "fp32"
  decode_batch: int | None = None

  def __post_init__(self):
    if self.head_format not in HEAD_FORMATS:
      raise ValueError(
        f"head_format must be one of {list(HEAD_FORMATS)}, got "
        f"{self.head_format!r}."
      )
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}.")
    if self.decode_batch is not None and (
      isinstance(self.decode_batch, bool)
      or not isinstance(self.decode_batch, int)
      or self.decode_batch < 1
    ):
      raise ValueError(
        f"decode_batch must be None or an integer >= 1, got "
        f"{self.decode_batch!r}."
      )
    if self.weights not in WEIGHT_FORMATS:
      raise ValueError(
        f"weights must be one of {list(WEIGHT_FORMATS)}, got {self.weights!r}."
      )


def with_attention(model: Transformer, attention: AttentionSpec):
  """The same weights in a model whose layers compute `attention`."""
  _, state = nnx.split(model)
  twin = Transformer(
    model.spec, attention, rngs=nnx.Rngs(0), compute=model.compute
  )
  nnx.update(twin, state)
  return twin


def with_weights(model: Transformer, weights: str) -> Transformer:
  """The model itself ("fp32"), or a copy with every parameter rounded to
  BF16 and held in its own dtype ("bf16"), computing in BF16 throughout
  ("bf16-activations")."""
  if weights == "fp32":
    return model
  if weights == "bf16-activations":
    attention = model.blocks[0].attention.attention_spec
    twin = Transformer(
      model.spec, attention, rngs=nnx.Rngs(0), compute=ComputeFormat("bf16")
    )
    nnx.update(twin, nnx.split(with_weights(model, "bf16"))[1])
    return twin
  graphdef, state = nnx.split(model)
  rounded = jax.tree.map(
    lambda x: (
      x.astype(jnp.bfloat16).astype(x.dtype)
      if jnp.issubdtype(x.dtype, jnp.floating)
      else x
    ),
    state,
  )
  return nnx.merge(graphdef, rounded)


def _log_softmax(logits):
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


@functools.partial(nnx.jit, static_argnames=("path",))
def _prefill(model, prompts, cache, path: Path):
  logits, cache = model.extend(prompts, cache, path.attention, path.head_format)
  return _log_softmax(logits[:, -1]), cache


@functools.partial(nnx.jit, static_argnames=("path",))
def _decode_step(model, tokens, cache, path: Path):
  logits, cache = model.extend(
    tokens[:, None], cache, path.attention, path.head_format
  )
  return _log_softmax(logits[:, 0]), cache


def _check_length(model, total: int) -> None:
  if total > model.spec.max_len:
    raise ValueError(
      f"{total} tokens exceed the model's max_len {model.spec.max_len}."
    )


def _pick(log_p, step: int, key, greedy: bool, rows: slice):
  """The next tokens of sequences `rows`: each sequence draws with its own
  key, so a sequence samples the same way in any batch."""
  if greedy:
    return jnp.argmax(log_p, axis=-1).astype(jnp.int32)
  keys = jax.vmap(
    lambda i: jax.random.fold_in(jax.random.fold_in(key, i), step)
  )(jnp.arange(rows.start, rows.stop)[: log_p.shape[0]])
  token = jax.vmap(jax.random.categorical)(keys, log_p)
  return token.astype(jnp.int32)


def _decode(model, prompts, new_tokens: int, path: Path, choose):
  """Prefill the prompts, then one decode step per new token; `choose(
  step, log_p, rows)` gives the token to append for the sequences `rows`.
  Returns (tokens, log-probs); with `decode_batch`, batch by batch."""
  size = path.decode_batch
  if size is not None and size < prompts.shape[0]:
    parts = [
      _decode_batch(
        model,
        prompts[start : start + size],
        new_tokens,
        path,
        choose,
        slice(start, start + size),
      )
      for start in range(0, prompts.shape[0], size)
    ]
    return tuple(jnp.concatenate(p, axis=0) for p in zip(*parts))
  return _decode_batch(
    model, prompts, new_tokens, path, choose, slice(0, prompts.shape[0])
  )


def _decode_batch(model, prompts, new_tokens, path: Path, choose, rows):
  path = dataclasses.replace(path, mode="decode")
  model = with_weights(model, path.weights)
  batch, prompt_len = prompts.shape
  _check_length(model, prompt_len + new_tokens)
  cache = model.empty_cache(batch)
  log_p, cache = _prefill(model, prompts, cache, path)
  tokens, log_probs = [prompts], []
  for step in range(new_tokens):
    token = choose(step, log_p, rows)
    log_probs.append(jnp.take_along_axis(log_p, token[:, None], axis=-1))
    tokens.append(token[:, None])
    if step + 1 < new_tokens:
      log_p, cache = _decode_step(model, token, cache, path)
  return jnp.concatenate(tokens, axis=1), jnp.concatenate(log_probs, axis=1)


def generate(
  model: Transformer,
  prompts,
  new_tokens: int,
  path: Path,
  *,
  key=None,
  greedy: bool = False,
):
  """Samples `new_tokens` after each prompt ([B, P] int) through a KV
  cache: the prompt in one prefill, then one decode step per token.

  Returns (tokens [B, P + new_tokens], the sampler's log-probabilities of
  the new tokens [B, new_tokens]). `greedy` takes the most likely token
  (ties to the lowest id); otherwise tokens are drawn from the sampler's
  distribution with `key`.
  """
  if key is None and not greedy:
    raise ValueError("sampling needs a PRNG key (or greedy=True).")
  return _decode(
    model,
    jnp.asarray(prompts, jnp.int32),
    new_tokens,
    path,
    lambda step, log_p, rows: _pick(log_p, step, key, greedy, rows),
  )


@functools.partial(nnx.jit, static_argnames=("prompt_len", "head_format"))
def _score_full(model, tokens, prompt_len: int, head_format: str):
  logits, _ = model(tokens[:, :-1], head_format=head_format)
  log_p = _log_softmax(logits[:, prompt_len - 1 :])
  chosen = tokens[:, prompt_len:, None]
  return jnp.take_along_axis(log_p, chosen, axis=-1)[..., 0]


def score(model: Transformer, tokens, prompt_len: int, path: Path):
  """Log-probabilities [B, T - prompt_len] of tokens[:, prompt_len:] under
  `path`: one pass over the sequence ("full"), or the sampler's prefill
  and decode steps with the tokens forced ("decode")."""
  tokens = jnp.asarray(tokens, jnp.int32)
  if path.mode == "decode":
    new = tokens[:, prompt_len:]
    _, log_probs = _decode(
      model,
      tokens[:, :prompt_len],
      new.shape[1],
      path,
      lambda step, log_p, rows: new[rows, step],
    )
    return log_probs
  _check_length(model, tokens.shape[1])
  trainer = with_weights(with_attention(model, path.attention), path.weights)
  return _score_full(trainer, tokens, prompt_len, path.head_format)


def token_metrics(log_p_sample, log_p_train, tis_threshold=TIS_THRESHOLD):
  """Per-run statistics of the per-token mismatch (verl's names where it
  logs them): |p_sample - p_train| max, mean and std; KL(sample || train)
  estimated from the sampled tokens by k1 = log(p_s / p_t) and k3 = (r - 1)
  - log r with r = p_t / p_s (Schulman's estimators); the log importance
  ratio log(p_t / p_s) at quantiles; the share of tokens whose ratio
  exceeds the TIS cap."""
  log_s = np.asarray(log_p_sample, np.float64).ravel()
  log_t = np.asarray(log_p_train, np.float64).ravel()
  diff = np.abs(np.exp(log_s) - np.exp(log_t))
  log_ratio = log_t - log_s
  ratio = np.exp(log_ratio)
  quantiles = np.quantile(log_ratio, [0.01, 0.5, 0.99])
  return {
    "rollout_probs_diff_max": float(diff.max()),
    "rollout_probs_diff_mean": float(diff.mean()),
    "rollout_probs_diff_std": float(diff.std()),
    "kl_k1": float(np.mean(-log_ratio)),
    "kl_k3": float(np.mean(ratio - 1 - log_ratio)),
    "log_ratio_p01": float(quantiles[0]),
    "log_ratio_p50": float(quantiles[1]),
    "log_ratio_p99": float(quantiles[2]),
    "tis_share": float(np.mean(ratio > tis_threshold)),
    "tokens": int(log_s.size),
  }


def first_divergence(tokens_a, tokens_b, prompt_len: int) -> np.ndarray:
  """Per sequence, the first generated position where two continuations
  differ, or the continuation's length where they never do."""
  a = np.asarray(tokens_a)[:, prompt_len:]
  b = np.asarray(tokens_b)[:, prompt_len:]
  differs = a != b
  return np.where(differs.any(axis=1), differs.argmax(axis=1), a.shape[1])
