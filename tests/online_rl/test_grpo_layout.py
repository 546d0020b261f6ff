"""GRPO's prompt_sharing: each prompt computed once for its completions (shared-prefix layout) gives the padded
layout's per-token log-probs, entropy and gradients, and a whole training step's gradient."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers.tuning import set_tuned
from lightalign.datamodules.shared_prefix import prompt_group_segments, shared_prefix_batch

PAD = 0


def _micro_batch(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Two prompts (3 and 5 tokens, left-padded) x 3 completions of various lengths (one runs to the limit),
    rows interleaved across the groups; completion tokens after a completion's end are padding."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (3,), generator=g), torch.randint(3, 200, (5,), generator=g)]
    lengths = torch.tensor([6, 1, 2, 6, 4, 3])
    group = [0, 1, 0, 1, 0, 1]
    width = 6
    prompt_ids = torch.full((6, 5), PAD)
    prompt_mask = torch.zeros(6, 5, dtype=torch.long)
    completion_ids = torch.full((6, width), PAD)
    for row, (k, n) in enumerate(zip(group, lengths.tolist())):
        p = prompts[k]
        prompt_ids[row, -len(p):], prompt_mask[row, -len(p):] = p, 1
        completion_ids[row, :n] = torch.randint(3, 200, (n,), generator=g)
    completion_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    mb = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
          "completion_mask": completion_mask}
    return mb, lengths


def test_rows_group_by_their_prompt():
    mb, lengths = _micro_batch()
    segments = prompt_group_segments(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], lengths)
    assert [len(prompt) for prompt, _ in segments] == [3, 5]
    assert [[row for row, _ in branches] for _, branches in segments] == [[0, 2, 4], [1, 3, 5]]
    for _, branches in segments:
        for row, tokens in branches:
            assert tokens == mb["completion_ids"][row, : lengths[row]].tolist()


@pytest.mark.parametrize("attn", ["sdpa", "sdpa_varlen", "eager"])
@pytest.mark.parametrize("pack_length", [1024, 8])  # one row, or one row per segment
def test_shared_token_logps_entropy_and_grads_equal_padded(grpo_module, attn, pack_length, monkeypatch):
    set_tuned(monkeypatch, "min_saved_scores_per_call", 0)  # sdpa_varlen: split even these short rows
    module = grpo_module(temperature=0.7)
    module.configure_model()
    module.model.set_attn_implementation(attn)
    mb, lengths = _micro_batch()
    segments = prompt_group_segments(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], lengths)
    shared = dict(mb, shared=shared_prefix_batch(segments, PAD, pack_length))
    assert shared["shared"]["input_ids"].shape[0] == (1 if pack_length == 1024 else 2)
    # the prompts are in the batch once: 3 + 5 prompt tokens + the completions' 22 tokens but each one's last
    # (only a target)
    assert int((shared["shared"]["branch"] >= 0).sum()) == 8 + int(lengths.sum()) - len(lengths)

    def run(batch):
        module.model.zero_grad(set_to_none=True)
        logps, entropy = module.token_logps(module.model, batch, with_entropy=True)
        (logps * batch["completion_mask"]).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}
        return logps.detach(), entropy, grads

    want, want_entropy, want_grads = run(mb)
    got, got_entropy, got_grads = run(shared)
    mask = mb["completion_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    assert (got[~mask] == 0).all()
    torch.testing.assert_close(got_entropy, want_entropy, atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys() and len(want_grads) > 5
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_training_step_gradient_equal_with_and_without_prompt_sharing(quiet_trainer, grpo_module, prompt_data,
                                                                       grad_capture):
    """One optimizer step over a whole rollout (dapo: normalised by the step's tokens, so the micro-batch split does
    not matter): the same gradient in both layouts, and prompt sharing puts whole groups in each micro-batch."""

    def one_step(sharing):
        L.seed_everything(0)  # the same rollout in both runs (generation comes before any shuffling)
        module = grpo_module(generation_batch_size=8, prompt_sharing=sharing, max_completion_length=8,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
        capture = grad_capture()
        quiet_trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[capture]).fit(module, prompt_data())
        return capture.grads[0], module.rollout_buffer.chunks

    plain, _ = one_step(False)
    shared, buffer = one_step(True)
    for mb in buffer:  # micro-batches of 4 = one group of num_generations=4: a single prompt
        rows = {tuple(p[m.bool()].tolist()) for p, m in zip(mb["prompt_ids"], mb["prompt_mask"])}
        assert len(rows) == 1 and mb["shared"]["input_ids"].shape[0] == 1
    assert plain.keys() == shared.keys() and plain
    assert any(g.abs().sum() > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], atol=1e-6, rtol=1e-4, msg=name)


def test_prompt_sharing_refuses_attention_without_4d_masks(grpo_module, quiet_trainer, prompt_data):
    """Refused at fit start, before any rollout (flash attention itself cannot load here: the config says it)."""
    module = grpo_module(prompt_sharing=True)
    module.configure_model()
    module.model.config._attn_implementation = "flash_attention_2"
    module.generate = lambda *a, **kw: pytest.fail("generated before refusing")
    with pytest.raises(ValueError, match="prompt_sharing.*custom 4D attention mask.*flash_attention_2"):
        quiet_trainer(max_steps=1).fit(module, prompt_data())
