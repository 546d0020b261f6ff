"""The rows of ``DistillModule``: the data's completions tokenised as SFT tokenises them, right-padded into tensors,
the data's own column names (without the datamodule's tokenisation columns) for its refusals, and whether the rows
are packed when ``padding_free`` is unset (``default_padding_free``)."""

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


def default_padding_free(student: torch.nn.Module, teacher: torch.nn.Module, device: torch.device,
                         longest: int | None) -> tuple[bool, str | None]:
    """DistillModule's ``padding_free`` when it is unset: the device's measured default (``distill_padding_free``
    in ``tuned``'s table), and padded rows when the student or the teacher does not run the packed layout
    exactly (measured on a probe of its class, ``adaptations.check_layout``). Returns (packed, the fit-start note)."""
    from lightalign.modules.adaptations.support import LayoutRefused, check_layout
    from lightalign.modules.training.device_tuning import tuned

    if not tuned("distill_padding_free", device):
        return False, None
    for who, model in (("student", student), ("teacher", teacher)):
        try:
            check_layout(model, "grpo_packed", max_tokens=longest)
        except LayoutRefused as refused:
            return False, f"padded rows: the default padding_free is not exact on the {who}: {refused}"
    return True, "padding_free (the CPU default)"
