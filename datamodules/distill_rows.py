"""The rows of ``DistillModule``: the data's completions tokenised as SFT tokenises them, right-padded into tensors,
and the data's own column names (without the datamodule's tokenisation columns) for its refusals."""

from __future__ import annotations

from typing import Any

import torch

from lightalign.datamodules.formats import DataFormatError, render_prompt_completion


def tokenize_completions(tokenizer: Any, prompts: list[Any], completions: list[Any], max_length: int,
                         ) -> list[list[int]]:
    """The data's completions as token ids, as SFT tokenises a prompt-completion row: a string completion without
    special tokens plus EOS; a conversational one as the chat template renders it after the prompt (with its
    generation prompt). Kept to the first ``max_length`` tokens."""
    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if isinstance(prompt, list) != isinstance(completion, list):
            raise DataFormatError(f"'prompt' and 'completion' must both be strings or both be message lists (batch "
                                  f"row {i}: prompt {type(prompt).__name__}, completion {type(completion).__name__}).")
        if isinstance(prompt, list):
            _, text = render_prompt_completion(tokenizer, prompt, completion)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
            if tokenizer.eos_token_id is not None:
                ids = ids + [tokenizer.eos_token_id]
        rows.append(list(ids)[:max_length])
    return rows


def right_pad(rows: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids.to(device), mask.to(device)


def data_columns(columns: list[str]) -> list[str]:
    """The data's own columns, without those the datamodule's tokenisation added (``*_input_ids`` ...)."""
    return sorted(c for c in columns if not c.endswith(("_input_ids", "_attention_mask")))

