"""Group sampling with the prompt prefill computed once equals plain ``generate(num_return_sequences=G)``."""

from __future__ import annotations

import pytest
import torch

from lightalign.modules.sampling.generate import generate_groups, prefill_shared_cache

PROMPTS = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 13, 14]])  # left-padded


@pytest.mark.parametrize("knobs", [dict(temperature=1.0, top_k=0),
                                   dict(temperature=0.7, top_p=0.9, repetition_penalty=1.3)])
def test_shared_prefill_samples_the_same_completions(tiny_model, knobs):
    mask = (PROMPTS != 0).long()
    outs = []
    for share in (False, True):
        torch.manual_seed(3)
        outs.append(generate_groups(tiny_model, PROMPTS, mask, 4, share_prefill=share, do_sample=True,
                                    max_new_tokens=10, pad_token_id=0, eos_token_id=[2], **knobs))
    assert outs[0].shape == (12, 15)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1][:, :5], PROMPTS.repeat_interleave(4, 0))  # rows grouped by prompt


def test_shared_cache_holds_each_prompt_once_then_repeats(tiny_model):
    mask = (PROMPTS != 0).long()
    cache = prefill_shared_cache(tiny_model, PROMPTS, mask, repeats=4)
    assert cache.get_seq_length() == PROMPTS.shape[1] - 1
    keys = cache.layers[0].keys
    assert keys.shape[0] == 12
    torch.testing.assert_close(keys[0], keys[3])  # copies of prompt 0
    assert not torch.allclose(keys[4], keys[0])  # prompt 1 differs
    # the cached keys are what a full forward of each prompt computes (left padding and positions handled)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        full = tiny_model(input_ids=PROMPTS, attention_mask=mask, position_ids=positions, use_cache=True)
    cached = full["cache"] if "cache" in full else full["past_key_values"]  # (`cache` from transformers 5.24)
    ref = cached.layers[0].keys[:, :, :-1]
    real = mask[:, :-1].bool()
    for row in range(3):
        torch.testing.assert_close(keys[4 * row][:, real[row]], ref[row][:, real[row]], atol=1e-5, rtol=0)


def test_grpo_module_rollout_identical_with_and_without_shared_prefill(grpo_module, prompt_data):
    data = prompt_data(batch_size=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    rollouts = []
    for share in (False, True):
        module = grpo_module(share_prefill=share, generation_backend="generate")
        torch.manual_seed(0)
        module.configure_model()
        module.tokenizer = data.tokenizer
        torch.manual_seed(5)
        rollouts.append(module.generate(batch, 4))
    assert torch.equal(rollouts[0]["completion_ids"], rollouts[1]["completion_ids"])
    assert rollouts[0]["texts"] == rollouts[1]["texts"]
