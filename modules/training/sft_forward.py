"""The forward of SFT rows: padded, or one padding-free row whose sequences attend apart (``sft_logits``); the
padding-free rows of DPO pairs run it too."""

from __future__ import annotations

from typing import Any

import torch

from lightalign.modules.adaptations.attention import sequence_sizes
from lightalign.modules.adaptations.layouts import is_packed_row, split_packed_attention


def sft_logits(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Logits ``[rows, T, V]`` of an SFT batch (padded, or one padding-free row with ``position_ids``)."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    if is_packed_row(batch) and split_packed_attention(model, batch["input_ids"].device):
        sizes = batch.get("sequence_sizes")  # host integers from the collator: no device read per layer
        inputs["sequence_sizes"] = list(sizes) if sizes is not None else sequence_sizes(batch["position_ids"])
    return model(**inputs, use_cache=False).logits
