"""Judging any kernel: `audit` (output and gradients against FP64 under the
four projects' rules, determinism, NaN/Inf), its forward slice `check`, the
invariance probes (batch, decode, chunks, caches, splits), and the inputs
and feature recipes they are run on.

May import `numerics`, `contract`, `kernels` and `ops`; never `training` or
`experiments`.
"""
