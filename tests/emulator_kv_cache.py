"""An FP8 KV cache read by 16-bit attention, emulated (policy option
kv_cache): K and V stored as round(x / s) in e4m3, s = amax / 448 over the
tensor (in FP32), read back as round(stored * s) in the `inputs` format.
Written from docs/precision.md, sharing no code with `stableattn`."""

import numpy as np


def read_from_cache(em, k, v, cast):
  if em.options["kv_cache"] == "none":
    return k, v

  def round_trip(x):
    x = np.asarray(x, np.float32)
    scale = np.float32(np.max(np.abs(x))) * np.float32(1.0 / 448.0)
    scale = scale if scale > 0 else np.float32(1)
    stored = cast((x * (np.float32(1) / scale)).astype(np.float32), "fp8_e4m3")
    read = (np.asarray(stored, np.float32) * scale).astype(np.float32)
    return em.r(read, "inputs")

  return round_trip(k), round_trip(v)
