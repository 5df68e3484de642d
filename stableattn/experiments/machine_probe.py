"""A small training step whose bits show whether XLA compiled another
program: `python -m stableattn.experiments.machine_probe` prints the
SHA-256 of its loss and gradients. Run under two XLA_FLAGS, equal digests
mean both compile the same arithmetic here (see
`environment.other_machine_flags`)."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np


def _loss(weights, x):
  """A layer with tanh and an RMS norm, then a softmax cross-entropy: the
  matmuls, reductions and transcendentals of a transformer step."""
  hidden = jnp.tanh(x @ weights[0])
  hidden = hidden - hidden.mean(-1, keepdims=True)
  hidden = hidden * jax.lax.rsqrt(
    (hidden * hidden).mean(-1, keepdims=True) + 1e-6
  )
  logits = hidden @ weights[1]
  return jax.nn.logsumexp(logits, -1).mean() - logits[:, 0].mean()


def digest() -> str:
  rng = np.random.default_rng(0)
  weights = [
    jnp.asarray(rng.standard_normal((128, 128)) / 11, jnp.float32),
    jnp.asarray(rng.standard_normal((128, 512)) / 11, jnp.float32),
  ]
  x = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
  loss, grads = jax.jit(jax.value_and_grad(_loss))(weights, x)
  sha = hashlib.sha256()
  for value in (loss, *grads):
    sha.update(np.asarray(value).tobytes())
  return sha.hexdigest()


if __name__ == "__main__":
  print(digest())
