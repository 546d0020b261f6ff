"""The batch layouts of rollout micro-batches (shared-prefix: ``prompt_group_batch``; padding-free:
``packed_completion_batch``), and how the sequences of a packed row attend (``split_packed_attention``).

The forwards that run these layouts live with training (``training.sft_forward``, ``training.rollout_forward``,
``training.preference_forward``). Which model may run which layout is checked at fit start
(``adaptations.check_layout``); the conformance tests hold every model family to them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightalign.datamodules.shared_prefix import prompt_group_segments, shared_prefix_batch
from lightalign.modules.adaptations.attention import VARLEN_SDPA
from lightalign.modules.training.device_tuning import tuned


def is_packed_row(batch: dict[str, Any]) -> bool:
    """A padding-free batch: one row, ``position_ids`` given and no attention mask."""
    return "position_ids" in batch and "attention_mask" not in batch and batch["input_ids"].shape[0] == 1


def _unmeasured(model: torch.nn.Module) -> bool:
    return False  # not known to keep packed sequences apart: split them (exact on every model)


# Whether the model's own ``sdpa`` masks keep a packed row's sequences apart: the probe's verdict
# (``support.native_packing_exact``, which ``lightalign.modules.adaptations.support`` plugs in here when it is
# imported: the probe measures by running the forwards that ask this module, so this module does not import the
# probe).
native_packing_exact: Callable[[torch.nn.Module], bool] = _unmeasured


def split_packed_attention(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a packed row's sequences attend one SDPA call each (``sdpa_varlen``). On CPU it is the faster way
    (measured there: ``tuned``'s ``split_packed_sequences``); elsewhere only where the model's own
    ``sdpa`` mask would let attention cross sequences (measured on its probe, ``native_packing_exact``)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != VARLEN_SDPA:
        return False
    return bool(tuned("split_packed_sequences", device)) or not native_packing_exact(model)






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
