"""What users call: `attention` (validation and dispatch to one
implementation), the registry of every attention by name (ours and peer
libraries' behind one contract), the Flax `attention_fn`, paged attention
over a KV cache, and ring attention over a device mesh.

May import `numerics`, `contract` and `kernels`.
"""
