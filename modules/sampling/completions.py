"""A rollout's completions: ``num_generations`` samples per prompt of a prompt batch on a sampler
(``Sampler``, from the ``SAMPLERS`` registry), cut after their first EOS, decoded for the reward functions.

Every sampler (``generate``, ``continuous``, ``static``, ``compact``, vLLM) is called the same way and returns the
same contract; what follows is independent of which one sampled.
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.modules.sampling.samplers import Sampler, Samples, sample_groups


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every id that ends a completion: the generation config's and the tokenizer's EOS."""
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def cut_after_eos(completion_ids: torch.Tensor, eos: list[int], pad_token_id: int,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Completions cut after their first EOS (or at ``lengths``, each row's end when given): ``(ids padded with
    pad_token_id, mask through EOS, truncated)``."""
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device))
    end = completion_ids.shape[1]
    if lengths is not None:
        is_eos = is_eos & (positions[None, :] < lengths[:, None])
        end = lengths
    has_eos = is_eos.any(-1)
    last = torch.where(has_eos, is_eos.int().argmax(-1), end - 1)  # the last position each completion keeps
    completion_mask = (positions[None, :] <= last[:, None]).long()
    return completion_ids.masked_fill(completion_mask == 0, pad_token_id), completion_mask, ~has_eos


@torch.no_grad()
def sample_completions(model: torch.nn.Module, tokenizer: Any, batch: dict[str, Any], num_generations: int,
                       share_prefill: bool = True, backend: str | Sampler = "generate",
                       continuous_config: dict[str, Any] | None = None, return_logprobs: bool = False,
                       max_new_tokens: int = 256, **sampling: Any) -> dict[str, Any]:
    """A rollout: ``num_generations`` sampled completions per prompt of a ``PromptCollator`` batch (eval mode, then
    the model's mode is restored), cut after their first EOS, on ``backend`` (a registered sampler's name or a
    ``Sampler``: ``SAMPLERS``).

    Returns rows grouped by prompt: ``prompt_ids``/``prompt_mask`` (left-padded), ``completion_ids``/
    ``completion_mask`` (through EOS, padded after), ``truncated`` (no EOS), and for the reward functions
    ``prompts``, ``completions`` (strings, or assistant messages for conversational prompts), ``texts`` and
    ``columns`` (the data's other columns, plus ``completion_ids``). With ``return_logprobs`` also
    ``sampling_logps`` ``[rows, T]``: the log-prob each token had in the distribution it was sampled from
    (0 under the mask's zeros). A batch with images (``ImagePromptCollator``) is sampled with them, and the rollout
    carries each row's prompt images (``prompt_image_inputs``, ``prompt_<key>``: ``repeated_prompt_inputs``)."""
    from lightalign.datamodules.image_prompts import has_image_rows, repeated_prompt_inputs
    from lightalign.vision import model_inputs

    eos = eos_token_ids(model, tokenizer)
    prompt_inputs = None
    if has_image_rows(batch):  # the prompts repeated num_generations times, each with its images
        prompt_inputs = model_inputs(repeated_prompt_inputs(batch, num_generations), "prompt_")
    was_training = model.training
    model.eval()
    try:
        samples = sample_groups(
            model, batch["prompt_input_ids"], batch["prompt_attention_mask"], num_generations, backend=backend,
            eos=eos, pad_token_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens, share_prefill=share_prefill,
            continuous_config=continuous_config, return_logprobs=return_logprobs, prompt_inputs=prompt_inputs,
            **sampling)
    finally:
        model.train(was_training)
    return assemble_rollout(tokenizer, batch, num_generations, samples, eos)


def assemble_rollout(tokenizer: Any, batch: dict[str, Any], num_generations: int, samples: Samples,
                     eos: list[int]) -> dict[str, Any]:
    """The rollout ``sample_completions`` returns, from a sampler's ``Samples`` for ``batch`` (see there)."""
    from lightalign.datamodules.image_prompts import has_image_rows, repeated_prompt_inputs

    completion_ids, logps, lengths = samples
    completion_ids, completion_mask, truncated = cut_after_eos(completion_ids, eos, tokenizer.pad_token_id, lengths)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = [p for p in batch["prompts"] for _ in range(num_generations)]
    completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
    columns = {k: [v for v in vals for _ in range(num_generations)] for k, vals in batch["columns"].items()}
    columns["completion_ids"] = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask)]
    rollout = {
        "prompt_ids": batch["prompt_input_ids"].repeat_interleave(num_generations, 0),
        "prompt_mask": batch["prompt_attention_mask"].repeat_interleave(num_generations, 0),
        "completion_ids": completion_ids, "completion_mask": completion_mask, "truncated": truncated,
        "prompts": prompts, "completions": completions, "texts": texts, "columns": columns,
    }
    if has_image_rows(batch):  # each completion's prompt images, for every forward that scores it
        rollout.update(repeated_prompt_inputs(batch, num_generations))
    if logps is not None:  # 0 under the mask's zeros, also where a sampler left NaN (an engine's unscored token)
        rollout["sampling_logps"] = logps.masked_fill(completion_mask == 0, 0.0)
    return rollout
