"""The forward of SFT rows: padded, or one padding-free row whose sequences attend apart (``sft_logits``); the
padding-free rows of DPO pairs run it too. Rows with images add their image inputs (``model_inputs``) and no
``position_ids``: a multimodal-rotary model (Qwen2-VL's mRoPE) computes its own from them."""

from __future__ import annotations

from typing import Any

import torch

from lightalign.modules.adaptations.attention import sequence_sizes
from lightalign.modules.adaptations.layouts import is_packed_row, split_packed_attention
from lightalign.vision.inputs import model_inputs


def sft_logits(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Logits ``[rows, T, V]`` of an SFT batch (padded, or one padding-free row with ``position_ids``; with images:
    padded, plus ``model_inputs``)."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    inputs.update(model_inputs(batch))
    if is_packed_row(batch) and split_packed_attention(model, batch["input_ids"].device):
        sizes = batch.get("sequence_sizes")  # host integers from the collator: no device read per layer
        inputs["sequence_sizes"] = list(sizes) if sizes is not None else sequence_sizes(batch["position_ids"])
    return model(**inputs, use_cache=False).logits
