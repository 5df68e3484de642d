"""Training with a named attention: the Flax transformer (with KV-cache
decoding), the Optax trainer, the byte corpus, weight-drift measures, the
sampler's and trainer's paths for rollouts, and several-host setup.

May import `numerics`, `contract`, `kernels` and `ops`; never `auditing` or
`experiments`.
"""
