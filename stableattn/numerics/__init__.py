"""Numerics: number formats and the precision policy (which format each
stage of attention computes and stores in), the explicit roundings that
carry it out, FP8/FP4 quantization settings, deviation metrics, and the
four projects' pass/fail rules.

The lowest layer: it imports nothing from stableattn.
"""
