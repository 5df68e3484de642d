"""The mismatch experiment's pairs: a sampler path against a trainer path,
with the same weights.

Subjects change how attention computes (the question), the control
changes nothing and must give exactly 0, references change another part
of the model (the language-model head's format; the weights' format), so
that attention's share of the mismatch can be read against them.
"""

from __future__ import annotations

import dataclasses

from stableattn.contract.options import Options
from stableattn.experiments.forward.inference_rows import heuristic_splits
from stableattn.ops.dispatch import attention
from stableattn.training.model import AttentionSpec
from stableattn.training.rollout import Path

SUBJECT, CONTROL, REFERENCE = "subject", "control", "reference"


def flash(precision: str, **options) -> AttentionSpec:
  """Our flash kernel under `precision`."""
  return AttentionSpec("pallas", Options(precision=precision, **options))


@dataclasses.dataclass(frozen=True)
class Pair:
  name: str
  role: str
  sampler: Path
  trainer: Path
  meaning: str


def decoding(attention, head="fp32", weights="fp32") -> Path:
  """A sampler's path: prefill, then one step per token over a KV cache."""
  return Path(attention, head, mode="decode", weights=weights)


def one_pass(attention, head="fp32", weights="fp32") -> Path:
  """A trainer's path: one pass over the whole sequence."""
  return Path(attention, head, mode="full", weights=weights)


def split_by_batch(q, k, v, **features):
  """Flash attention (`bf16-fa2`, 16x16 tiles) whose split-KV count a
  launch heuristic picks from the batch size (more splits for fewer
  rows), as engines without a batch-invariant mode do: a sequence's
  probabilities depend on what it is batched with."""
  splits = heuristic_splits(q.shape[0], q.shape[2])
  options = Options(
    precision="bf16-fa2", block_q=16, block_k=16, num_splits=splits
  )
  return attention(q, k, v, options=options, **features)


BF16 = flash("bf16-fa2")
# Weights and every activation in BF16, the head's operands too
# (head "compute"): an engine, or a trainer, computing in BF16.
ACTIVATIONS = "bf16-activations"
BY_BATCH = AttentionSpec(f"{__name__}:split_by_batch")
PAIRS = {
  pair.name: pair
  for pair in (
    Pair(
      "control",
      CONTROL,
      decoding(BF16),
      decoding(BF16),
      "the sampler's own path, recomputed: must be exactly 0",
    ),
    Pair(
      "flash_decode_vs_train_bf16",
      SUBJECT,
      decoding(BF16),
      one_pass(BF16),
      "flash decode over a KV cache vs the flash training pass, bf16-fa2",
    ),
    Pair(
      "flash_decode_vs_train_fp16",
      SUBJECT,
      decoding(flash("fp16-fa2")),
      one_pass(flash("fp16-fa2")),
      "the same in fp16-fa2 (Qi et al.: FP16 removes the mismatch)",
    ),
    Pair(
      "split_vs_unsplit_decode",
      SUBJECT,
      decoding(flash("bf16-fa2", num_splits=4)),
      decoding(BF16),
      "split-KV decode (4 splits) vs unsplit decode, bf16-fa2",
    ),
    Pair(
      "batch_n_vs_batch_1_decode",
      SUBJECT,
      decoding(BY_BATCH),
      dataclasses.replace(decoding(BY_BATCH), decode_batch=1),
      "every prompt decoded in one batch vs each alone, by a kernel whose "
      "split count follows the batch size",
    ),
    Pair(
      "fp8_decode_vs_bf16_train",
      SUBJECT,
      decoding(flash("fp8-fa3")),
      one_pass(BF16),
      "fp8-fa3 decode vs the bf16-fa2 training pass",
    ),
    Pair(
      "baseline_decode_vs_flash_train",
      SUBJECT,
      decoding(AttentionSpec("reference", Options(precision="bf16-framework"))),
      one_pass(BF16),
      "eager BF16 attention decoding vs the flash training pass",
    ),
    Pair(
      "head_bf16_vs_fp32",
      REFERENCE,
      decoding(BF16, head="bf16"),
      decoding(BF16),
      "the language-model head in BF16 vs FP32 (PipelineRL's fix), same "
      "attention path",
    ),
    Pair(
      "weights_bf16_vs_fp32",
      REFERENCE,
      decoding(BF16, weights="bf16"),
      decoding(BF16),
      "weights rounded to BF16 vs FP32, same attention path",
    ),
    Pair(
      "flash_decode_vs_train_bf16_activations",
      SUBJECT,
      decoding(BF16, head="compute", weights=ACTIVATIONS),
      one_pass(BF16, head="compute", weights=ACTIVATIONS),
      "flash decode vs the flash training pass, bf16-fa2, both computing "
      "every activation in BF16",
    ),
    Pair(
      "model_bf16_activations_vs_fp32",
      REFERENCE,
      decoding(BF16, head="compute", weights=ACTIVATIONS),
      decoding(BF16),
      "the whole model in BF16 (weights, activations, head) vs FP32, same "
      "attention path",
    ),
  )
}


def choose(names, table: dict, always: str, what: str) -> tuple:
  """Entries of `table` by name ("all", or a comma list), `always` first.

  Raises a ValueError naming `what` (the config field) and the valid
  names for an unknown or empty choice."""
  if isinstance(names, str):
    names = [n.strip() for n in names.split(",") if n.strip()]
  names = list(names)
  if names == ["all"]:
    return tuple(table.values())
  unknown = [n for n in names if n not in table]
  if unknown or not names:
    raise ValueError(
      f"{what}: unknown {unknown}; valid: {list(table)} or 'all'."
    )
  return tuple(table[n] for n in dict.fromkeys([always, *names]))


def resolve(names) -> tuple[Pair, ...]:
  """Pairs by name ("all", or a comma list); the control always runs."""
  return choose(names, PAIRS, "control", "config.pairs")
