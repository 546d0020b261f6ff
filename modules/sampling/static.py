"""The ``static`` generation backend: ``generate`` on a static KV cache with the decode step compiled.

``cache_implementation="static"`` preallocates the cache for prompt + ``max_new_tokens`` tokens, so every decode step
has the same shapes and ``torch.compile`` (transformers' ``CompileConfig``, forced on every device type) compiles the
forward once. On the CPU, prompts are left-padded to a multiple of 32 tokens (``static_prompt_bucket`` in
``tuned``'s table) so rollouts whose longest prompt differs reuse the compiled graph (left padding is
masked: the completions do not change); on other device types, where nothing was measured, they are not padded.
Sampling is ``generate``'s own (the same logits processors), so it is exactly what the knobs ask. The prefill runs
on every copy of a prompt. The compiled forward is traced on the first rollout: weight updates are seen (parameters
are graph inputs), forward hooks added to the model afterwards are not (torch's ``skip_nnmodule_hook_guards``; a
test holds it).

On the project's CPU inductor's first compilation takes minutes (measured, docs/performance.md), so this is not
the default there.
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.modules.training.device_tuning import tuned

COMPILE_BACKEND = "inductor"  # torch.compile backend of the decode step (tests use "eager": same graph, no codegen)


def bucket_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pad_token_id: int,
                   bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to the next multiple of ``bucket`` tokens (default: the prompts' device type's
    ``static_prompt_bucket`` in ``tuned``'s table)."""
    bucket = tuned("static_prompt_bucket", prompt_ids.device) if bucket is None else bucket
    extra = -prompt_ids.shape[1] % bucket
    if not extra:
        return prompt_ids, prompt_mask
    pad = prompt_ids.new_full((prompt_ids.shape[0], extra), pad_token_id)
    return torch.cat([pad, prompt_ids], 1), torch.cat([torch.zeros_like(pad), prompt_mask], 1)


def static_generate_kwargs() -> dict[str, Any]:
    """``generate`` arguments of the static backend: the static cache and a compile config valid on every device."""
    from transformers import CompileConfig

    compile_config = CompileConfig(fullgraph=False, dynamic=False, backend=COMPILE_BACKEND, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told otherwise
    return {"cache_implementation": "static", "compile_config": compile_config}
