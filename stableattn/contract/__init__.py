"""The contract every attention implementation meets: what it computes
(`Features`: masks, softcap, sink, bias, ... under jax's names, and
`masking`'s one definition of which query-key pairs attend), how it is
asked to compute it (`Options`: policy, tiles, scheme, splits), the shapes
it takes, tile sizes, and the FP64 golden value it is judged against.

May import `stableattn.numerics` only.
"""
