"""The Hopper path's rows of a GPU session (`hopper_stage.hopper_rows`) as
the table and goal lines docs/performance.md quotes."""

from __future__ import annotations

from stableattn.harness.reporting import goal_verdict, num, table

# The length every goal of a GPU session is read at.
GOAL_LENGTH = 8192
# The goals for implementation="mosaic_gpu" against cuDNN (our
# speed: cuDNN's time over ours), BF16, head dim 128, 8K, not causal.
SPEED_GOALS = {"forward": 0.8, "forward_backward": 0.7}
NAMES = ("mosaic_gpu", "cudnn", "jax_mha", "jax_mgpu", "pallas")


def _points(rows) -> dict:
  """{(mode, causal, length): {name: row}} of the core comparison (not
  the feature rows)."""
  points: dict = {}
  for r in rows:
    if "feature" in r:
      continue
    key = (r["mode"], r["causal"], r["seq_len"])
    points.setdefault(key, {})[r["implementation"]] = r
  return points


def hopper_table(rows) -> str:
  """ms per name and point ("fails" where it could not run), and ours
  against cuDNN (its time over ours)."""
  header = ["mode", "causal", "length", *NAMES, "mosaic_gpu vs cuDNN"]
  body = []
  for (mode, causal, length), named in sorted(_points(rows).items()):
    cells = [
      num(named[n]["median_ms"]) if "median_ms" in named.get(n, {}) else "fails"
      for n in NAMES
    ]
    ours = named.get("mosaic_gpu", {})
    speed = ours.get("speed_vs_cudnn")
    body.append(
      [mode, str(causal), str(length), *cells,
       f"{speed:.2f}x" if speed is not None else "-"]
    )  # fmt: skip
  return table(header, body)


def hopper_goal_lines(rows) -> str:
  """Each speed goal met or missed with its measured ratio."""
  points = _points(rows)
  lines = []
  for mode, least in SPEED_GOALS.items():
    ours = points.get((mode, False, GOAL_LENGTH), {}).get("mosaic_gpu", {})
    speed = ours.get("speed_vs_cudnn")
    label = f"- mosaic_gpu {mode.replace('_', '+')} vs cuDNN >= {least}x"
    if speed is None:
      lines.append(f"{label}: not measured (no row at {GOAL_LENGTH})")
    else:
      lines.append(f"{label}: {goal_verdict(speed >= least)} ({speed:.2f}x)")
  return "\n".join(lines)


def _ms(row) -> str:
  return num(row["median_ms"]) if "median_ms" in (row or {}) else "fails"


def hopper_form_table(rows) -> str:
  """FlashAttention-3's forms of the forward against the interpreter's:
  ms and the interpreter form's time over each form's (> 1: faster)."""
  body = []
  for (mode, causal, length), named in sorted(_points(rows).items()):
    base = named.get("mosaic_gpu", {}).get("median_ms")
    for name in sorted(n for n in named if n.startswith("mosaic_gpu ")):
      ms = named[name].get("median_ms")
      speed = f"{base / ms:.2f}x" if base and ms else "-"
      body.append(
        [mode, str(causal), str(length), name.split(" ", 1)[1],
         _ms(named[name]), num(base) if base else "fails", speed]
      )  # fmt: skip
  if not body:
    return ""
  header = ["mode", "causal", "length", "form", "ms", "interpreter form ms",
            "speed vs interpreter form"]  # fmt: skip
  return table(header, body)


def hopper_feature_table(rows) -> str:
  """Each feature's ms on our two paths and cuDNN, and the Hopper path's
  speed against the Triton path's."""
  points: dict = {}
  for r in rows:
    if "feature" in r:
      key = (r["feature"], r["mode"], r["causal"], r["seq_len"])
      points.setdefault(key, {})[r["implementation"]] = r
  body = []
  for (feature, mode, causal, length), named in sorted(points.items()):
    ours = named.get("mosaic_gpu", {}).get("median_ms")
    triton = named.get("pallas", {}).get("median_ms")
    speed = f"{triton / ours:.2f}x" if ours and triton else "-"
    body.append(
      [feature, mode, str(causal), str(length),
       *(_ms(named.get(n)) for n in ("mosaic_gpu", "pallas", "cudnn")),
       speed]
    )  # fmt: skip
  if not body:
    return ""
  header = ["feature", "mode", "causal", "length", "mosaic_gpu", "pallas",
            "cudnn", "mosaic_gpu vs pallas"]  # fmt: skip
  return table(header, body)


def hopper_sections(rows) -> dict[str, str]:
  """The Hopper path's table and goals, where the session timed it."""
  if not rows:
    return {}
  return {
    "hopper": hopper_table(rows),
    "hopper_goals": hopper_goal_lines(rows),
    "hopper_forms": hopper_form_table(rows),
    "hopper_features": hopper_feature_table(rows),
  }
