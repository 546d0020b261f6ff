"""One forward per batch layout: SFT rows (padded or padding-free) and GRPO micro-batches (padded, shared-prefix or
padding-free).

Each function takes the model and a batch as the datamodule (or the GRPO rollout) made it and returns what the
loss needs. Which model may run which layout is checked at fit start (``adaptations.check_layout``); the
conformance tests hold every model family to these functions.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightalign.datamodules.shared_prefix import prompt_group_segments, shared_prefix_batch
from lightalign.modules.adaptations.attention import VARLEN_SDPA, sequence_sizes
from lightalign.modules.training.device_tuning import tuned
from lightalign.modules.training.logprobs import (forward_accepts, scatter_to_sequences, selective_log_softmax,
                                         shared_prefix_token_logps)


def is_packed_row(batch: dict[str, Any]) -> bool:
    """A padding-free batch: one row, ``position_ids`` given and no attention mask."""
    return "position_ids" in batch and "attention_mask" not in batch and batch["input_ids"].shape[0] == 1


def _unmeasured(model: torch.nn.Module) -> bool:
    return False  # not known to keep packed sequences apart: split them (exact on every model)


# Whether the model's own ``sdpa`` masks keep a packed row's sequences apart: the probe's verdict
# (``support.native_packing_exact``, which ``lightalign.modules.adaptations.support`` plugs in here when it is
# imported: the probe measures by running these layouts, so this module does not import the probe).
native_packing_exact: Callable[[torch.nn.Module], bool] = _unmeasured


def split_packed_attention(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a packed row's sequences attend one SDPA call each (``sdpa_varlen``). On CPU it is the faster way
    (measured there: ``tuned``'s ``split_packed_sequences``); elsewhere only where the model's own
    ``sdpa`` mask would let attention cross sequences (measured on its probe, ``native_packing_exact``)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != VARLEN_SDPA:
        return False
    return bool(tuned("split_packed_sequences", device)) or not native_packing_exact(model)


def sft_logits(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Logits ``[rows, T, V]`` of an SFT batch (padded, or one padding-free row with ``position_ids``)."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    if is_packed_row(batch) and split_packed_attention(model, batch["input_ids"].device):
        sizes = batch.get("sequence_sizes")  # host integers from the collator: no device read per layer
        inputs["sequence_sizes"] = list(sizes) if sizes is not None else sequence_sizes(batch["position_ids"])
    return model(**inputs, use_cache=False).logits


def padded_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows, as ``generate`` counts them: ``cumsum(mask) - 1`` (padding at 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def grpo_forward(model: torch.nn.Module, mb: dict[str, Any], temperature: float = 1.0):
    """Per-token log-probs ``[B, T]`` of a GRPO micro-batch's completion tokens, the logits they came from
    (divided by ``temperature``) and the mask selecting the scored rows of those logits.

    Padded layout: ``[left-padded prompt, completion]`` rows, positions counted from each row's first real token
    (what ``generate`` used; models with learned absolute positions depend on it). Shared layout (``mb["shared"]``):
    one segment per prompt, logits only where a completion token is predicted. Padding-free layout
    (``mb["packed"]``, ``packed_completion_batch``): every ``[prompt, completion]`` one after the other in one row,
    positions from 0 for each, one attention call per sequence; logits only where a completion token is predicted.
    In both the logits are ``[targets, V]`` and the mask says which of them the loss scores."""
    b, t = mb["completion_ids"].shape
    if "packed" in mb:
        packed = mb["packed"]
        logps, logits = packed_token_logps(model, packed, b, t, temperature)
        return logps, logits, mb["completion_mask"][packed["target_sequence"], packed["target_offset"]].bool()
    if "shared" in mb:
        shared = mb["shared"]
        logps, logits = shared_prefix_token_logps(model, shared, b, t, temperature)
        return logps, logits, mb["completion_mask"][shared["target_sequence"], shared["target_offset"]].bool()
    input_ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
    # a tool rollout's loss mask leaves out the tool results, which its attention mask keeps
    attention_mask = torch.cat([mb["prompt_mask"], mb.get("completion_attention_mask", mb["completion_mask"])], dim=1)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=t + 1)
    if forward_accepts(model, "position_ids"):
        inputs["position_ids"] = padded_position_ids(attention_mask)
    logits = model(**inputs).logits[:, :-1] / temperature  # the sampling distribution
    return selective_log_softmax(logits, mb["completion_ids"]), logits, mb["completion_mask"].bool()


def grpo_token_logps(model: torch.nn.Module, mb: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
    return grpo_forward(model, mb, temperature)[0]


def prompt_group_batch(mb: dict[str, torch.Tensor], pad_token_id: int, pack_length: int,
                       lengths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A GRPO micro-batch in the shared-prefix layout (one segment per distinct prompt), on its device.
    ``lengths``: completion tokens per row (default: the completion mask's counts)."""
    lengths = mb["completion_mask"].sum(-1) if lengths is None else lengths
    segments = prompt_group_segments(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], lengths)
    shared = shared_prefix_batch(segments, pad_token_id, pack_length)
    device = mb["completion_ids"].device
    return {k: v.to(device) for k, v in shared.items()}


