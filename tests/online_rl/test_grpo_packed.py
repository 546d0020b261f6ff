"""GRPO's padding_free: each [prompt, completion] one after the other in one row, no padding, positions restarting
per sequence and one attention call per sequence. The row's layout is checked token by token; log-probs, entropies
and the loss's gradients equal the padded layout's; whole GRPO and RLOO steps (old, reference log-probs,
top_entropy_quantile) give the padded run's gradient. Every family: tests/adaptations/test_conformance.py (``grpo_packed``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightalign.modules.losses.grpo import grpo_loss
from lightalign.modules.adaptations.layouts import packed_completion_batch

PAD = 0


def _micro_batch(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Four rows: prompts of 3, 5, 1 and 4 tokens (left-padded), completions of 6, 1, 3 and 5 tokens (right-padded;
    the 3-token one stops short of the widest)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths, lengths = [3, 5, 1, 4], torch.tensor([6, 1, 3, 5])
    prompt_ids = torch.full((4, 5), PAD)
    prompt_mask = torch.zeros(4, 5, dtype=torch.long)
    completion_ids = torch.full((4, 6), PAD)
    for row, (p, c) in enumerate(zip(prompt_lengths, lengths.tolist())):
        prompt_ids[row, 5 - p:] = torch.randint(3, 200, (p,), generator=g)
        prompt_mask[row, 5 - p:] = 1
        completion_ids[row, :c] = torch.randint(3, 200, (c,), generator=g)
    completion_mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask}, lengths


def test_packed_row_holds_each_sequence_once_with_its_own_positions():
    mb, lengths = _micro_batch()
    packed = packed_completion_batch(mb)
    want_ids, want_pos, want_index, start = [], [], [], 0
    for row in range(4):
        prompt = mb["prompt_ids"][row][mb["prompt_mask"][row].bool()].tolist()
        completion = mb["completion_ids"][row, : lengths[row]].tolist()
        seq = prompt + completion[:-1]  # the last completion token is only a target
        want_ids += seq
        want_pos += list(range(len(seq)))
        want_index += list(range(start + len(prompt) - 1, start + len(seq)))
        start += len(seq)
    assert packed["input_ids"].tolist() == [want_ids]
    assert packed["position_ids"].tolist() == [want_pos]
    assert packed["sequence_sizes"].tolist() == [3 + 5, 5 + 0, 1 + 2, 4 + 4]
    assert packed["logits_index"].tolist() == want_index
    mask = mb["completion_mask"].bool()
    assert packed["targets"].tolist() == mb["completion_ids"][mask].tolist()
    assert packed["target_sequence"].tolist() == mask.nonzero()[:, 0].tolist()
    assert packed["target_offset"].tolist() == mask.nonzero()[:, 1].tolist()
    # no padding token is computed: the row is the real tokens minus each completion's last one
    assert packed["input_ids"].shape[1] == int(mb["prompt_mask"].sum() + mb["completion_mask"].sum()) - 4


@pytest.mark.parametrize("attn", ["sdpa_varlen", "eager"])
def test_packed_logps_entropy_and_loss_grads_equal_padded(grpo_module, attn):
    module = grpo_module(temperature=0.7)
    module.configure_model()
    module.model.set_attn_implementation(attn)
    mb, _ = _micro_batch()
    packed = dict(mb, packed=packed_completion_batch(mb))
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])

    def run(batch):
        module.model.zero_grad(set_to_none=True)
        logps, entropy = module.token_logps(module.model, batch, with_entropy=True)
        loss, _ = grpo_loss(logps, None, advantages, batch["completion_mask"], loss_type="grpo")
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}
        return logps.detach(), entropy, grads

    want, want_entropy, want_grads = run(mb)
    got, got_entropy, got_grads = run(packed)
    mask = mb["completion_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    assert (got[~mask] == 0).all() and (got_entropy[~mask] == 0).all()
    torch.testing.assert_close(got_entropy, want_entropy, atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys() and len(want_grads) > 5
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def _one_step(module_factory, quiet_trainer, prompt_data, grad_capture, padding_free, **kw):
    L.seed_everything(0)  # the same rollout and the same micro-batch split in both runs
    module = module_factory(generation_batch_size=8, padding_free=padding_free, max_completion_length=8,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.0), **kw)
    capture = grad_capture()
    quiet_trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[capture]).fit(module, prompt_data())
    return capture.grads[0], module.rollout_buffer.chunks


def _assert_same_grads(plain, packed):
    assert plain.keys() == packed.keys() and plain
    assert any(g.abs().sum() > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(packed[name], plain[name], atol=1e-6, rtol=1e-4, msg=name)


def test_grpo_step_gradient_equal_with_and_without_padding_free(quiet_trainer, grpo_module, prompt_data,
                                                                grad_capture):
    """Old log-probs (steps_per_generation 4 > accumulation 2: the second optimizer step reuses the rollout),
    reference log-probs (beta) and the entropy mask (top_entropy_quantile) all computed in the packed layout."""
    kw = dict(beta=0.1, top_entropy_quantile=0.5, steps_per_generation=4)
    plain, plain_buffer = _one_step(grpo_module, quiet_trainer, prompt_data, grad_capture, False, **kw)
    packed, buffer = _one_step(grpo_module, quiet_trainer, prompt_data, grad_capture, True, **kw)
    for mb, ref in zip(buffer, plain_buffer):
        assert "packed" in mb and mb["packed"]["input_ids"].shape[0] == 1
        mask = ref["completion_mask"].bool()
        for key in ("old_logps", "ref_logps"):
            torch.testing.assert_close(mb[key][mask], ref[key][mask], atol=1e-5, rtol=1e-5)
    _assert_same_grads(plain, packed)


def test_rloo_step_gradient_equal_with_and_without_padding_free(quiet_trainer, tiny_dir, prompt_data, grad_capture):
    from lightalign import RLOOModule
    from lightalign.rewards import digit_fraction_reward

    def rloo(**kw):
        return RLOOModule(str(tiny_dir), from_config=True, reward_funcs=[digit_fraction_reward], num_generations=4,
                          beta=0.1, **kw)

    plain, _ = _one_step(rloo, quiet_trainer, prompt_data, grad_capture, False)
    packed, buffer = _one_step(rloo, quiet_trainer, prompt_data, grad_capture, True)
    assert all("packed" in mb for mb in buffer)
    _assert_same_grads(plain, packed)


def test_padding_free_knob(grpo_module):
    with pytest.raises(ValueError, match="padding_free and prompt_sharing .* set one"):
        grpo_module(padding_free=True, prompt_sharing=True)
    assert grpo_module(padding_free=True).batch_layout()[0] == "grpo_packed"
    assert grpo_module().batch_layout()[0] == "grpo_padded"


def test_padding_free_refused_on_alibi_at_fit_start(quiet_trainer, grpo_module, prompt_data, monkeypatch):
    """check_run refuses the layout before any rollout, naming the model, the knob, the measured difference and
    the alternative (the tiny model's verdict replaced by an inexact one: what the probe says of an ALiBi model)."""
    from lightalign.modules.adaptations import support
    from lightalign.modules.adaptations.probe import Verdict

    module = grpo_module(padding_free=True)
    module.generate = lambda *a, **kw: pytest.fail("generated before refusing")
    real = support.measured
    monkeypatch.setattr(support, "measured", lambda model, layout, *a, **kw: Verdict(layout, False, 0.7) if layout
                        == "grpo_packed" else real(model, layout, *a, **kw))
    with pytest.raises(ValueError, match=r"model\.padding_free .*cannot run exactly on .*7\.0e-01 nats.*"
                                         r"model\.padding_free: false"):
        quiet_trainer(max_steps=1).fit(module, prompt_data())


@pytest.mark.parametrize("name", ["gpt2", "opt", "mistral-sliding", "gemma3"])
def test_packed_loss_grads_equal_padded_across_families(name):
    """Learned absolute positions (GPT-2, OPT: counted from each row's first real token in the padded layout),
    sliding windows (6 tokens, shorter than the sequences) and OPT, whose own mask ignores position_ids (only the
    per-sequence attention keeps its packed sequences apart): the loss's gradients equal the padded layout's."""
    from helpers.conformance_models import build
    from lightalign.modules.adaptations import adapt_model, check_layout
    from lightalign.modules.training.rollout_forward import grpo_forward

    model = build(name).train()
    adapt_model(model)
    check_layout(model, "grpo_packed", max_tokens=32)
    mb, _ = _micro_batch(1)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])

    def grads(batch):
        model.zero_grad(set_to_none=True)
        logps, _, _ = grpo_forward(model, batch)
        grpo_loss(logps, None, advantages, batch["completion_mask"], loss_type="grpo")[0].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads(mb), grads(dict(mb, packed=packed_completion_batch(mb)))
    assert want.keys() == got.keys() and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-4, msg=f"{name}: {key}")
