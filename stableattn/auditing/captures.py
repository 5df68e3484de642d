"""A model's own attention tensors, captured in training and audited.

Random inputs pass where real activations fail (TransformerEngine #3216:
FA4's GQA dQ about 5x too large only on real activations; PyTorch #196678
met through one massive-activation head of Qwen2.5-0.5B). A capture keeps,
for chosen layers at one training step, q, k and v as the attention
kernel received them and the cotangent dO of its output, so that the
audit can judge any kernel on exactly those tensors.

On disk (one folder per step, under a run's `captures/`):

  step_000300/capture.json    format, step, dtype, features, layers, the
                              model's config and the batch rows kept
  step_000300/layer_02.npz    q, k, v [B, T, H, D] and d_out [B, T, H, Dv]
                              as float32 (exact for BF16 and FP16 values);
                              without d_out the audit draws a cotangent

Size per layer: 4 x rows x length x heads x head_dim x 4 bytes (the
drift launcher's default model, 2 rows of 64 tokens, 4 heads of 32:
128 KiB; GPT-2 small's shape, 2 rows of 1024: 12 MiB).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import zipfile

import numpy as np

from stableattn.auditing.edge_case import EdgeCase

CAPTURE_FORMAT = 1
REGIME = "captured"
TENSORS = ("q", "k", "v", "d_out")
REQUIRED = ("q", "k", "v")  # without d_out the audit draws a cotangent


def step_folder(root, step: int) -> pathlib.Path:
  return pathlib.Path(root) / f"step_{step:06d}"


def save(
  root,
  step: int,
  layers: dict[int, dict[str, np.ndarray]],
  *,
  dtype: str,
  features: dict,
  metadata: dict | None = None,
) -> pathlib.Path:
  """Writes one step's capture; `layers`: layer index -> {q, k, v, d_out}.
  Returns its folder."""
  folder = step_folder(root, step)
  folder.mkdir(parents=True, exist_ok=True)
  shapes = {}
  for layer, arrays in sorted(layers.items()):
    missing = [t for t in REQUIRED if t not in arrays]
    if missing:
      raise ValueError(
        f"layer {layer}'s capture lacks {missing}; a layer holds q, k and v "
        "(and d_out, the cotangent of its output, where known)."
      )
    kept = [t for t in TENSORS if t in arrays]
    np.savez(
      folder / f"layer_{layer:02d}.npz",
      **{t: np.asarray(arrays[t], np.float32) for t in kept},
    )
    shapes[layer] = {t: list(np.shape(arrays[t])) for t in kept}
  record = {
    "format": CAPTURE_FORMAT,
    "step": step,
    "dtype": dtype,
    "features": features,
    "layers": {str(k): v for k, v in shapes.items()},
    **(metadata or {}),
  }
  (folder / "capture.json").write_text(json.dumps(record, indent=2) + "\n")
  return folder


def save_layers(
  root, step: int, layers, *, features: dict, metadata: dict, keep=()
):
  """`save` of a trainer's capture (a list over layers of {q, k, v, d_out}
  arrays, `stableattn.training.trainer.Trainer.capture`), the layers in
  `keep` only (empty: all); the dtype recorded is q's, the format the
  kernel received them in (a BF16 run's under either mixed-precision
  convention; its residual stream is the metadata's to say)."""
  unknown = [i for i in keep if not 0 <= i < len(layers)]
  if unknown:
    raise ValueError(
      f"capture layers {unknown} do not exist; the model has layers "
      f"0-{len(layers) - 1}."
    )
  arrays = {
    i: {t: np.asarray(a, np.float32) for t, a in layer.items()}
    for i, layer in enumerate(layers)
    if not keep or i in keep
  }
  dtype = str(np.dtype(layers[0]["q"].dtype))
  return save(root, step, arrays, dtype=dtype, features=features,
              metadata=metadata)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CapturedLayer:
  step: int
  layer: int
  dtype: str
  features: dict
  tensors: dict  # q, k, v (and d_out where captured) as float64
  source: str = ""  # the capture's folder under the path loaded, if nested

  @property
  def label(self) -> str:
    where = f"{self.source}, " if self.source else ""
    return f"{where}step {self.step}, layer {self.layer}"

  def edge_case(self) -> EdgeCase:
    t = self.tensors
    return EdgeCase(
      REGIME, self.label, t["q"], t["k"], t["v"], dict(self.features),
      d_out=t.get("d_out"),
    )  # fmt: skip


def _step_folders(path: pathlib.Path) -> list[pathlib.Path]:
  """Every step folder at or under `path` (a run's captures/, or one
  folder of captures per training cell, as the stability sweep writes)."""
  return sorted(p.parent for p in path.rglob("capture.json"))


def index(path) -> list[tuple[pathlib.Path, dict]]:
  """(step folder, its capture.json) of every capture under `path`,
  checked without reading the arrays."""
  path = pathlib.Path(path)
  if not path.exists():
    raise ValueError(f"no captures at {path}: the path does not exist.")
  folders = _step_folders(path)
  if not folders:
    raise ValueError(
      f"no captures under {path}: expected step_NNNNNN/capture.json "
      "folders (a training run with capture_steps set writes them to "
      "<workdir>/captures)."
    )
  records = []
  for folder in folders:
    record = json.loads((folder / "capture.json").read_text())
    if record.get("format") != CAPTURE_FORMAT:
      raise ValueError(
        f"{folder}/capture.json has format {record.get('format')!r}; this "
        f"version reads format {CAPTURE_FORMAT}."
      )
    records.append((folder, record))
  return records


def load(path, *, layers=None, steps=None) -> list[CapturedLayer]:
  """Every captured layer under `path`: a run directory, its `captures/`
  folder or one step's folder; `layers`, `steps`: keep only these."""
  path = pathlib.Path(path)
  root = path if path.is_dir() else path.parent
  found = []
  for folder, record in index(path):
    if steps is not None and record["step"] not in steps:
      continue
    for name in sorted(record["layers"], key=int):
      layer = int(name)
      if layers is not None and layer not in layers:
        continue
      tensors = _read_layer(folder / f"layer_{layer:02d}.npz")
      nested = folder.parent.relative_to(root) if folder != root else None
      if nested is not None and nested.parts[:1] == ("captures",):
        nested = pathlib.Path(*nested.parts[1:])  # a run directory's own
      found.append(
        CapturedLayer(
          record["step"],
          layer,
          record["dtype"],
          record["features"],
          tensors,
          "" if nested in (None, pathlib.Path(".")) else nested.as_posix(),
        )  # fmt: skip
      )
  if not found:
    raise ValueError(
      f"the captures under {path} hold no layer of layers={layers}, "
      f"steps={steps}."
    )
  return found


def _read_layer(file: pathlib.Path) -> dict:
  """One layer's arrays as float64, or a ValueError naming the file: a
  truncated or unreadable file, a missing tensor, or shapes that are not
  one attention's q [B, T, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv]
  and d_out [B, T, H, Dv]."""
  try:
    with np.load(file) as data:
      tensors = {t: np.asarray(data[t], np.float64) for t in data.files}
  except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
    raise ValueError(
      f"{file}: cannot be read as a captured layer ({type(e).__name__}: "
      f"{e}); it may be truncated: capture it again."
    ) from None
  missing = [t for t in ("q", "k", "v") if t not in tensors]
  if missing:
    raise ValueError(f"{file}: holds {sorted(tensors)}, missing {missing}.")
  q, k, v = tensors["q"], tensors["k"], tensors["v"]
  d_out = tensors.get("d_out")
  shapes = {name: x.shape for name, x in tensors.items()}
  consistent = (
    q.ndim == k.ndim == v.ndim == 4
    and q.shape[0] == k.shape[0] == v.shape[0]
    and q.shape[3] == k.shape[3]
    and k.shape[:3] == v.shape[:3]
    and k.shape[2] > 0
    and q.shape[2] % k.shape[2] == 0
    and (d_out is None or d_out.shape == (*q.shape[:3], v.shape[3]))
  )
  if not consistent:
    raise ValueError(
      f"{file}: inconsistent shapes {shapes}; expected q [B, T, H, D], "
      "k [B, S, Hkv, D], v [B, S, Hkv, Dv] and d_out [B, T, H, Dv], with "
      "Hkv dividing H."
    )
  return tensors


def edge_cases(inputs) -> list[EdgeCase]:
  """The audit's cases of `inputs`: a path (see `load`), a list of
  `CapturedLayer`, or `EdgeCase`s as they are."""
  if isinstance(inputs, (str, pathlib.Path)):
    inputs = load(inputs)
  cases = []
  for item in inputs:
    if isinstance(item, CapturedLayer):
      cases.append(item.edge_case())
    elif isinstance(item, EdgeCase):
      cases.append(item)
    else:
      raise ValueError(
        "inputs must be a capture path, CapturedLayer or EdgeCase items; "
        f"got {type(item).__name__}."
      )
  return cases


def logits(q, k, causal: bool) -> np.ndarray:
  """Scores [b, h, t, s] in float64 of q [b, t, h, d] and k [b, s, hkv,
  d] (each KV head over its group of query heads), -inf where a causal
  row may not look (bottom-right aligned)."""
  k = np.repeat(np.asarray(k, np.float64), q.shape[2] // k.shape[2], axis=2)
  s = np.einsum("bthd,bshd->bhts", np.asarray(q, np.float64), k)
  s = s * q.shape[-1] ** -0.5
  if causal:
    t, n = s.shape[-2:]
    s = np.where(np.tril(np.ones((t, n), bool), n - t), s, -np.inf)
  return s


def statistics(
  layer: CapturedLayer, input_format: str | None = None, scores=None
) -> dict:
  """Where a captured layer sits among the audit's regimes: its largest
  logit, the share of rows whose two largest logits tie within one ulp of
  `input_format` ("bfloat16", "float16"; None: the tensors' own dtype),
  causal rows with two keys or more, and its key and value offset ratios
  (the largest head's, `offset_ratios`). `scores`: the layer's `logits`,
  where the caller has them already."""
  import ml_dtypes

  s = scores
  if s is None:
    s = logits(
      layer.tensors["q"], layer.tensors["k"], layer.features.get("causal")
    )
  top = np.sort(s, axis=-1)[..., -2:]
  mantissa = ml_dtypes.finfo(np.dtype(input_format or layer.dtype)).nmant
  magnitude = np.maximum(np.abs(top[..., 1]), 2.0**-100)
  ulp = 2.0 ** (np.floor(np.log2(magnitude)) - mantissa)
  rows = top[..., 1:, :] if layer.features.get("causal") else top
  gap = rows[..., 1] - rows[..., 0]
  return {
    "max_logit": float(np.max(s)),
    "near_tied_share": float(
      np.mean(
        gap <= ulp[..., 1:] if layer.features.get("causal") else gap <= ulp
      )
    ),
    **{
      f"{name}_offset_ratio": float(np.max(offset_ratios(layer.tensors[x])))
      for name, x in (("key", "k"), ("value", "v"))
      if x in layer.tensors  # a drawn case's statistics may hold q, k alone
    },
  }


def offset_ratios(x) -> np.ndarray:
  """[H]: the monitor's `offset_ratio` per head of x [B, S, H, D] (a
  component every token shares, over their spread about it)."""
  import jax.numpy as jnp

  from stableattn.numerics.monitor import offset_ratio

  ratios = offset_ratio(jnp.asarray(x, jnp.float32), over_heads=False)
  return np.asarray(ratios, np.float64)