def packed_completion_batch(mb: dict[str, torch.Tensor], lengths: torch.Tensor | None = None
                            ) -> dict[str, torch.Tensor]:
    """A GRPO micro-batch in the padding-free layout, on its device: each row's real prompt tokens and its
    completion one after the other in a single row ``[1, N]``, no padding anywhere.

    ``lengths``: completion tokens per row (default: the completion mask's counts). A completion's last token is
    only a target (nothing after it is computed), so it is left out of the row: a sequence of ``p`` prompt and
    ``c`` completion tokens takes ``p + c - 1`` positions, numbered ``0 .. p + c - 2`` exactly as the padded layout
    numbers them from the row's first real token. Returns ``input_ids`` and ``position_ids`` ``[1, N]``,
    ``sequence_sizes`` ``[S]`` (read once per forward for ``sdpa_varlen``), and per completion token ``targets``,
    ``logits_index`` (its predicting position in the row), ``target_sequence`` (row of the micro-batch) and
    ``target_offset`` (position in the completion)."""
    device = mb["completion_ids"].device
    prompt_ids, prompt_mask = mb["prompt_ids"].cpu(), mb["prompt_mask"].cpu().bool()
    completion_ids = mb["completion_ids"].cpu()
    counts = (mb["completion_mask"].sum(-1) if lengths is None else lengths).tolist()
    tokens, positions, sizes, index, sequences, offsets, targets = [], [], [], [], [], [], []
    start = 0
    for row, c in enumerate(counts):
        if c == 0:
            continue  # nothing to score: the row is left out
        prompt = prompt_ids[row][prompt_mask[row]]
        p = prompt.shape[0]
        if p == 0:
            raise ValueError(f"row {row} of the GRPO micro-batch has an empty prompt: its first completion token "
                             "has nothing to be predicted from.")
        completion = completion_ids[row, :c]
        tokens += [prompt, completion[:-1]]
        size = p + c - 1
        positions.append(torch.arange(size))
        sizes.append(size)
        index.append(torch.arange(start + p - 1, start + size))
        sequences.append(torch.full((c,), row))
        offsets.append(torch.arange(c))
        targets.append(completion)
        start += size
    if not sizes:
        raise ValueError("the packed micro-batch has no completion token to score (every row's completion is empty).")
    out = {
        "input_ids": torch.cat(tokens)[None], "position_ids": torch.cat(positions)[None],
        "sequence_sizes": torch.tensor(sizes), "logits_index": torch.cat(index), "targets": torch.cat(targets),
        "target_sequence": torch.cat(sequences), "target_offset": torch.cat(offsets),
    }
    return {k: v.to(device) for k, v in out.items()}


def packed_logits(model: torch.nn.Module, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ``[targets, V]`` logits (untempered) of a padding-free batch (``packed_completion_batch``), row ``j``
    predicting ``packed["targets"][j]``: one forward of the packed row, logits only at ``logits_index``."""
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"], "use_cache": False}
    if split_packed_attention(model, packed["input_ids"].device):
        inputs["sequence_sizes"] = packed["sequence_sizes"].tolist()  # host integers, read once per forward
    index = packed["logits_index"]
    if forward_accepts(model, "logits_to_keep"):
        logits = model(**inputs, logits_to_keep=index).logits[0]
        if logits.shape[0] != index.shape[0]:  # a model that ignores an index tensor returns every position
            logits = logits[index]
        return logits
    return model(**inputs).logits[0, index]


def packed_token_logps(model: torch.nn.Module, packed: dict[str, torch.Tensor], num_sequences: int, width: int,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[num_sequences, width]`` of a padding-free GRPO batch's completion tokens (0 where a
    row has none) and the ``[targets, V]`` logits they came from (divided by ``temperature``)."""
    logits = packed_logits(model, packed) / temperature  # the sampling distribution
    logps = selective_log_softmax(logits, packed["targets"])
    return scatter_to_sequences(logps, packed, num_sequences, width)[0], logits
