"""sft_loss against a hand computation, and the accumulation-normalisation equivalence through Lightning."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightalign import SFTDataModule, SFTModule, sft_loss


def test_sft_loss_matches_hand_computation():
    # batch 1, seq 4, vocab 3; labels aligned with inputs, position 0 never a target, -100 masked.
    logits = torch.tensor(
        [[[1.0, 2.0, 0.0], [0.5, 0.5, 3.0], [2.0, -1.0, 0.0], [0.0, 0.0, 0.0]]]
    )
    labels = torch.tensor([[7, 2, -100, 1]])  # targets: pos1 (from logits[0]) = 2, pos3 (from logits[2]) = 1

    def nll(row, target):
        return -(row[target] - math.log(sum(math.exp(v) for v in row)))

    expected_sum = nll([1.0, 2.0, 0.0], 2) + nll([2.0, -1.0, 0.0], 1)
    loss, stats = sft_loss(logits, labels)
    assert stats["num_tokens"].item() == 2
    assert loss.item() == pytest.approx(expected_sum / 2, abs=1e-6)
    assert stats["nll_sum"].item() == pytest.approx(expected_sum, abs=1e-6)
    # argmax of logits[0] is 1 (target 2: miss), of logits[2] is 0 (target 1: miss)
    assert stats["num_correct"].item() == 0

    # an explicit step-wide denominator replaces the local count
    loss5, _ = sft_loss(logits, labels, num_items_in_batch=5)
    assert loss5.item() == pytest.approx(expected_sum / 5, abs=1e-6)


def test_sft_loss_gradient_only_from_target_positions():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    labels = torch.tensor([[1, 2, -100, -100, -100], [-100, -100, 3, 4, -100]])
    loss, _ = sft_loss(logits, labels)
    loss.backward()
    grad_rows = logits.grad.abs().sum(-1)
    # label (0,1) is predicted by logits (0,0); labels (1,2),(1,3) by logits (1,1),(1,2)
    expected = torch.zeros(2, 5, dtype=torch.bool)
    expected[0, 0] = expected[1, 1] = expected[1, 2] = True
    assert torch.equal(grad_rows > 0, expected)


def _step_gradients(tiny_dir, rows_path, batch_size, accumulate, grad_capture):
    L.seed_everything(0)
    module = SFTModule(str(tiny_dir), from_config=True, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    data = SFTDataModule(rows_path, tokenizer=str(tiny_dir), batch_size=batch_size, shuffle=False, max_length=64)
    capture = grad_capture()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[capture],
    )
    trainer.fit(module, data)
    assert len(capture.grads) == 1
    return capture.grads[0]


def test_accumulation_4x2_equals_one_batch_of_8(tiny_dir, write_jsonl, grad_capture):
    # Very different completion lengths per micro-batch: a per-micro-batch mean would weight them wrongly.
    completions = ["1", "22222222222222222222", "3", "4", "5555555555", "66", "7777777777777777", "8"]
    rows = [{"prompt": f"{i}+{i}=", "completion": c} for i, c in enumerate(completions)]
    path = write_jsonl(rows)
    full = _step_gradients(tiny_dir, path, batch_size=8, accumulate=1, grad_capture=grad_capture)
    accum = _step_gradients(tiny_dir, path, batch_size=2, accumulate=4, grad_capture=grad_capture)
    assert full.keys() == accum.keys() and full
    for name in full:
        torch.testing.assert_close(accum[name], full[name], atol=1e-6, rtol=0, msg=name)


def test_per_micro_batch_mean_would_differ(tiny_dir, write_jsonl, grad_capture):
    """Guard that the equivalence test can fail: the naive per-micro-batch mean gives another gradient."""
    from torch.utils.data import DataLoader

    completions = ["1", "22222222222222222222", "3", "4", "5555555555", "66", "7777777777777777", "8"]
    path = write_jsonl([{"prompt": f"{i}+{i}=", "completion": c} for i, c in enumerate(completions)])
    full = _step_gradients(tiny_dir, path, batch_size=8, accumulate=1, grad_capture=grad_capture)

    class NaiveData(SFTDataModule):
        def train_dataloader(self):
            return DataLoader(self.train_dataset, batch_size=2, shuffle=False, collate_fn=self.collate_fn())

    L.seed_everything(0)
    module = SFTModule(str(tiny_dir), from_config=True, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    capture = grad_capture()
    trainer = L.Trainer(accelerator="cpu", max_steps=1, accumulate_grad_batches=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[capture])
    trainer.fit(module, NaiveData(path, tokenizer=str(tiny_dir), max_length=64))
    naive = capture.grads[0]
    diffs = [(naive[n] - full[n]).abs().max().item() for n in full]
    assert max(diffs) > 1e-4
