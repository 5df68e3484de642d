"""The experiments: the forward-deviation studies, training drift, the
learning-rate stability sweep, the sampler-trainer mismatch, the audit over
a grid, and the benchmark; with what they share (run directories, the
experiment engine, reporting, plotting, the host's description).

The top layer: it may import every other subpackage, and none imports it.
"""
